#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "messages/catalogue.hpp"
#include "runtime/block_manager.hpp"
#include "runtime/engine.hpp"
#include "runtime/kv_stream.hpp"
#include "runtime/outbox.hpp"
#include "runtime/step_log.hpp"
#include "runtime/step_thread.hpp"

namespace duet {

struct prefill_settings {
  std::string router;  // address of the router
  std::string broker;  // address of the KV-handle broker
  uint32_t kv_blocks = 4096;
  uint32_t chunk_tokens = 2048;   // tokens per step, across sequences
  uint32_t max_batch = 64;        // sequences per step
  uint32_t register_timeout_ms = 5000;
  // After a step that finished prompts, the next step waits up to this long for the broker's
  // acks when the engine computes on the actor's thread (cuda, cpu without compute_in_background:
  // no modelled time), which would otherwise hold those prompts' first tokens (prefill_done)
  // until the next step ends. 0: never wait.
  uint32_t register_hold_ms = 5;
  uint32_t lease_grace_ms = 2000;  // after the lease, the owner may reclaim by itself
  kv_stream_settings stream;       // the stream transfer path, when the broker asks for it
};

/// Whether a prefill worker over an engine of `engine_kind` computes its steps on a thread of
/// its own (prefill_core::compute_in_background): every engine that computes (cpu, cuda), not the
/// sim engine, whose steps are timers. DUET_PREFILL_THREAD=0 keeps them on the actor's thread,
/// as before 2026-12-02, for A/B runs; the simulator reads it too.
[[nodiscard]] bool prefill_steps_in_background(const std::string& engine_kind);

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

  /// From now on each step computes on a thread of its own (step_thread.hpp) and `notify` is
  /// called there when it ends: the caller then runs finish_step on its own thread. Messages
  /// keep being taken meanwhile; the engine sees only read_blocks (the stream path) from the
  /// caller's thread during a step, its other calls wait for finish_step.
  void compute_in_background(std::function<void()> notify);

  /// Runs the engine on the next chunks. Returns how long the actor must wait before
  /// finish_step (sim engine), or nothing when there is no work. A step in the background
  /// returns zero; the notify of compute_in_background says when it is done.
  [[nodiscard]] std::optional<std::chrono::nanoseconds> begin_step(int64_t now_ms);
  /// The step begun last computes in the background: wait for its notify, not for a timer.
  [[nodiscard]] bool step_in_background() const { return background_ && !in_flight_.empty(); }
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
  [[nodiscard]] std::optional<std::chrono::nanoseconds> plan_and_launch(int64_t now_ms);
  [[nodiscard]] static step_record describe_step(std::span<const prefill_chunk> chunks, int64_t now_ms);
  /// broker.stream_prefill: the blocks the last background step finished go to their adopters.
  void send_finished_blocks();
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
  std::unique_ptr<step_thread> background_;  // set by compute_in_background
  std::unique_ptr<step_log> step_log_;       // DUET_STEP_LOG
  step_record logged_step_;                  // the step in flight, for step_log_
  std::function<void()> notify_;
  // engine.release waits while a step computes in the background.
  std::vector<uint64_t> deferred_releases_;
  std::vector<std::pair<uint64_t, uint32_t>> finished_blocks_;  // (seq_id, blocks ready) to stream
};

}  // namespace duet
