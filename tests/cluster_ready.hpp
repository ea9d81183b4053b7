#pragma once
// Waiting for a live cluster: its router has seen a ready prefill and a ready decode worker.
#include <chrono>
#include <string>
#include <thread>

#include "runtime/client.hpp"

namespace duet::testing {

/// True once `router` reports at least one ready prefill and one ready decode worker;
/// false after `timeout`.
inline bool wait_ready(client& c, const std::string& router, std::chrono::milliseconds timeout) {
  using namespace std::chrono_literals;
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    auto r = c.stats({router}, 200ms);
    if (!r.empty() && r[0].counters["ready_prefill"] > 0 && r[0].counters["ready_decode"] > 0) return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

}  // namespace duet::testing
