#pragma once
// The fp32 CPU reference engine: Llama and Qwen2 decoder-only transformers over a paged KV
// pool, chunked prefill and batched decode, multithreaded over rows and heads.
// docs/cpu-engine.md: design, KV block layout, numerics and measured speed.
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "runtime/engine.hpp"
#include "runtime/kv_pool_share.hpp"
#include "runtime/gguf_model.hpp"
#include "runtime/hf_model.hpp"
#include "runtime/sampler.hpp"

namespace duet {

/// Where K and V live inside one KV block. A block holds every layer's K and V for
/// block_tokens tokens, as floats indexed [layer][0 = K, 1 = V][kv_head][slot][head_dim];
/// block_bytes is that size rounded up to 256 bytes, so every block starts 256-byte aligned
/// in a pool whose base is.
struct kv_block_layout {
  uint32_t layers = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t block_tokens = 0;
  uint64_t block_bytes = 0;

  [[nodiscard]] static kv_block_layout make(uint32_t layers, uint32_t kv_heads, uint32_t head_dim,
                                            uint32_t block_tokens);
  /// Floats from a block's start to token `slot` of (layer, kv, kv_head).
  [[nodiscard]] uint64_t offset(uint32_t layer, uint32_t kv, uint32_t kv_head, uint32_t slot) const {
    return ((static_cast<uint64_t>(layer) * 2 + kv) * kv_heads + kv_head) * block_tokens * head_dim +
           static_cast<uint64_t>(slot) * head_dim;
  }
  [[nodiscard]] uint64_t block_floats() const { return block_bytes / sizeof(float); }
};

/// RoPE inverse frequencies (head_dim / 2 of them) as Hugging Face computes them in float32:
/// default RoPE, or rope_type "llama3" exactly as transformers' _compute_llama3_parameters.
[[nodiscard]] std::vector<float> rope_inv_freq(const transformer_config& config);

/// Precomputed cos/sin for positions [0, positions): angle = float32(inv_freq * position),
/// as transformers' rotary embedding forms it, then cos/sin rounded to float.
class rope_table {
 public:
  rope_table(const transformer_config& config, uint32_t positions);
  [[nodiscard]] std::span<const float> inv_freq() const { return inv_freq_; }
  [[nodiscard]] uint32_t positions() const { return positions_; }
  [[nodiscard]] uint32_t half() const { return half_; }
  /// head_dim / 2 values for `position`.
  [[nodiscard]] const float* cos(uint32_t position) const { return cos_.data() + std::size_t{position} * half_; }
  [[nodiscard]] const float* sin(uint32_t position) const { return sin_.data() + std::size_t{position} * half_; }
  /// Rotates one head vector (head_dim floats) in place, rotate-half pairing (i, i + half):
  /// x * cos + rotate_half(x) * sin.
  void apply(float* x, uint32_t position) const;

 private:
  std::vector<float> inv_freq_;
  std::vector<float> cos_;
  std::vector<float> sin_;
  uint32_t positions_ = 0;
  uint32_t half_ = 0;
};

/// Inputs of one causal attention over a paged KV pool (one sequence, one layer).
struct paged_attention_params {
  const float* q = nullptr;            // [tokens, heads, head_dim], RoPE applied
  float* out = nullptr;                // [tokens, heads, head_dim]
  const float* pool = nullptr;         // KV pool base; block b starts at b * layout.block_floats()
  kv_block_layout layout;
  const uint32_t* block_table = nullptr;  // the sequence's blocks, position p in block_table[p / block_tokens]
  uint32_t layer = 0;
  uint32_t heads = 0;                  // query heads; head h reads kv head h / (heads / kv_heads)
  uint32_t start = 0;                  // position of q's token 0; token t attends to [0, start + t]
  float scale = 1.0f;                  // softmax scale, 1 / sqrt(head_dim)
  bool fp16_probs = false;             // round the probabilities to fp16 before weighting V (native path)
};

/// Attention of query `token`, head `head`. `scratch` holds at least start + token + 1 floats.
void paged_attention(const paged_attention_params& p, uint32_t token, uint32_t head, float* scratch);

/// A small fixed pool of threads; the caller takes part in every run. Between runs, workers
/// spin for up to ~100 µs before sleeping (as OpenMP runtimes do), so the hundreds of short
/// runs of one decode step do not each pay a futex wake-up.
class worker_pool {
 public:
  /// `threads` workers in all, the calling thread included (at least 1).
  explicit worker_pool(unsigned threads);
  ~worker_pool();
  worker_pool(const worker_pool&) = delete;
  worker_pool& operator=(const worker_pool&) = delete;

