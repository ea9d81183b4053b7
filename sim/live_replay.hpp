#pragma once
// Open-loop replay of a trace against a live cluster (any engine) through duet::client:
// each request is sent at its arrival time, whatever the cluster is doing, and recorded the
// way the simulator records it. With the sim engine at engine.time_scale = s, arrivals are
// spread by s and every recorded time is divided by s, so the records compare one to one
// with `duet sim` on the same trace (the fidelity check in tests/test_sim.cpp).
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "runtime/client.hpp"
#include "runtime/latency_stats.hpp"
#include "sim/trace.hpp"

namespace duet {

struct live_replay_options {
  double time_scale = 1.0;                    // the cluster's engine.time_scale, > 0
  std::chrono::milliseconds timeout{120000};  // the whole replay; every wait is bounded
  uint32_t prompt_vocab = 30000;              // prompt token ids are drawn below this
  std::function<void(size_t done, size_t total)> progress;  // may be empty
};

/// Sends every request of `trace` (input_tokens prompt tokens, max_new_tokens =
/// output_tokens, ignore_eos) and returns one record per request, in trace order, with
/// times in trace seconds. Requests still open at the timeout are cancelled and recorded
/// as "client_timeout".
[[nodiscard]] std::vector<request_record> replay_live(client& c,
                                                      std::span<const trace_request> trace,
                                                      const live_replay_options& options = {});

}  // namespace duet
