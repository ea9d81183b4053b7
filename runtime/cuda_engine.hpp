#pragma once
// The CUDA engine: Llama and Qwen2 decoder-only transformers in bf16 on one GPU, over a paged KV
// pool, with chunked prefill and decode steps replayed from CUDA graphs (one per batch-size
// bucket). docs/cuda-engine.md: design, kernels, numerics and measured speed.
//
// Weights are loaded once per (checkpoint, device) in the process and shared read-only by every
// engine on that device (QKV and gate/up fused at load). Everything else (stream, KV pool,
// workspace, graphs) belongs to one engine, except a stream marked shared (one per device) and
// the SMs: an engine with sm_share < 1 runs in a green context holding its part of the device.
// Errors at load and CUDA errors in a step throw std::runtime_error naming the file:line of the
// failed call; bad step inputs throw std::invalid_argument before anything touches the device
// (the engine stays usable).
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/engine.hpp"
#include "runtime/hf_model.hpp"
#include "runtime/sampler.hpp"

namespace duet {

namespace kernels {
struct decode_layers_params;
}

/// Construction parameters of a cuda_engine.
struct cuda_engine_params {
  std::string served_name = "duet-cuda";  // engine_info.model; part of the layout hash
  int device = 0;
  uint32_t kv_blocks = 4096;  // KV pool size in blocks (when kv_memory_fraction == 0)
  double kv_memory_fraction =
      0.0;  // > 0: the pool takes this fraction of the memory free after load
  uint32_t block_tokens = 16;
  uint32_t max_context = 32768;    // capped at the model's max_position_embeddings
  uint32_t max_batch = 64;         // decode rows per graph launch (larger steps run in parts)
  uint32_t prefill_tokens = 2048;  // rows per prefill forward pass (longer steps run in pieces)
  bool high_priority = false;      // the stream gets the device's highest priority (decode actors)
  bool cuda_graphs = true;         // decode steps replay captured graphs
  // Capture every bucket's decode graph (and tune its GEMMs) when the engine is built, not on
  // the bucket's first step: a first capture in service stalls that step by 100-260 ms.
  bool graphs_at_start = true;
  // Make and tune the prefill passes' GEMM plans (one per bucket of rows) when the engine is
  // built: a prompt length of a new bucket would otherwise stall its step in service.
  bool prefill_gemms_at_start = true;
  double sm_share = 1.0;       // < 1: kernels run in a green context of this fraction of the SMs
  bool shared_stream = false;  // one stream for every such engine of the process on this device
  kv_pool_seat seat;           // a pool shared with other workers on this device (their sizes too)
  // Batch-1 decode steps run every layer in one persistent kernel (kernels/decode_layers.cuh)
  // where the shape and the SMs allow. Off: on an H100 it was 17 % slower than the kernels
  // apart (docs/cuda-engine.md). DUET_DECODE_FUSED=1 / 0 in the environment overrides this.
  bool fused_decode = false;
};

struct cuda_weights;

/// The weights of `dir` on `device`, loaded on first use and shared while any engine holds them.
[[nodiscard]] std::shared_ptr<const cuda_weights> load_cuda_weights_shared(
    const std::filesystem::path& dir, int device);

class cuda_engine final : public engine {
 public:
  cuda_engine(const std::filesystem::path& model_dir, cuda_engine_params params);
  ~cuda_engine() override;
  cuda_engine(const cuda_engine&) = delete;
  cuda_engine& operator=(const cuda_engine&) = delete;

  [[nodiscard]] const engine_info& info() const override { return info_; }
  [[nodiscard]] step_output prefill(std::span<const prefill_chunk> chunks) override;
  [[nodiscard]] step_output decode(std::span<const decode_slot> slots) override;
  void release(uint64_t seq_id) override;
  /// block_bytes per block; false (nothing copied) when a block id is outside the pool or `out`
  /// is not blocks.size() * block_bytes long. On a stream of its own, without waiting for a
  /// step in flight on another thread: the caller reads only blocks that step does not write.
  bool read_blocks(std::span<const uint32_t> blocks, std::span<std::byte> out) const override;
  bool write_blocks(std::span<const uint32_t> blocks, std::span<const std::byte> in) override;
  /// The pool as a CUDA IPC memory handle (taken once): another process on this host opens it
  /// and copies blocks device to device; an engine of this process uses the address itself.
  [[nodiscard]] msg::kv_pool_export export_pool() const override;
  [[nodiscard]] msg::kv_path can_import() const override { return msg::kv_path::cuda_ipc; }
  [[nodiscard]] kv_pool_seat pool_seat() const override { return params_.seat; }
  /// One gather kernel on this engine's stream copies every block (kernels/kv_copy.cuh).
  bool import_blocks(const msg::kv_pool_export& from, std::span<const uint32_t> src, std::span<const uint32_t> dst,
                     std::string& error) override;

