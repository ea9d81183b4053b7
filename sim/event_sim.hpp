#pragma once
// The discrete-event simulator behind `duet sim` and `duet plan`: a virtual clock (ns) and a
// priority queue of timed events that drive the real router_core, prefill_core, decode_core
// and broker_core, exactly as the actors drive them (actors/roles.cpp): every message is
// encoded by the sender's outbox and decoded for the receiver, engine steps take the time
// the sim engine's cost model says (begin_step → modelled time → finish_step), and ticks,
// load reports and the broker's reclaim sweep run at their configured periods. On top of
// that it models what the live sim engine leaves out: a per-hop message latency, KV
// transfer time over the link between the prefill and decode GPUs, and GPUs shared by
// several workers (colocated prefill + decode on one timeline, or an SM split).
// docs/sim.md describes the model and its limits.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/config.hpp"
#include "runtime/decode_core.hpp"
#include "runtime/latency_stats.hpp"
#include "runtime/model_shape.hpp"
#include "sim/report.hpp"
#include "sim/trace.hpp"

namespace duet {

/// The simulator's event queue: earliest time first; events of equal time come out in the
/// order they were pushed, so a run never depends on heap internals and is reproducible.
template <class T>
class timed_queue {
 public:
  void push(int64_t t, T value) {
    heap_.push_back({t, next_seq_++, std::move(value)});
    std::push_heap(heap_.begin(), heap_.end(), later{});
  }
  [[nodiscard]] bool empty() const { return heap_.empty(); }
  [[nodiscard]] size_t size() const { return heap_.size(); }
  /// Time of the earliest event. Precondition: !empty().
  [[nodiscard]] int64_t next_time() const { return heap_.front().t; }
  /// Removes the earliest event and returns (time, value). Precondition: !empty().
  std::pair<int64_t, T> pop() {
    std::pop_heap(heap_.begin(), heap_.end(), later{});
    item back = std::move(heap_.back());
    heap_.pop_back();
    return {back.t, std::move(back.value)};
  }

