#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "messages/catalogue.hpp"
#include "runtime/block_manager.hpp"
#include "runtime/engine.hpp"
#include "runtime/kv_stream.hpp"
#include "runtime/outbox.hpp"

namespace duet {

struct prefill_settings {
  std::string router;  // address of the router
  std::string broker;  // address of the KV-handle broker
  uint32_t kv_blocks = 4096;
  uint32_t chunk_tokens = 2048;   // tokens per step, across sequences
  uint32_t max_batch = 64;        // sequences per step
  uint32_t register_timeout_ms = 5000;
  // After a step that finished prompts, the next step waits up to this long for the broker's
  // acks when the engine computes on the actor's thread (cuda, cpu: no modelled time), which
  // would otherwise hold those prompts' first tokens (prefill_done) until the next step ends.
  // 0: never wait.
  uint32_t register_hold_ms = 5;
  uint32_t lease_grace_ms = 2000;  // after the lease, the owner may reclaim by itself
  kv_stream_settings stream;       // the stream transfer path, when the broker asks for it
};

/// Ordered states of a prompt in a prefill worker.
enum class prefill_state : uint8_t { waiting, running, registering, handed_over };

/// Chunked prefill over a paged KV pool. A step takes up to chunk_tokens tokens from the
/// queue head (FCFS, several sequences per step), runs the engine, and when a prompt is
/// done registers its KV with the broker; the blocks stay owned here until the broker
/// says kv_release (after the decode side confirmed, or on nack, drop or lease expiry).
class prefill_core {
 public:
  prefill_core(std::string self, prefill_settings settings, engine& engine);

  /// `received_ms`: when the node handed the request to this actor, which reads its mailbox
  /// only between synchronous engine steps; the prompt's queue time starts there.
  void on_request(const msg::envelope& env, const msg::prefill_request& m, int64_t now_ms, int64_t received_ms = -1);
  void on_cancel(const msg::cancel_seq& m);
  void on_registered(const msg::kv_registered& m, int64_t now_ms);
  void on_release(const msg::kv_release& m);
  /// The broker chose the stream path: send this handle's blocks to the adopter.
  void on_kv_send(const std::string& from, const msg::kv_send& m);
  void on_chunk_ack(const std::string& from, const msg::kv_chunk_ack& m);

  /// Runs the engine on the next chunks. Returns how long the actor must wait before
  /// finish_step (sim engine), or nothing when there is no work.
  [[nodiscard]] std::optional<std::chrono::nanoseconds> begin_step(int64_t now_ms);
  void finish_step(int64_t now_ms);
  /// Deadlines and bounded waits: expired prompts fail, lost acks are given up on.
  void tick(int64_t now_ms);

  [[nodiscard]] outbox& out() { return out_; }
  [[nodiscard]] const block_manager& pool() const { return pool_; }
  [[nodiscard]] msg::load_report load() const;
  [[nodiscard]] std::map<std::string, uint64_t> counters() const;
  [[nodiscard]] bool step_in_flight() const { return !in_flight_.empty(); }

 private:
  struct job {
    uint64_t seq_id = 0;
    std::vector<int32_t> tokens;
    msg::sampling_params sampling;
    std::string stream_to;  // broker.stream_prefill: finished blocks go to this decode worker
    int64_t deadline_ms = 0;
    std::vector<uint32_t> blocks;
    uint32_t done = 0;  // tokens prefilled
    prefill_state state = prefill_state::waiting;
    bool cancelled = false;
    msg::finish_reason cancel_reason = msg::finish_reason::cancelled;
    int32_t first_token = 0;
    std::optional<msg::token_logprobs> first_logprobs;  // when the request asked
    int64_t wait_until_ms = 0;  // registering: ack timeout; handed_over: lease + grace
    // The TTFT hop breakdown (hop_stats.hpp): accepted, first chunk's step began, last one ended.
    int64_t accepted_ms = 0, started_ms = 0, computed_ms = 0;
  };
  struct planned {
    uint64_t seq_id;
    uint32_t tokens;
    bool last;
  };
  void fail(job& j, msg::finish_reason reason, msg::error_code code, const std::string& message);
  void free_job(uint64_t seq_id);

  prefill_settings settings_;
  engine& engine_;
  outbox out_;
  block_manager pool_;
  kv_stream_sender sender_;
  std::unordered_map<uint64_t, job> jobs_;
  std::deque<uint64_t> queue_;  // waiting or partly prefilled, FCFS
  std::vector<planned> in_flight_;
  step_output in_flight_output_;
  std::map<std::string, uint64_t> counters_;
  std::unordered_set<uint64_t> unacked_;  // registered by the last step, ack not yet here
  int64_t hold_until_ms_ = 0;
  int64_t step_began_ms_ = 0;
};

}  // namespace duet