  /// The sampled tokens of the last prefill or decode call, in step_output order, with their
  /// log-probabilities and top_logprobs (at most 32 each).
  [[nodiscard]] const std::vector<sample_result>& last_samples() const { return samples_; }
  /// Keep a host copy of every sampled row's logits (vocab_size floats each) for last_logits().
  void keep_logits(bool keep) { keep_logits_ = keep; }
  /// The logits behind last_samples()[i] (needs keep_logits(true) before the step).
  [[nodiscard]] std::span<const float> last_logits(std::size_t i) const;

  [[nodiscard]] const transformer_config& config() const;
  [[nodiscard]] uint32_t kv_blocks() const { return kv_blocks_; }
  /// The KV pool (kv_blocks() blocks of info().block_bytes) on the device, for benchmarks that
  /// fill it directly.
  [[nodiscard]] void* kv_pool() const { return pool_; }
  /// Bytes of weights on the device (shared).
  [[nodiscard]] uint64_t weight_bytes() const;
  /// Decode steps so far that ran from a captured graph / eagerly.
  [[nodiscard]] uint64_t graph_steps() const { return graph_steps_; }
  [[nodiscard]] uint64_t eager_steps() const { return eager_steps_; }
  /// Whether batch-1 decode steps run in the one-kernel path (kernels/decode_layers.cuh).
  [[nodiscard]] bool fused_decode() const { return fused_ctas_ > 0; }
  /// SMs this engine's kernels run on: its green context's grant (sm_share < 1), else the device's.
  [[nodiscard]] uint32_t sm_count() const { return static_cast<uint32_t>(sm_count_); }

 private:
  struct device_buffers;
  struct pass;
  struct sm_partition;
  /// While alive, the engine's green context is current on this thread and the thread's previous
  /// context comes back at the end (a green context may be current to one thread at a time, and
  /// CAF moves actors between threads). Without one: cudaSetDevice, left in place as before.
  class device_scope {
   public:
    device_scope(void* green_ctx, int device, bool check);
    ~device_scope();
    device_scope(const device_scope&) = delete;
    device_scope& operator=(const device_scope&) = delete;

   private:
    void* previous_ = nullptr;  // CUcontext
    bool restore_ = false;
  };
  struct decode_graph {
    void* exec = nullptr;  // cudaGraphExec_t
    uint32_t max_splits = 1;
    bool failed = false;
  };

  /// Every entry point that touches the device starts with this.
  [[nodiscard]] device_scope bind_device(bool check = true) const;
  void forward(const pass& ps, void* stream);
  void forward_layers(const pass& ps, void* stream);  // embedding .. final norm, kernels apart
  void forward_head(const pass& ps, void* stream);    // LM head and sampling
  void prepare_fused_decode();
  [[nodiscard]] kernels::decode_layers_params fused_params() const;
  /// The batch-1 decode layers in one kernel; false when it is off or cannot run here.
  bool run_fused_layers(void* stream);
  void upload(const pass& ps);
  void run_pass(pass& ps, std::vector<sample_result>& results, std::vector<float>& kept_logits);
  void finish_samples(const pass& ps, std::vector<sample_result>& results,
                      std::vector<float>& kept_logits);
  /// `rows` > 0: run that many rows (a bucket) whatever `slots` holds, the rest padding.
  void decode_part(std::span<const decode_slot> slots, std::vector<sample_result>& results,
                   std::vector<float>& kept_logits, uint32_t rows = 0);
  void capture_decode_graphs();
  void warm_prefill_gemms();
  [[nodiscard]] uint32_t bucket_of(uint32_t rows) const;
  [[nodiscard]] uint32_t splits_for(uint32_t rows) const;
  void check_blocks(std::span<const uint32_t> blocks, uint64_t positions, const char* what) const;
  bool enable_peer(int device, std::string& error);