 private:
  struct item {
    int64_t t;
    uint64_t seq;
    T value;
  };
  struct later {
    bool operator()(const item& x, const item& y) const {
      return x.t != y.t ? x.t > y.t : x.seq > y.seq;
    }
  };
  std::vector<item> heap_;
  uint64_t next_seq_ = 0;
};

/// The path a KV cache takes between the prefill and decode GPUs.
enum class link_kind : uint8_t {
  same_gpu,  ///< no copy (also what the live sim engine does: accounting only)
  nvlink,    ///< GPUs of one host with NVLink
  pcie,      ///< GPUs of one host without NVLink
  network,   ///< GPUs of different hosts, through each GPU's NIC
};
[[nodiscard]] std::string_view to_string(link_kind kind);
/// "same" (or "same_gpu", "none"), "nvlink", "pcie", "network"; nullopt otherwise.
[[nodiscard]] std::optional<link_kind> link_kind_from_string(std::string_view text);

/// Which worker runs next when several share one GPU timeline and more than one has work.
enum class step_policy : uint8_t {
  alternate,      ///< take turns: a decode step waits for at most one prefill step
  prefill_first,  ///< prefill steps whenever a prompt waits (vLLM's default before chunking)
  decode_first,   ///< decode steps whenever a sequence runs
  /// duet's `stream = "shared"`: each worker enqueues its step on the one CUDA stream as soon
  /// as it has work, first come first run; a step ends when its host sync returns, which
  /// also waits for work queued ahead of it, and a prefill step that sampled tokens syncs a
  /// second time, after the other worker's step queued behind it (docs/sim.md).
  stream,
};
[[nodiscard]] std::string_view to_string(step_policy policy);
[[nodiscard]] std::optional<step_policy> step_policy_from_string(std::string_view text);

/// One GPU of a simulated deployment.
struct sim_gpu {
  std::string type = "h200";  // a find_gpu_spec name
  uint32_t host = 0;          // GPUs of one host talk over NVLink or PCIe, else the network
};

/// One prefill or decode worker: a real prefill_core or decode_core on one GPU. Workers of
/// one GPU with sm_share 1 share the GPU's timeline (their GPU work never overlaps: a
/// colocated deployment, stepping by the deployment's step_policy) unless they have streams
/// of their own (own_stream: concurrent, with the calibrated contention); a worker with
/// sm_share < 1 has a timeline of its own at that share of the SMs (an SM split), so it
/// overlaps with the others.
struct sim_worker {
  std::string address;                    // "node/actor", as the router knows it
  actor_role role = actor_role::prefill;  // prefill | decode
  uint32_t gpu = 0;                       // index into sim_deployment::gpus
  double sm_share = 1.0;                  // (0, 1]
  uint32_t kv_blocks = 0;                 // 0: sized from the GPU's memory (kv_memory_share of it)
  double kv_memory_share = 1.0;           // of the GPU's KV memory, when kv_blocks == 0
  uint32_t max_batch = 64;
  uint32_t chunk_tokens = 2048;  // prefill: per chunk; decode: per recompute step
  duet::kv_allocation kv_allocation = duet::kv_allocation::on_demand;  // decode
  // At sm_share 1: the engine has a stream of its own (a config actor's stream = "own") and
  // steps concurrently with the GPU's other workers, each step slowed by the calibration's
  // contention factor while another worker of the GPU is busy. Otherwise the GPU's full-share
  // workers share one timeline (stream = "shared": step_policy::stream; the colocated specs:
  // their policy).
  bool own_stream = false;
};

/// A deployment: GPUs, the workers on them, and how shared timelines take turns.
struct sim_deployment {
  std::string name;  // shown in reports: "colocated", "1P1D", "split sm=0.6"
  std::vector<sim_gpu> gpus;
  std::vector<sim_worker> workers;
  // Specs default to alternate (one engine taking turns); deployment_from_config sets stream
  // (actors with stream = "shared" enqueue on one CUDA stream).
  step_policy policy = step_policy::alternate;
  std::optional<link_kind> link;  // forces the path of every transfer between two GPUs
};

/// Progress of a run, for a terminal display.
struct sim_progress {
  double virtual_s = 0;
  size_t finished = 0;
  size_t requests = 0;
  uint64_t events = 0;
};

struct sim_options {
  double hop_s = 50e-6;             // one message from one actor to another
  double memory_utilization = 0.9;  // of GPU memory for weights + KV (vLLM's default)
  uint32_t tick_ms = 20;            // the actors' timer periods (actors/roles.hpp)
  uint32_t report_ms = 100;
  double sample_period_s = 0;     // time series; 0: about 300 samples over the arrivals
  uint32_t prompt_vocab = 30000;  // prompt token ids are drawn below this
  std::map<std::string, gpu_calibration> calibrations;  // by GPU type: replaces the spec's
  std::function<void(const sim_progress&)> progress;    // called about every 64K events
};

/// What one run produced.
struct sim_result {
  std::string name;
  std::vector<request_record> records;       // one per trace request, in trace order
  std::vector<time_series> series;           // queue depth, batch, KV use, GPU busy over time
  std::map<std::string, uint64_t> counters;  // every core's counters summed per role
                                             // ("decode.steps"), and the simulator's ("sim.*")
  uint64_t events = 0;
  double simulated_s = 0;  // virtual time at the last event
  double wall_s = 0;
  double cpu_s = 0;  // CPU time of the calling thread
  uint32_t gpus = 0;
  std::vector<std::string> worker_lines;  // one line per worker: address, GPU, share, pool
};

/// Runs `trace` through `deployment` with the model, router, broker and timing settings of
/// `config` (its nodes and actors are not used: the deployment says what runs where). Every
/// request asks for output_tokens tokens (ignore_eos) with an input_tokens-token prompt;
/// requests that do not fit config.model.max_context are clipped first (clip_to_context).
/// The same inputs give the same result. Throws std::invalid_argument on an inconsistent
/// deployment (unknown GPU, worker on a missing GPU, no prefill or no decode worker).
[[nodiscard]] sim_result run_simulation(const deployment_config& config,
                                        const sim_deployment& deployment,
                                        std::span<const trace_request> trace,
                                        const sim_options& options = {});

/// When each job leaves a processor-sharing server that does one second of work per second,
/// split evenly among the jobs in it: job i arrives at arrivals[i] (in any order) with work[i]
/// seconds to do. A job of no work leaves as it arrives. Jobs arriving together with
/// different work leave shortest first.
[[nodiscard]] std::vector<double> processor_sharing_departures(std::span<const double> arrivals,
                                                               std::span<const double> work);

/// KV blocks a worker gets when its kv_blocks is 0: (memory·utilization − weights) split by
/// kv_memory_share, in blocks of config.model.block_tokens.
[[nodiscard]] uint32_t kv_blocks_from_memory(const deployment_config& config,
                                             const std::string& gpu_type, double memory_utilization,
                                             double share);

}  // namespace duet