  [[nodiscard]] unsigned size() const { return static_cast<unsigned>(threads_.size()) + 1; }
  /// Calls fn(task, worker) for every task in [0, tasks), spread over the workers; returns when
  /// all are done. worker is in [0, size()). The first exception thrown is rethrown here.
  void run(std::size_t tasks, const std::function<void(std::size_t task, unsigned worker)>& fn);

 private:
  void work(unsigned worker);
  void drain(unsigned worker);

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(std::size_t, unsigned)>* job_ = nullptr;
  std::size_t tasks_ = 0;
  std::atomic<std::size_t> next_{0};  // the next task to hand out
  // Changed under mutex_ (so sleepers cannot miss a change) but read without it while spinning.
  std::atomic<uint64_t> generation_{0};
  std::atomic<unsigned> busy_{0};
  std::atomic<bool> stop_{false};
  std::exception_ptr error_;
};

/// Construction parameters of a cpu_engine.
struct cpu_engine_params {
  std::string served_name = "duet-cpu";  // engine_info.model; part of the layout hash
  uint32_t kv_blocks = 4096;             // KV pool size in blocks
  uint32_t block_tokens = 16;
  uint32_t max_context = 32768;          // capped at the model's max_position_embeddings
  uint32_t threads = 0;                  // 0 = std::thread::hardware_concurrency()
  kv_pool_seat seat;                     // a pool shared with other workers (kv_blocks per member)
};

/// The fp32 reference engine. Prefill and decode validate every input before touching the KV
/// pool and throw std::invalid_argument naming the problem (the engine stays usable).
///
/// Built from a gguf_native_model it runs the "native" path instead: every matrix product
/// multiplies the GGUF's own blocks (Q4_0, Q4_1, Q8_0) by activations first rounded to ggml's
/// 8-bit blocks (Q8_0, Q8_1), exactly as ggml's AVX2 CPU backend computes each dot product,
/// and K, V, q and the attention probabilities are rounded to fp16 as llama.cpp's default f16
/// KV cache does. Everything else is the fp32 path. docs/cpu-engine.md.
class cpu_engine final : public engine {
 public:
  cpu_engine(std::shared_ptr<const model_weights> weights, cpu_engine_params params);
  cpu_engine(std::shared_ptr<const gguf_native_model> model, cpu_engine_params params);
  ~cpu_engine() override;

  [[nodiscard]] const engine_info& info() const override { return info_; }
  [[nodiscard]] step_output prefill(std::span<const prefill_chunk> chunks) override;
  [[nodiscard]] step_output decode(std::span<const decode_slot> slots) override;
  void release(uint64_t seq_id) override;
  /// Copies block_bytes per block; false (nothing copied) when a block id is outside the pool
  /// or `out` is not blocks.size() * block_bytes long.
  bool read_blocks(std::span<const uint32_t> blocks, std::span<std::byte> out) const override;
  bool write_blocks(std::span<const uint32_t> blocks, std::span<const std::byte> in) override;
  /// The pool lives in POSIX shared memory: another process on this host maps it read-only.
  [[nodiscard]] msg::kv_pool_export export_pool() const override;
  [[nodiscard]] kv_pool_seat pool_seat() const override { return params_.seat; }
  [[nodiscard]] msg::kv_path can_import() const override { return msg::kv_path::host_shm; }
  bool import_blocks(const msg::kv_pool_export& from, std::span<const uint32_t> src, std::span<const uint32_t> dst,
                     std::string& error) override;

