#pragma once
// `duet plan`: which deployment of a GPU budget serves a trace with the most goodput per GPU.
//
// Goodput follows DistServe (Zhong et al., OSDI'24): the highest request rate at which at
// least `attainment` (default 90%) of requests meet both the TTFT and the TPOT objective;
// per-GPU goodput divides it by the GPUs the deployment uses. For every candidate —
// colocated (one GPU), PD on streams of one GPU, an SM split of one GPU at each share, a
// prefill partition beside decode on the whole GPU at each reserve share, and every XPYD with
// X + Y within the budget — the planner replays the trace at rate multiples found by doubling
// or halving, then bisection, and keeps the largest multiple that meets the attainment.
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "runtime/config.hpp"
#include "runtime/latency_stats.hpp"
#include "sim/event_sim.hpp"
#include "sim/trace.hpp"

namespace duet {

struct plan_options {
  std::string gpu = "h20";
  uint32_t gpu_budget = 8;
  latency_slo slo;
  double attainment = 0.9;  // fraction of requests meeting the SLO
  std::vector<double> sm_shares = {0.3, 0.4, 0.5, 0.6, 0.7};  // prefill shares of SM splits
  // Prefill partitions beside a decode engine on the whole GPU (priced by a calibration's
  // reserve_* keys; without them, as PD streams with the prefill on its share)
  std::vector<double> reserve_shares = {0.7, 0.85};
  uint32_t search_steps = 6;                                  // bisection steps after the bracket
  uint32_t jobs = 1;                                          // candidates simulated in parallel
  sim_options sim;                                            // per run (progress is ignored)
  /// Called after each candidate (from the worker threads, serialized): done, total, name.
  std::function<void(size_t, size_t, const std::string&)> progress;
};

/// One candidate's result.
struct plan_entry {
  sim_deployment deployment;
  uint32_t gpus = 0;
  double rate_scale = 0;  // largest multiple of the trace's rate that met the attainment
  double goodput = 0;     // requests/s at that multiple; 0 when none met it
  double goodput_per_gpu = 0;
  uint32_t replicas = 0;    // copies that fit the budget
  double attainment = 0;    // measured at rate_scale (or at the lowest rate tried)
  latency_summary summary;  // at rate_scale (or at the lowest rate tried)
  sim_result run;           // the run behind `summary`
  uint32_t simulations = 0;
};

/// The candidates the planner searches, in a stable order.
[[nodiscard]] std::vector<sim_deployment> plan_candidates(const deployment_config& config,
                                                          const plan_options& options);

/// Searches every candidate and returns them ranked by goodput per GPU (best first).
/// Throws std::invalid_argument when the trace is too short to have a rate (< 2 requests).
[[nodiscard]] std::vector<plan_entry> plan_deployments(const deployment_config& config,
                                                       std::span<const trace_request> trace,
                                                       const plan_options& options);

/// The ranked table for the terminal, one row per candidate.
[[nodiscard]] std::string format_plan_table(std::span<const plan_entry> ranked,
                                            const plan_options& options, double trace_rate);

}  // namespace duet
