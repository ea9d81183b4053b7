#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "messages/codec.hpp"
#include "runtime/outbox.hpp"

namespace duet {

struct router_settings {
  std::string broker;
  std::vector<std::string> prefill_workers;
  std::vector<std::string> decode_workers;
  std::string policy = "least_loaded";  // least_loaded | round_robin
  uint32_t queue_limit = 4096;           // requests in flight before admission refuses
  uint32_t request_timeout_ms = 120000;  // deadline when the client gives none
  uint32_t max_context = 32768;
  uint32_t max_new_tokens_limit = 32768;
  uint32_t give_up_grace_ms = 5000;      // after a deadline, how long workers get to answer
  uint32_t worker_timeout_ms = 3000;     // a worker with no load report this long is not used
  std::vector<int32_t> eos_ids;
  bool stream_prefill = false;  // broker.stream_prefill = "chunks": prefill_request names the decode worker
  bool first_token_from_decode = false;  // router.first_token = "decode": kv_adopt carries it unsent
};

/// Ordered request states on the disaggregated path: "has reached" is a comparison.
enum class request_state : uint8_t { prefilling, decoding, finished };

/// Admission, placement and the end-to-end bookkeeping of every request. A prefill and a
/// decode worker are reserved in one decision, so any failure releases both; every
/// admitted request gets exactly one final answer, from a worker or, if workers stay
/// silent past the deadline plus a grace period, from the router itself.
class router_core {
 public:
  using text_encoder = std::function<std::vector<int32_t>(const std::string&)>;
  router_core(std::string self, router_settings settings, text_encoder encode);

  void on_submit(const msg::envelope& env, const msg::submit& m, int64_t now_ms);
  void on_cancel(const msg::envelope& env, const msg::cancel& m);
  void on_prefill_done(const msg::prefill_done& m, int64_t now_ms);
  void on_stage_failed(const std::string& from, const msg::stage_failed& m);
  void on_request_done(const msg::request_done& m);
  void on_load(const std::string& from, const msg::load_report& m, int64_t now_ms);
  void tick(int64_t now_ms);

  [[nodiscard]] outbox& out() { return out_; }
  [[nodiscard]] std::size_t in_flight() const { return requests_.size(); }
  [[nodiscard]] const std::map<std::string, uint64_t>& counters() const { return counters_; }
  [[nodiscard]] uint32_t outstanding(const std::string& worker) const;
  /// Workers that reported load within worker_timeout_ms, as of the last tick.
  [[nodiscard]] uint32_t ready_prefill() const { return ready_prefill_; }
  [[nodiscard]] uint32_t ready_decode() const { return ready_decode_; }

 private:
  struct request {
    uint64_t seq_id = 0;
    std::string client;
    uint64_t request_id = 0;
    std::vector<int32_t> prompt;
    msg::sampling_params sampling;
    int64_t deadline_ms = 0;
    int64_t submitted_ms = 0;  // for the TTFT hop breakdown (hop_stats.hpp)
    std::string prefill;
    std::string decode;
    uint64_t handle_id = 0;
    request_state state = request_state::prefilling;
    bool cancel_sent = false;
    bool first_sent = false;  // by this router (the decode worker may send it instead)
    msg::finish_reason cancel_reason = msg::finish_reason::cancelled;  // timeout when the deadline sent it
  };
  struct worker {
    uint32_t outstanding = 0;
    int64_t last_seen_ms = 0;
    msg::load_report last;
  };
  [[nodiscard]] std::string pick(const std::vector<std::string>& workers, std::size_t& cursor, int64_t now_ms);
  void reject(const std::string& client, uint64_t request_id, msg::error_code code, std::string message,
              uint32_t retry_after_ms = 0);
  void answer_and_forget(request& r, msg::finish_reason reason, msg::error_code code, const std::string& message,
                         uint32_t completion_tokens);
  void forget(uint64_t seq_id);
  [[nodiscard]] bool alive(const std::string& worker, int64_t now_ms) const;

  router_settings settings_;
  text_encoder encode_;
  outbox out_;
  uint64_t next_seq_ = 1;
  std::unordered_map<uint64_t, request> requests_;
  std::map<std::pair<std::string, uint64_t>, uint64_t> by_client_;
  std::unordered_map<std::string, worker> workers_;
  std::size_t prefill_cursor_ = 0;
  std::size_t decode_cursor_ = 0;
  std::map<std::string, uint64_t> counters_;
  uint32_t ready_prefill_ = 0;
  uint32_t ready_decode_ = 0;
};

}  // namespace duet
