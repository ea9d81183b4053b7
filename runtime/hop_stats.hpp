#pragma once
// Where a request's time to first token goes, hop by hop. Each core adds the durations of
// its own hops to its counters (hop_<name>_us: the sum, hop_<name>_count), so `duet stats`,
// `duet bench serve` (live, as the difference of two snapshots) and `duet sim` (the same
// cores on the virtual clock) read one breakdown. Sums and counts, not percentiles: they add
// up across workers and across snapshots.
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

inline void record_hop(std::map<std::string, uint64_t>& counters, std::string_view hop, int64_t us) {
  const std::string base = "hop_" + std::string(hop);
  counters[base + "_us"] += static_cast<uint64_t>(us < 0 ? 0 : us);
  ++counters[base + "_count"];
}

/// One hop of the first token's path, in the order a request takes them.
struct ttft_hop {
  const char* counter;  // role-prefixed: "router.hop_encode"
  const char* what;
};

/// The hops the router and the prefill workers record. router.hop_ttft spans all the others
/// (submit at the router to prefill_done at the router).
inline const std::vector<ttft_hop>& ttft_hops() {
  static const std::vector<ttft_hop> hops = {
      {"router.hop_encode", "router: tokenize the prompt"},
      {"prefill.hop_inbox", "prefill: in the mailbox while a synchronous step ran"},
      {"prefill.hop_queue", "prefill: received (mailbox included) to its first chunk's step"},
      {"prefill.hop_compute", "prefill: first chunk's step to the last one's end"},
      {"prefill.hop_register", "prefill: registered with the broker, first token sent"},
      {"router.hop_ttft", "router: submit to prefill_done (all of the above and the hops between)"},
      {"prefill.hop_step", "prefill: one engine step (per step, not per prompt)"},
      {"decode.hop_step", "decode: one decode step (per step; recompute steps left out)"},
  };
  return hops;
}

/// The mean of one hop in ms from role-prefixed counters; -1 when it was never recorded.
inline double hop_mean_ms(const std::map<std::string, uint64_t>& counters, const std::string& hop) {
  const auto n = counters.find(hop + "_count");
  const auto us = counters.find(hop + "_us");
  if (n == counters.end() || n->second == 0 || us == counters.end()) return -1;
  return double(us->second) / double(n->second) / 1e3;
}

}  // namespace duet
