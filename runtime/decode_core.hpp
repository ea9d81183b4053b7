#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "messages/catalogue.hpp"
#include "runtime/block_manager.hpp"
#include "runtime/engine.hpp"
#include "runtime/kv_stream.hpp"
#include "runtime/outbox.hpp"

namespace duet {

struct decode_settings {
  std::string router;
  std::string broker;
  uint32_t kv_blocks = 4096;
  uint32_t max_batch = 64;
  uint32_t transfer_timeout_ms = 5000;  // waiting for memory or for the KV to arrive
  uint32_t renew_every_ms = 2000;       // lease renewal while an adoption waits for memory
};

/// Ordered states of a sequence in a decode worker.
enum class decode_state : uint8_t { waiting_memory, pulling, running };

/// Continuous batching over a paged KV pool. An adopted sequence reserves blocks for its
/// whole length (prompt + max_new_tokens) up front, so a running sequence never runs out
/// of KV mid-stream; it pulls its KV through the broker, confirms, then joins the batch.
class decode_core {
 public:
  decode_core(std::string self, decode_settings settings, engine& engine);

  void on_adopt(const msg::envelope& env, const msg::kv_adopt& m, int64_t now_ms);
  void on_moved(const msg::kv_moved& m, int64_t now_ms);
  /// A chunk of KV bytes on the stream path; the last one completes the pull.
  void on_chunk(const msg::envelope& env, const msg::kv_chunk& m, int64_t now_ms);
  void on_cancel(const msg::cancel_seq& m);

  [[nodiscard]] std::optional<std::chrono::nanoseconds> begin_step(int64_t now_ms);
  void finish_step(int64_t now_ms);
  void tick(int64_t now_ms);

  [[nodiscard]] outbox& out() { return out_; }
  [[nodiscard]] const block_manager& pool() const { return pool_; }
  [[nodiscard]] msg::load_report load() const;
  [[nodiscard]] std::map<std::string, uint64_t> counters() const { return counters_; }

 private:
  struct sequence {
    uint64_t seq_id = 0;
    uint64_t handle_id = 0;
    uint64_t layout_hash = 0;
    std::string client;
    uint64_t request_id = 0;
    msg::sampling_params sampling;
    std::vector<int32_t> tokens;  // prompt + generated
    uint32_t prompt_len = 0;
    uint32_t generated = 0;       // includes the first token from prefill
    std::vector<uint32_t> blocks;
    decode_state state = decode_state::waiting_memory;
    int64_t deadline_ms = 0;
    int64_t wait_until_ms = 0;
    int64_t next_renew_ms = 0;
    bool cancelled = false;
    msg::finish_reason cancel_reason = msg::finish_reason::cancelled;
    kv_stream_receiver receiver;  // the stream path's progress
  };
  [[nodiscard]] sequence* find_by_handle(uint64_t handle_id);
  /// The KV is in place: confirm to the broker and join the batch (or end if cancelled).
  void kv_arrived(sequence& s, msg::kv_path path);
  void try_admit_waiting(int64_t now_ms);
  [[nodiscard]] uint32_t reserved_tokens(const sequence& s) const;
  void end(sequence& s, msg::finish_reason reason, msg::error_code code, const std::string& message);

  decode_settings settings_;
  engine& engine_;
  outbox out_;
  block_manager pool_;
  std::unordered_map<uint64_t, sequence> seqs_;
  std::deque<uint64_t> waiting_;  // adoptions waiting for memory, FCFS
  std::vector<uint64_t> running_; // in admission order
  std::vector<uint64_t> in_flight_;
  step_output in_flight_output_;
  std::map<std::string, uint64_t> counters_;
};

}  // namespace duet
