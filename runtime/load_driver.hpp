#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "runtime/client.hpp"
#include "runtime/latency_stats.hpp"

namespace duet {

/// A burst of requests through one client: how many, how they look, and which of them
/// are cancelled or given short deadlines (for the fault and invariant tests).
struct burst_options {
  uint32_t requests = 100;
  uint32_t concurrency = 100;     // requests in flight at once
  uint32_t prompt_tokens = 512;
  uint32_t max_new_tokens = 64;
  double cancel_fraction = 0.0;   // cancelled after a random delay up to cancel_within_ms
  uint32_t cancel_within_ms = 200;
  double short_deadline_fraction = 0.0;  // given a deadline of short_deadline_ms
  uint32_t short_deadline_ms = 50;
  uint64_t seed = 1;
  std::chrono::milliseconds timeout{60000};  // the whole burst; every wait is bounded
  std::function<void(uint32_t done, uint32_t total)> progress;  // may be empty
};

/// Runs the burst and returns one record per request: every request ends in a record,
/// with outcome "ok", the finish reason, a rejection code, or "client_timeout".
[[nodiscard]] std::vector<request_record> run_burst(client& c, const burst_options& options);

}  // namespace duet