  std::shared_ptr<const cuda_weights> weights_;
  cuda_engine_params params_;
  engine_info info_;
  std::unique_ptr<sm_partition> partition_;  // declared before the streams: destroyed after them
  std::shared_ptr<void> stream_owner_;       // the stream; shared by engines when shared_stream
  std::shared_ptr<void> capture_owner_;      // shared_stream: a private stream for graph capture
  void* stream_ = nullptr;                   // cudaStream_t, stream_owner_.get()
  void* capture_stream_ = nullptr;  // where decode graphs are captured (stream_ unless shared)
  // read_blocks copies here: a prefill step may be computing on stream_ meanwhile (from another
  // thread), and the blocks read are finished ones, so the copy need not wait for it.
  std::shared_ptr<void> read_stream_owner_;
  struct read_staging;  // pinned buffers read_blocks copies through, made on first use
  mutable std::unique_ptr<read_staging> read_staging_;
  mutable std::once_flag read_staging_made_;
  bool staged_reads_ = true;  // DUET_KV_READ_STAGING=0: copy straight to pageable memory (A/B runs)
  bool split_sampling_ = true;  // DUET_SAMPLE_SPLIT=0: one CTA per row reads its logits twice
  void read_blocks_staged(std::span<const uint32_t> blocks, std::span<std::byte> out) const;
  std::unique_ptr<device_buffers> buf_;
  void allocate_pool(uint64_t block_bytes);
  std::shared_ptr<void> pool_memory_;  // the pool's allocation (shared with the seat's other members)
  void* pool_ = nullptr;
  uint32_t kv_blocks_ = 0;      // usable block ids: every member's when the pool is shared
  uint32_t pool_slots_ = 0;     // blocks addressable from pool_ (every member's, scratch included)
  uint32_t scratch_block_ = 0;  // takes the writes of padded decode rows (this engine's own)
  uint64_t block_elems_ = 0;
  int sm_count_ = 0;
  uint32_t fused_ctas_ = 0;  // grid of the batch-1 decode kernel; 0: off
  uint32_t fused_poll_ns_ = 128;    // DUET_DECODE_FUSED_POLL_NS
  uint32_t fused_l2_bytes_ = 0;  // DUET_DECODE_FUSED_L2_KB
  std::string fused_trace_path_;    // DUET_DECODE_TRACE: the last batch-1 step's barrier times
  void write_fused_trace(uint32_t context) const;
  std::map<uint32_t, decode_graph> graphs_;
  std::vector<uint32_t> buckets_;
  bool keep_logits_ = false;
  std::vector<sample_result> samples_;
  std::vector<float> logits_host_;
  std::vector<sampler> host_sampler_{
      1};  // rows whose requests have penalties are sampled on the host
  std::unordered_map<uint64_t, std::vector<int32_t>>
      prompt_tokens_;               // penalties: prompt seen so far
  mutable std::string ipc_handle_hex_;           // cudaIpcGetMemHandle of pool_, taken on first export
  std::map<std::string, void*> opened_pools_;    // other processes' pools, opened once each
  uint32_t* copy_ids_ = nullptr;                 // device: source then destination ids of an import
  std::set<int> peers_;             // devices whose memory this engine's context may read
  uint32_t attention_variant_ = 0;  // kernels/attention.cuh variant: 5 on sm_90, else 0
  // Prefill adds the o and down projections to the residual stream inside their GEMMs
  // (gemm_params::accumulate); DUET_RESIDUAL_GEMM=0: a separate add in the next RMSNorm, as
  // decode; =o: the o projection only.
  bool residual_in_o_ = true;
  bool residual_in_down_ = true;
                                    // (DUET_CUDA_ATTN_VARIANT overrides)
  uint64_t graph_steps_ = 0;
  uint64_t eager_steps_ = 0;
};

/// engine.kind "cuda": loads config.model.path on actor.device with the actor's KV pool size
/// (kv_blocks, or kv_memory_fraction of free memory), max_batch, chunk_tokens, sm_share and stream
/// ("shared": shared_stream); decode actors get the high-priority stream.
[[nodiscard]] std::unique_ptr<engine> make_cuda_engine(const deployment_config& config,
                                                       const actor_config& actor, const kv_pool_seat& seat = {});

}  // namespace duet
