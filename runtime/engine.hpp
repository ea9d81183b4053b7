#pragma once
// The engine interface: what prefill and decode actors call, whatever runs the math
// (sim: a cost model; cpu: the fp32 reference; cuda: the GPU engine).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "messages/catalogue.hpp"
#include "runtime/block_manager.hpp"
#include "runtime/config.hpp"
#include "runtime/sampler.hpp"

namespace duet {

/// What the rest of the system needs to know about a loaded model and its KV layout.
struct engine_info {
  std::string engine;          // "sim" | "cpu" | "cuda"
  std::string model;           // served model name
  uint32_t vocab_size = 0;
  uint32_t max_context = 0;
  uint32_t block_tokens = 16;
  uint64_t block_bytes = 0;    // one block: every layer's K and V for block_tokens tokens
  uint32_t kv_blocks = 0;      // this worker's blocks when the engine sized its pool (0: the config's)
  uint64_t layout_hash = 0;    // model, dtype, KV layout and block size; peers must agree
  std::vector<int32_t> eos_ids;
};

/// One chunk of one prompt in a prefill step.
struct prefill_chunk {
  uint64_t seq_id = 0;
  std::span<const int32_t> tokens;   // this chunk's tokens
  uint32_t start = 0;                // position of tokens[0] in the sequence
  std::span<const uint32_t> blocks;  // block table of the whole sequence
  bool last = false;                 // the prompt ends with this chunk: sample a token
  const msg::sampling_params* sampling = nullptr;
};

/// One sequence in a decode step.
struct decode_slot {
  uint64_t seq_id = 0;
  std::span<const int32_t> history;  // prompt + generated so far; back() is the input token
  std::span<const uint32_t> blocks;
  const msg::sampling_params* sampling = nullptr;
};

struct step_output {
  std::vector<int32_t> tokens;  // one per `last` chunk (in order) or per decode slot
  /// Empty (no sequence of the step asked), or one per token: the token's log-probabilities
  /// where its sequence's sampling wants_logprobs(), nullopt elsewhere. The sim engine
  /// leaves it empty.
  std::vector<std::optional<msg::token_logprobs>> logprobs;
  std::chrono::nanoseconds modeled{0};  // time the actor must still wait (sim engine only)
  std::chrono::nanoseconds engine_wall{0};  // the engine call's wall time (the cores time it)

  /// Token i's log-probabilities; null when it has none.
  [[nodiscard]] const msg::token_logprobs* logprobs_at(std::size_t i) const {
    return i < logprobs.size() && logprobs[i] ? &*logprobs[i] : nullptr;
  }
};

/// Appends one sampled token to `out`, with its log-probability and its first
/// sampling->top_logprobs alternatives when `sampling` wants_logprobs().
inline void step_output_push(step_output& out, const sample_result& sample, const msg::sampling_params* sampling) {
  out.tokens.push_back(sample.token);
  if (sampling == nullptr || !sampling->wants_logprobs()) {
    if (!out.logprobs.empty()) out.logprobs.emplace_back();
    return;
  }
  out.logprobs.resize(out.tokens.size() - 1);
  msg::token_logprobs lp;
  lp.logprob = sample.logprob;
  const std::size_t n = std::min<std::size_t>(sample.top.size(), sampling->top_logprobs);
  for (std::size_t k = 0; k < n; ++k) {
    lp.top_ids.push_back(sample.top[k].token);
    lp.top_logprobs.push_back(sample.top[k].logprob);
  }
  out.logprobs.push_back(std::move(lp));
}

/// The prefill and decode workers of one node whose engines share one KV pool: same engine
/// kind and device, broker.transfer = "auto". The first engine to start allocates the pool
/// for every member (its memory and the kv_arena that says which member owns which block);
/// a handover between members then moves block ownership, no bytes (path same_pool).
struct shared_kv_pool {
  std::vector<const actor_config*> members;  // in the config's order
  std::mutex mutex;                          // held while the first engine allocates
  std::shared_ptr<kv_arena> arena;
  std::shared_ptr<void> memory;  // keeps the allocation alive (engine-defined deleter)
  std::byte* base = nullptr;     // host or device address of block 0
  uint64_t bytes = 0;
  std::string shm_name;          // cpu: the POSIX shared-memory region, when the pool is one
};

/// One worker's place in a shared_kv_pool.
struct kv_pool_seat {
  std::shared_ptr<shared_kv_pool> pool;
  uint32_t member = 0;
  [[nodiscard]] explicit operator bool() const { return pool != nullptr; }
};

class engine {
 public:
  virtual ~engine() = default;
  [[nodiscard]] virtual const engine_info& info() const = 0;
  [[nodiscard]] virtual step_output prefill(std::span<const prefill_chunk> chunks) = 0;
  [[nodiscard]] virtual step_output decode(std::span<const decode_slot> slots) = 0;
  /// The sequence is gone; drop per-sequence state (RNG, caches).
  virtual void release(uint64_t seq_id) {}
  /// KV bytes of `blocks` (info().block_bytes each, in order) for a transfer to another
  /// pool; engines without KV storage (sim) copy nothing and return false.
  virtual bool read_blocks(std::span<const uint32_t> blocks, std::span<std::byte> out) const { return false; }
  /// Writes transferred KV bytes into `blocks` of this engine's pool.
  virtual bool write_blocks(std::span<const uint32_t> blocks, std::span<const std::byte> in) { return false; }
  /// The pool as other processes on this host can map it (host_shm: cpu, cuda_ipc: cuda);
  /// path none when it cannot be shared.
  [[nodiscard]] virtual msg::kv_pool_export export_pool() const { return {}; }
  /// The pool this engine shares with other workers of its process, or none (a pool of its own).
  [[nodiscard]] virtual kv_pool_seat pool_seat() const { return {}; }
  /// The kind of exported pool this engine copies from (none: only the stream path).
  [[nodiscard]] virtual msg::kv_path can_import() const { return msg::kv_path::none; }
  /// Copies blocks `src` of the exported pool `from` into `dst` of this pool, in order.
  /// False with `error` set when the pool cannot be mapped or a block is out of range.
  virtual bool import_blocks(const msg::kv_pool_export& from, std::span<const uint32_t> src,
                             std::span<const uint32_t> dst, std::string& error) {
    error = "this engine cannot import KV pools";
    return false;
  }
};

/// Builds the engine the config asks for, in `seat` of a pool shared with other workers
/// when given. Throws std::runtime_error with a reason.
[[nodiscard]] std::unique_ptr<engine> make_engine(const deployment_config& config,
                                                  const actor_config& actor, const kv_pool_seat& seat = {});

/// The seats of the node's workers whose engines share a KV pool (see shared_kv_pool), by
/// actor name; workers that share with none are absent.
[[nodiscard]] std::map<std::string, kv_pool_seat> plan_shared_kv_pools(const deployment_config& config,
                                                                       const node_config& node);

/// The block accounting a worker keeps for its engine: its seat in a shared pool, or a pool
/// of its own of the engine's size (or `configured_blocks` when the engine does not say).
[[nodiscard]] block_manager make_block_manager(const engine& engine, uint32_t configured_blocks);

/// FNV-1a over the fields peers must agree on.
[[nodiscard]] uint64_t layout_hash(std::string_view model, std::string_view dtype,
                                   uint32_t layers, uint32_t kv_heads, uint32_t head_dim,
                                   uint32_t block_tokens);

}  // namespace duet