  /// The sampled tokens of the last prefill or decode step, in step_output order, with their
  /// log-probabilities and top_logprobs.
  [[nodiscard]] const std::vector<sample_result>& last_samples() const { return samples_; }
  /// The raw logits (vocab_size floats) behind last_samples()[i].
  [[nodiscard]] std::span<const float> last_logits(std::size_t i) const;

  [[nodiscard]] const model_weights& weights() const { return *weights_; }
  /// Whether this engine runs the native (ggml block) path.
  [[nodiscard]] bool native() const { return native_ != nullptr; }
  [[nodiscard]] const kv_block_layout& kv_layout() const { return layout_; }
  [[nodiscard]] const rope_table& rope() const { return rope_; }
  [[nodiscard]] unsigned threads() const { return pool_.size(); }
  /// "avx2+fma" or "generic": the kernels chosen for this CPU, once per process
  /// (DUET_CPU_KERNELS=generic forces the portable ones).
  [[nodiscard]] static const char* kernel_name();

 private:
  struct row_group;  // the rows of one sequence in a step
  cpu_engine(std::shared_ptr<const model_weights> weights, std::shared_ptr<const gguf_native_model> native,
             cpu_engine_params params);
  // y = x w^T (+ bias) for the fp32 matrix `w` or, on the native path, `blocks`.
  void linear(const float* x, std::size_t m, std::size_t k, const std::vector<float>& w, const ggml_matrix* blocks,
              std::size_t n, const std::vector<float>& bias, float* y);
  void forward(std::span<const int32_t> tokens, std::span<const row_group> groups,
               std::span<const uint32_t> output_rows);
  void check_blocks(std::span<const uint32_t> blocks, uint64_t positions, const char* what) const;
  [[nodiscard]] float* block_ptr(uint32_t block) const;

  std::shared_ptr<const model_weights> weights_;
  std::shared_ptr<const gguf_native_model> native_;  // null: the fp32 path
  cpu_engine_params params_;
  engine_info info_;
  kv_block_layout layout_;
  rope_table rope_;
  worker_pool pool_;
  void allocate_pool();
  std::shared_ptr<void> kv_memory_;  // shared memory (zero pages until touched), or private when
  std::string kv_shm_name_;          // /dev/shm has no room (then this is empty)
  float* kv_ = nullptr;              // the pool's bytes as floats
  uint64_t kv_bytes_ = 0;
  uint32_t kv_total_blocks_ = 0;     // block ids of the pool: every member's when shared
  mutable shm_mappings imported_;           // other processes' pools, mapped once each

  // Step workspace, reused across steps.
  std::vector<float> x_, h_, q_, k_, v_, attn_, gate_, up_;
  std::vector<float> logits_;
  std::vector<std::byte> quantized_;  // native path: activations in ggml's 8-bit blocks
  std::vector<std::vector<float>> scratch_;  // per worker: attention scores
  std::vector<sampler> samplers_;            // per worker
  std::vector<sample_result> samples_;
  // Prompt tokens of sequences whose sampling has penalties, while their prefill is running.
  std::unordered_map<uint64_t, std::vector<int32_t>> prompt_tokens_;
};

/// engine.kind "cpu": loads config.model.path (a Hugging Face model directory, or a GGUF file
/// recognised by its magic; weights shared by every engine of the process that loads the same
/// path) with actor.kv_blocks blocks, in `seat` of a shared pool when given. A GGUF runs on
/// the native path unless model.dtype is "f32", which dequantizes every matrix to fp32 (the
/// reference path).
[[nodiscard]] std::unique_ptr<engine> make_cpu_engine(const deployment_config& config, const actor_config& actor,
                                                      const kv_pool_seat& seat = {});

}  // namespace duet
