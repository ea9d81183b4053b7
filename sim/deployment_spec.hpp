#pragma once
// Deployments for the simulator: from a deployment config file (what `duet up` would run),
// or from a short spec on the command line (docs/sim.md, "Deployment specs"):
//
//   colocated[:gpus=N]              N GPUs, each running prefill and decode on one timeline
//   split[:sm=F][,gpus=N]           N GPUs, each split by SM share: prefill F, decode 1-F
//   reserve[:sm=F][,gpus=N]         N GPUs, prefill on F of each (default 0.7), decode on the
//                                   whole GPU (its own stream), the other 1-F of the SMs its own
//   XPYD[:p=GPU,d=GPU]              X prefill GPUs and Y decode GPUs, e.g. 1P1D, 2P6D
//
// Options, comma separated after the colon: gpus=N, sm=F, gpu=T (every GPU), p=T and d=T
// (GPU type per role), link=same|nvlink|pcie|network, per_host=N (GPUs per host, default 8),
// batch=B (decode max_batch), pbatch=B (prefill max_batch), chunk=T (prefill chunk tokens),
// pmem=F (prefill's share of a shared GPU's KV memory, default 0.2),
// kv_allocation=on_demand|reserve (decode KV: grow and preempt, or reserve the whole length),
// policy=alternate|prefill_first|decode_first, name=TEXT.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "runtime/config.hpp"
#include "sim/event_sim.hpp"

namespace duet {

/// A spec that cannot be read; what() names the spec and the problem.
class deployment_spec_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// The deployment a config file describes: one GPU per (node, device) of the config's GPU
/// type, one host per node, each prefill/decode actor a worker with its own kv_blocks,
/// max_batch, chunk_tokens and sm_share (so the simulation matches `duet up` on the sim
/// engine). Actors of one device at sm_share 1 share the GPU's timeline.
[[nodiscard]] sim_deployment deployment_from_config(const deployment_config& config);

/// Reads a spec. `gpu` is the GPU type where the spec names none; worker defaults
/// (max_batch, chunk_tokens, kv_allocation) come from the config's first prefill and decode actors.
/// Pools are sized from GPU memory. Throws deployment_spec_error.
[[nodiscard]] sim_deployment parse_deployment_spec(std::string_view spec,
                                                   const deployment_config& config,
                                                   const std::string& gpu);

/// "2 GPUs: gpu0 h20 [prefill0], gpu1 h20 [decode0]" — one line.
[[nodiscard]] std::string describe(const sim_deployment& deployment);

}  // namespace duet
