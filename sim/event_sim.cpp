#include "sim/event_sim.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <limits>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <unordered_map>

#include "messages/dispatch.hpp"
#include "runtime/broker_core.hpp"
#include "runtime/decode_buckets.hpp"
#include "runtime/decode_core.hpp"
#include "runtime/model_shape.hpp"
#include "runtime/prefill_core.hpp"
#include "runtime/router_core.hpp"
#include "runtime/sim_engine.hpp"

namespace duet {

std::string_view to_string(link_kind kind) {
  switch (kind) {
    case link_kind::same_gpu:
      return "same";
    case link_kind::nvlink:
      return "nvlink";
    case link_kind::pcie:
      return "pcie";
    case link_kind::network:
      return "network";
  }
  return "unknown";
}

std::optional<link_kind> link_kind_from_string(std::string_view text) {
  if (text == "same" || text == "same_gpu" || text == "none") return link_kind::same_gpu;
  if (text == "nvlink") return link_kind::nvlink;
  if (text == "pcie") return link_kind::pcie;
  if (text == "network" || text == "net" || text == "rdma") return link_kind::network;
  return std::nullopt;
}

std::string_view to_string(step_policy policy) {
  switch (policy) {
    case step_policy::alternate:
      return "alternate";
    case step_policy::prefill_first:
      return "prefill_first";
    case step_policy::decode_first:
      return "decode_first";
    case step_policy::stream:
      return "stream";
  }
  return "unknown";
}

std::optional<step_policy> step_policy_from_string(std::string_view text) {
  if (text == "alternate") return step_policy::alternate;
  if (text == "prefill_first") return step_policy::prefill_first;
  if (text == "decode_first") return step_policy::decode_first;
  if (text == "stream") return step_policy::stream;
  return std::nullopt;
}

std::vector<double> processor_sharing_departures(std::span<const double> arrivals,
                                                 std::span<const double> work) {
  const size_t n = arrivals.size();
  std::vector<size_t> order(n);  // jobs by arrival
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return arrivals[a] < arrivals[b]; });
  std::vector<double> out(n, 0.0);
  std::vector<std::pair<size_t, double>> in;  // (job, work left)
  double now = 0.0;
  size_t next = 0;  // in `order`
  while (next < n || !in.empty()) {
    const double arrival =
        next < n ? arrivals[order[next]] : std::numeric_limits<double>::infinity();
    double least = std::numeric_limits<double>::infinity();
    for (const auto& [job, left] : in) least = std::min(least, left);
    const double shares = static_cast<double>(in.size());
    const double finish = in.empty() ? arrival : now + least * shares;
    if (arrival <= finish) {  // the next job comes in (or leaves at once, with no work)
      for (auto& [job, left] : in) left -= (arrival - now) / shares;
      now = arrival;
      const size_t job = order[next++];
      if (work[job] > 0)
        in.emplace_back(job, work[job]);
      else
        out[job] = arrival;
      continue;
    }
    now = finish;
    for (auto& [job, left] : in) left -= least;
    std::erase_if(in, [&](const std::pair<size_t, double>& j) {
      if (j.second > least * 1e-9) return false;
      out[j.first] = now;
      return true;
    });
  }
  return out;
}

uint32_t kv_blocks_from_memory(const deployment_config& config, const std::string& gpu_type,
                               double memory_utilization, double share) {
  const auto shape = find_model_shape(config.model.preset);
  if (!shape) throw std::invalid_argument("unknown model preset '" + config.model.preset + "'");
  const auto gpu = find_gpu_spec(gpu_type);
  if (!gpu) throw std::invalid_argument("unknown GPU '" + gpu_type + "'");
  const double kv_bytes = gpu->memory_bytes * memory_utilization - double(shape->weight_bytes());
  const double block_bytes = double(shape->kv_bytes_per_token()) * config.model.block_tokens;
  const double blocks = std::floor(kv_bytes * share / block_bytes);
  if (blocks < 1) {
    throw std::invalid_argument("the " + config.model.preset + " weights leave no KV memory on a " +
                                gpu_type);
  }
  return static_cast<uint32_t>(std::min(blocks, double(std::numeric_limits<uint32_t>::max())));
}

namespace {

constexpr int64_t ns_per_ms = 1'000'000;
// The cores' clock reads epoch_ms at virtual time 0: router_core counts a worker alive only
// after a load report at a positive time.
constexpr int64_t epoch_ms = 1'000'000;
// Fixed setup latency of one transfer on each link, before bytes / bandwidth.
constexpr int64_t link_latency_ns[] = {0, 5'000, 10'000, 20'000};

const std::string client_address = "sim/client";
const std::string router_address = "sim/router";
const std::string broker_address = "sim/broker";

enum class event_kind : uint8_t {
  deliver,
  step_done,
  stream_done,  // the GPU finished the work at the head of a shared stream
  arrival,
  router_tick,
  broker_reclaim,
  unit_tick,
  unit_report,
  sample
};

struct event {
  int64_t t = 0;
  event_kind kind = event_kind::deliver;
  bool transferred = false;  // deliver of a kv_moved whose transfer time is paid
  // deliver: target; step_done, stream_done: timeline; arrival: request; tick/report: unit
  uint32_t a = 0;
  uint32_t payload = 0;  // deliver: slot in payloads_; step_done, stream_done: generation
};

constexpr uint32_t target_client = 0;
constexpr uint32_t target_router = 1;
constexpr uint32_t target_broker = 2;
constexpr uint32_t first_unit = 3;

/// What a prefill call computed, as the contention model reads it: its query rows and, over
/// them, the keys each row attends to (causal: row i of a chunk after p cached tokens sees
/// p + i + 1 keys), summed and summed squared.
struct prefill_shape {
  uint64_t tokens = 0;
  double key_sum = 0;     // query-key pairs: chunk_attention_flops / (4·L·H·d)
  double key_squares = 0;  // Σ keys², so key_squares / key_sum is the time-weighted keys per row
};

/// What a decode call computed: its sequences and the tokens they hold in all (the cost
/// model's b and C).
struct decode_shape {
  uint32_t batch = 0;
  uint64_t context = 0;
  uint32_t graph_rows = 0;  // the rows of the CUDA graph it replays (>= batch)
};

/// The sim engine of a worker, counting the tokens its last prefill call sampled: on a shared
/// stream, a cuda engine's prefill step that sampled tokens syncs the stream twice
/// (runtime/cuda_engine.cpp: after copying the tokens back, and before returning).
///
/// With `synchronous`, it reports its steps as a cuda or cpu engine does, having computed on
/// the actor's thread (no modelled time left to wait: the cores then act as they do beside
/// those engines, e.g. prefill_settings::register_hold_ms), and keeps the modelled time for
/// the simulator (last_modeled).
class tally_engine final : public engine {
 public:
  tally_engine(std::shared_ptr<sim_engine> inner, bool synchronous,
               std::vector<uint32_t> graph_buckets = {})
      : inner_(std::move(inner)), synchronous_(synchronous), buckets_(std::move(graph_buckets)) {}
  [[nodiscard]] const engine_info& info() const override { return inner_->info(); }
  [[nodiscard]] step_output prefill(std::span<const prefill_chunk> chunks) override {
    sampled_ = static_cast<uint32_t>(
        std::count_if(chunks.begin(), chunks.end(), [](const prefill_chunk& c) { return c.last; }));
    shape_ = {};
    // Σ k and Σ k² for k = p + 1 .. p + t, in closed form.
    auto squares = [](double n) { return n * (n + 1) * (2 * n + 1) / 6; };
    for (const auto& c : chunks) {
      const double p = c.start, t = double(c.tokens.size());
      shape_.tokens += c.tokens.size();
      shape_.key_sum += t * p + t * (t + 1) / 2;
      shape_.key_squares += squares(p + t) - squares(p);
    }
    return keep_modeled(inner_->prefill(chunks));
  }
  [[nodiscard]] step_output decode(std::span<const decode_slot> slots) override {
    sampled_ = 0;  // one sync, after copying the tokens back
    shape_ = {};
    const auto batch = static_cast<uint32_t>(slots.size());
    decode_shape_ = {batch, 0, decode_graph_rows(buckets_, batch)};
    for (const auto& s : slots) decode_shape_.context += s.history.size();
    return keep_modeled(inner_->decode_in_graph(slots, decode_shape_.graph_rows));
  }
  /// The modelled time of the latest call, ns.
  [[nodiscard]] int64_t last_modeled() const { return modeled_ns_; }
  /// Prompts whose last chunk the latest prefill call computed (0 after a decode call).
  [[nodiscard]] uint32_t last_prefill_sampled() const { return sampled_; }
  /// The rows and keys of the latest prefill call (empty after a decode call).
  [[nodiscard]] const prefill_shape& last_prefill() const { return shape_; }
  /// The batch and context of the latest decode call (kept across prefill calls; a decode
  /// worker's prefill calls are recompute chunks).
  [[nodiscard]] const decode_shape& last_decode() const { return decode_shape_; }

 private:
  step_output keep_modeled(step_output out) {
    modeled_ns_ = std::max<int64_t>(out.modeled.count(), 0);
    if (synchronous_) out.modeled = std::chrono::nanoseconds{0};
    return out;
  }

  std::shared_ptr<sim_engine> inner_;
  bool synchronous_ = false;
  std::vector<uint32_t> buckets_;  // decode graph batch sizes (empty: every batch its own)
  int64_t modeled_ns_ = 0;
  uint32_t sampled_ = 0;
  prefill_shape shape_;
  decode_shape decode_shape_;
};

struct unit {
  sim_worker spec;
  std::unique_ptr<tally_engine> engine;
  std::unique_ptr<prefill_core> prefill;
  std::unique_ptr<decode_core> decode;
  uint32_t timeline = 0;
  uint32_t kv_blocks = 0;
  // On a shared stream (step_policy::stream): a step is enqueued, not yet returned.
  bool in_step = false;
  bool second_sync = false;  // the step sampled tokens (prefill): it syncs once more
  bool synchronous = false;  // its steps compute on the actor's thread (DUET_PREFILL_THREAD=0,
                             // DUET_DECODE_THREAD=0)
  // A cuda or cpu engine computes inside the actor's begin_step (actors/roles.cpp): messages
  // that reach the worker while its step runs wait in its mailbox until the step returns.
  struct held_message {
    event e;
    int64_t received_ns = 0;  // when it reached the mailbox
  };
  std::vector<held_message> held;
  uint64_t wait_serial = 0;  // its last sync waits for this queued item (0: none)

  outbox& out() { return prefill ? prefill->out() : decode->out(); }
  [[nodiscard]] msg::load_report load() const { return prefill ? prefill->load() : decode->load(); }
  [[nodiscard]] bool idle() const {
    const auto l = load();
    return l.queued + l.running == 0;
  }
  [[nodiscard]] const block_manager& pool() const {
    return prefill ? prefill->pool() : decode->pool();
  }
};

/// One step's GPU work queued on a shared stream.
struct stream_item {
  uint32_t unit = 0;
  uint64_t serial = 0;  // from 1, in enqueue order
  int64_t work_ns = 0;
  int64_t enqueued_ns = 0;
  uint32_t decode_rows = 0;  // a decode step's rows (0: a prefill step)
  bool lead = false;  // the part of a prefill step that ran ahead of a decode step: no sync ends
};

struct timeline {
  uint32_t gpu = 0;
  std::vector<uint32_t> units;   // indices into units_
  bool stream = false;           // step_policy::stream with several workers: a FIFO of work
  std::deque<stream_item> fifo;  // stream: the front runs on the GPU
  uint64_t serials = 0;
  bool busy = false;  // stream: the fifo is not empty
  uint32_t running = 0;
  size_t last = 0;  // position in `units` of the unit that stepped last
  int64_t step_start = 0;
  int64_t step_end = 0;     // when the step in flight finishes
  uint32_t generation = 0;  // of the step in flight: a step pushed back leaves a stale event
  int64_t busy_since_sample = 0;
};

struct handle_info {
  uint32_t owner = 0;  // unit index
  uint64_t bytes = 0;
};

struct client_state {
  bool done = false;
  double last_token_s = 0;
};

double thread_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

/// As the router actor does for the sim engine: one token per UTF-8 byte of a text prompt.
std::vector<int32_t> byte_tokens(const std::string& text) {
  std::vector<int32_t> out;
  out.reserve(text.size());
  for (unsigned char c : text) out.push_back(c);
  return out;
}

class event_sim {
 public:
  event_sim(const deployment_config& config, const sim_deployment& d,
            std::span<const trace_request> trace, const sim_options& o)
      : config_(config), deployment_(d), options_(o), client_out_(client_address) {
    prepare_trace(trace);
    build();
  }

  sim_result run() {
    const auto wall_start = std::chrono::steady_clock::now();
    const double cpu_start = thread_cpu_seconds();
    schedule_start();
    const int64_t hard_stop = hard_stop_ns();
    while (!queue_.empty() && finished_ < requests_.size()) {
      if (queue_.next_time() > hard_stop) break;
      const event e = queue_.pop().second;
      now_ = e.t;
      ++events_;
      handle(e);
      if (options_.progress && (events_ & 0xffff) == 0) {
        options_.progress({now_ * 1e-9, finished_, requests_.size(), events_});
      }
    }
    for (size_t i = 0; i < records_.size(); ++i) {
      if (!clients_[i].done) {
        records_[i].finish_s = now_ * 1e-9;
        records_[i].outcome = "sim_unfinished";
        ++counters_["sim.unfinished"];
      }
    }
    if (options_.progress) options_.progress({now_ * 1e-9, finished_, requests_.size(), events_});
    sim_result r;
    r.name = deployment_.name;
    r.records = std::move(records_);
    r.series = std::move(series_);
    r.events = events_;
    r.simulated_s = now_ * 1e-9;
    r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
    r.cpu_s = thread_cpu_seconds() - cpu_start;
    r.gpus = static_cast<uint32_t>(deployment_.gpus.size());
    r.counters = collect_counters();
    r.worker_lines = worker_lines();
    return r;
  }

 private:
  // ------------------------------------------------------------------ setup

  void prepare_trace(std::span<const trace_request> trace) {
    const uint32_t max_context = config_.model.max_context;
    requests_ =
        clip_to_context(std::vector<trace_request>(trace.begin(), trace.end()), max_context);
    for (auto& r : requests_) {
      r.output_tokens = std::max<uint32_t>(r.output_tokens, 1);
      r.input_tokens =
          std::clamp<uint32_t>(r.input_tokens, 1, max_context > 1 ? max_context - 1 : 1);
    }
    records_.resize(requests_.size());
    clients_.resize(requests_.size());
    for (size_t i = 0; i < requests_.size(); ++i) {
      records_[i].id = i + 1;
      records_[i].arrival_s = requests_[i].arrival_s;
      records_[i].prompt_tokens = requests_[i].input_tokens;
      records_[i].outcome = "sim_unfinished";
    }
  }

  void build() {
    const auto shape = find_model_shape(config_.model.preset);
    if (!shape) throw std::invalid_argument("unknown model preset '" + config_.model.preset + "'");
    if (deployment_.gpus.empty())
      throw std::invalid_argument("deployment '" + deployment_.name + "' has no GPU");
    for (const auto& g : deployment_.gpus) {
      auto spec = find_gpu_spec(g.type);
      if (!spec) throw std::invalid_argument("unknown GPU '" + g.type + "'");
      if (auto c = options_.calibrations.find(g.type); c != options_.calibrations.end())
        spec->calibration = c->second;
      specs_.push_back(*spec);
      costs_.emplace_back(*shape, *spec);
    }
    router_settings rs;
    rs.broker = broker_address;
    rs.policy = config_.router.policy;
    rs.queue_limit = config_.router.queue_limit;
    rs.request_timeout_ms = config_.router.request_timeout_ms;
    rs.max_context = config_.model.max_context;
    rs.max_new_tokens_limit = config_.router.max_new_tokens_limit;
    rs.give_up_grace_ms = config_.broker.transfer_timeout_ms;
    rs.worker_timeout_ms = config_.transport.peer_timeout_ms;
    rs.first_token_from_decode = config_.router.first_token == "decode";
    address_to_target_[client_address] = target_client;
    address_to_target_[router_address] = target_router;
    address_to_target_[broker_address] = target_broker;

    // Timelines: per GPU, the workers at full share share one; each split worker has its own.
    // A share below 1 becomes the SMs the CUDA engine's green context gets (partition_sms), the
    // workers taking theirs in the deployment's order.
    std::map<uint32_t, double> split_share, realized_split, sms_left;
    std::map<uint32_t, uint32_t> full_workers, split_workers;
    for (const auto& w : deployment_.workers) {
      if (w.gpu >= deployment_.gpus.size()) {
        throw std::invalid_argument("worker " + w.address + " is on GPU " + std::to_string(w.gpu) +
                                    " of " + std::to_string(deployment_.gpus.size()));
      }
      if (!(w.sm_share > 0 && w.sm_share <= 1))
        throw std::invalid_argument("worker " + w.address + ": sm_share must be in (0, 1]");
      if (w.role != actor_role::prefill && w.role != actor_role::decode) {
        throw std::invalid_argument("worker " + w.address + " must be a prefill or decode worker");
      }
      if (w.max_batch == 0 || w.chunk_tokens == 0)
        throw std::invalid_argument("worker " + w.address + ": batch and chunk must be positive");
      if (w.sm_share < 1) {
        split_share[w.gpu] += w.sm_share;
        ++split_workers[w.gpu];
      } else {
        ++full_workers[w.gpu];
      }
      if (address_to_target_.contains(w.address))
        throw std::invalid_argument("worker address " + w.address + " is used twice");
      address_to_target_[w.address] = first_unit + static_cast<uint32_t>(units_.size());
      units_.push_back(std::make_unique<unit>());
      units_.back()->spec = w;
      if (w.sm_share < 1) {
        const gpu_spec& g = specs_[w.gpu];
        auto& unit_spec = units_.back()->spec;
        if (g.sms > 0) {
          auto [left, fresh] = sms_left.try_emplace(w.gpu, static_cast<double>(g.sms));
          const double sms = partition_sms(g, w.sm_share, left->second);
          left->second -= sms;
          unit_spec.sm_share = sms / g.sms;
          unit_spec_sms_[units_.size() - 1] = sms;
        }
        realized_split[w.gpu] += unit_spec.sm_share;
      }
    }
    for (const auto& [gpu, share] : split_share) {
      if (share > 1.0 + 1e-9) {
        throw std::invalid_argument(
            "GPU " + std::to_string(gpu) +
            " is split by SM share: its workers' shares below 1 must sum to at most 1");
      }
      // Workers at share 1 beside the split run on the whole GPU, the partitions' SMs included.
      if (full_workers[gpu] > 0) reserved_[gpu] = std::max(0.0, 1.0 - realized_split[gpu]);
    }
    std::map<uint32_t, uint32_t> full_timeline;  // gpu -> timeline of its full-share workers
    std::map<std::pair<uint32_t, double>, std::shared_ptr<sim_engine>> engines;
    for (uint32_t i = 0; i < units_.size(); ++i) {
      unit& u = *units_[i];
      const auto& w = u.spec;
      auto& engine = engines[{w.gpu, w.sm_share}];
      if (!engine) {
        engine = std::make_shared<sim_engine>(*shape, specs_[w.gpu], config_.model.name,
                                              config_.model.max_context, config_.model.block_tokens,
                                              w.sm_share, 1.0);
      }
      // A computing engine's steps run on the worker's step thread (actors/roles.cpp) unless
      // DUET_PREFILL_THREAD / DUET_DECODE_THREAD say 0: its actor takes messages meanwhile.
      const bool in_background = w.role == actor_role::prefill
                                     ? prefill_steps_in_background(config_.engine.kind)
                                     : decode_steps_in_background(config_.engine.kind);
      u.synchronous = synchronous_steps_ && !in_background;
      // A decode step costs as the CUDA graph the engine would replay for its batch.
      u.engine = std::make_unique<tally_engine>(
          engine, u.synchronous,
          w.role == actor_role::decode
              ? decode_graph_buckets(w.max_batch, decode_bucket_step_from_env())
              : std::vector<uint32_t>{});
      u.kv_blocks = w.kv_blocks > 0
                        ? w.kv_blocks
                        : kv_blocks_from_memory(config_, deployment_.gpus[w.gpu].type,
                                                options_.memory_utilization, w.kv_memory_share);
      if (w.role == actor_role::prefill) {
        prefill_settings ps;
        ps.router = router_address;
        ps.broker = broker_address;
        ps.kv_blocks = u.kv_blocks;
        ps.chunk_tokens = w.chunk_tokens;
        ps.max_batch = w.max_batch;
        ps.register_timeout_ms = config_.broker.transfer_timeout_ms;
        u.prefill = std::make_unique<prefill_core>(w.address, ps, *u.engine);
        rs.prefill_workers.push_back(w.address);
      } else {
        decode_settings ds;
        ds.router = router_address;
        ds.broker = broker_address;
        ds.kv_blocks = u.kv_blocks;
        ds.max_batch = w.max_batch;
        ds.allocation = w.kv_allocation;
        ds.chunk_tokens = w.chunk_tokens;
        ds.transfer_timeout_ms = config_.broker.transfer_timeout_ms;
        ds.renew_every_ms = std::max<uint32_t>(config_.broker.lease_ms / 3, 1);
        u.decode = std::make_unique<decode_core>(w.address, ds, *u.engine);
        rs.decode_workers.push_back(w.address);
      }
      if (w.sm_share >= 1 && !w.own_stream) {
        auto it = full_timeline.find(w.gpu);
        if (it == full_timeline.end()) {
          it = full_timeline.emplace(w.gpu, static_cast<uint32_t>(timelines_.size())).first;
          timelines_.push_back({});
          timelines_.back().gpu = w.gpu;
        }
        u.timeline = it->second;
      } else {
        u.timeline = static_cast<uint32_t>(timelines_.size());
        timelines_.push_back({});
        timelines_.back().gpu = w.gpu;
      }
      timelines_[u.timeline].units.push_back(i);
    }
    if (rs.prefill_workers.empty() || rs.decode_workers.empty()) {
      throw std::invalid_argument("deployment '" + deployment_.name +
                                  "' needs a prefill and a decode worker");
    }
    for (auto& tl : timelines_) {
      tl.last = tl.units.size() - 1;  // the first turn goes to units[0]
      tl.stream = deployment_.policy == step_policy::stream && tl.units.size() > 1;
    }
    // Every transfer a request can need must have a link with bandwidth.
    for (const auto& p : units_) {
      if (!p->prefill) continue;
      for (const auto& d : units_) {
        if (!d->decode) continue;
        if (auto [kind, bw] = link_between(p->spec.gpu, d->spec.gpu);
            kind != link_kind::same_gpu && bw <= 0) {
          throw std::invalid_argument("no " + std::string(to_string(kind)) +
                                      " bandwidth between GPU " + std::to_string(p->spec.gpu) +
                                      " (" + deployment_.gpus[p->spec.gpu].type + ") and GPU " +
                                      std::to_string(d->spec.gpu) + " (" +
                                      deployment_.gpus[d->spec.gpu].type + ")");
        }
      }
    }
    link_free_.assign(deployment_.gpus.size() * 4, 0);
    router_ = std::make_unique<router_core>(router_address, rs, byte_tokens);
    broker_settings bs;
    bs.lease_ms = config_.broker.lease_ms;
    bs.engine_kind = "sim";
    broker_ = std::make_unique<broker_core>(broker_address, bs);
  }

  /// The link a KV cache takes from GPU a to GPU b and its usable bandwidth (bytes/s).
  [[nodiscard]] std::pair<link_kind, double> link_between(uint32_t a, uint32_t b) const {
    if (a == b) return {link_kind::same_gpu, 0.0};
    const auto& ga = deployment_.gpus[a];
    const auto& gb = deployment_.gpus[b];
    const auto& sa = specs_[a];
    const auto& sb = specs_[b];
    link_kind kind = link_kind::network;
    if (ga.host == gb.host)
      kind =
          sa.nvlink_bandwidth > 0 && sb.nvlink_bandwidth > 0 ? link_kind::nvlink : link_kind::pcie;
    if (deployment_.link) kind = *deployment_.link;
    auto bw = [&](const gpu_spec& s) {
      switch (kind) {
        case link_kind::nvlink:
          return s.nvlink_bandwidth;
        case link_kind::pcie:
          return s.pcie_bandwidth;
        case link_kind::network:
          return s.nic_bandwidth;
        case link_kind::same_gpu:
          return 0.0;
      }
      return 0.0;
    };
    return {kind, std::min(bw(sa), bw(sb)) * std::min(sa.link_efficiency, sb.link_efficiency)};
  }

  [[nodiscard]] int64_t hard_stop_ns() const {
    const double last_arrival = requests_.empty() ? 0.0 : requests_.back().arrival_s;
    // Every request ends by its deadline plus the router's grace; beyond that something hangs.
    const double bound =
        last_arrival +
        (config_.router.request_timeout_ms + config_.broker.transfer_timeout_ms) / 1e3 +
        config_.broker.lease_ms / 1e3 + 60.0;
    return static_cast<int64_t>(bound * 1e9);
  }

  /// The front end's time per request (gpu_calibration::front_end_s): one front end serves the
  /// deployment, so the largest any of its GPUs' calibrations gives.
  [[nodiscard]] double front_end_s() const {
    double most = 0.0;
    for (const auto& spec : specs_) most = std::max(most, spec.calibration.front_end_s.value_or(0.0));
    return most;
  }

  /// When request i reaches the router: the fixed front-end time after its arrival, plus its
  /// share of the front end's per-token work (front_end_token_s) with the requests in the
  /// front end beside it.
  [[nodiscard]] std::vector<double> admission_times() const {
    double per_token = 0.0;
    for (const auto& spec : specs_)
      per_token = std::max(per_token, spec.calibration.front_end_token_s.value_or(0.0));
    std::vector<double> arrivals, work;
    for (const auto& r : requests_) {
      arrivals.push_back(r.arrival_s);
      work.push_back(per_token * r.input_tokens);
    }
    auto out = per_token > 0 ? processor_sharing_departures(arrivals, work) : arrivals;
    for (double& t : out) t += front_end_s();
    return out;
  }

  void schedule_start() {
    // Load reports first, so the router knows its workers when the first request comes.
    for (uint32_t i = 0; i < units_.size(); ++i) push({0, event_kind::unit_report, false, i, 0});
    for (uint32_t i = 0; i < units_.size(); ++i) push({0, event_kind::unit_tick, false, i, 0});
    push({0, event_kind::router_tick, false, 0, 0});
    push({0, event_kind::broker_reclaim, false, 0, 0});
    const auto admitted = admission_times();
    for (uint32_t i = 0; i < requests_.size(); ++i) {
      push({static_cast<int64_t>(std::llround(admitted[i] * 1e9)), event_kind::arrival, false, i,
            0});
    }
    const double span = requests_.empty() ? 0.0 : requests_.back().arrival_s;
    sample_period_ns_ =
        static_cast<int64_t>(1e9 * (options_.sample_period_s > 0 ? options_.sample_period_s
                                                                 : std::max(span / 300.0, 0.05)));
    for (const char* name : {"requests in flight", "prompts waiting for prefill", "decode batch",
                             "waiting for decode KV memory", "KV memory used, prefill",
                             "KV memory used, decode", "GPU busy", "decode preemptions"}) {
      time_series s;
      s.name = name;
      const std::string_view n = name;
      s.unit = n.starts_with("KV")                               ? "fraction"
               : n == "GPU busy"                                 ? "fraction busy"
               : n == "decode preemptions"                       ? "preemptions so far"
               : n == "decode batch" || n.starts_with("waiting") ? "sequences"
                                                                 : "requests";
      series_.push_back(std::move(s));
    }
    push({sample_period_ns_, event_kind::sample, false, 0, 0});
  }

  void push(const event& e) { queue_.push(e.t, e); }

  [[nodiscard]] int64_t now_ms() const { return epoch_ms + now_ / ns_per_ms; }

  // ------------------------------------------------------------------ messages

  uint32_t store(msg::frames&& frames) {
    if (free_payloads_.empty()) {
      payloads_.push_back(std::move(frames));
      return static_cast<uint32_t>(payloads_.size() - 1);
    }
    const uint32_t slot = free_payloads_.back();
    free_payloads_.pop_back();
    payloads_[slot] = std::move(frames);
    return slot;
  }

  void flush(outbox& box) {
    if (box.pending().empty()) return;
    for (auto& m : box.take()) {
      auto it = address_to_target_.find(m.dst);
      if (it == address_to_target_.end()) {
        ++counters_["sim.unroutable"];
        continue;
      }
      const uint32_t slot = store(std::move(m.frames));
      push({now_ + hop_ns_, event_kind::deliver, false, it->second, slot});
    }
  }

  void handle(const event& e) {
    switch (e.kind) {
      case event_kind::deliver:
        return deliver(e);
      case event_kind::step_done:
        if (e.payload != timelines_[e.a].generation) return;  // the step was pushed back
        return step_done(e.a);
      case event_kind::stream_done:
        if (e.payload != timelines_[e.a].generation) return;  // a lead went in front of it
        return stream_done(e.a);
      case event_kind::arrival:
        return arrive(e.a);
      case event_kind::router_tick:
        if (router_->in_flight() > 0) {
          router_->tick(now_ms());
          flush(router_->out());
        }
        push({now_ + options_.tick_ms * ns_per_ms, event_kind::router_tick, false, 0, 0});
        return;
      case event_kind::broker_reclaim:
        if (broker_->live_handles() > 0) {
          broker_->reclaim(now_ms());
          flush(broker_->out());
        }
        push({now_ + int64_t{config_.broker.reclaim_interval_ms} * ns_per_ms,
              event_kind::broker_reclaim, false, 0, 0});
        return;
      case event_kind::unit_tick: {
        unit& u = *units_[e.a];
        if (!u.idle()) {
          if (u.prefill)
            u.prefill->tick(now_ms());
          else
            u.decode->tick(now_ms());
          kick(u.timeline);
          flush(u.out());
        }
        push({now_ + options_.tick_ms * ns_per_ms, event_kind::unit_tick, false, e.a, 0});
        return;
      }
      case event_kind::unit_report: {
        unit& u = *units_[e.a];
        u.out().send(router_address, u.load());
        flush(u.out());
        push({now_ + options_.report_ms * ns_per_ms, event_kind::unit_report, false, e.a, 0});
        return;
      }
      case event_kind::sample:
        return sample();
    }
  }

  void arrive(uint32_t index) {
    const auto& r = requests_[index];
    msg::submit s;
    s.request_id = index + 1;
    s.prompt_tokens.resize(r.input_tokens);
    const uint32_t vocab = std::max<uint32_t>(options_.prompt_vocab, 2);
    for (uint32_t j = 0; j < r.input_tokens; ++j) {
      s.prompt_tokens[j] =
          static_cast<int32_t>((uint64_t{j} * 7919 + uint64_t{index} * 104729 + 1) % vocab);
    }
    s.sampling.max_new_tokens = r.output_tokens;
    s.sampling.ignore_eos = true;
    client_out_.send(router_address, s);
    flush(client_out_);
  }

  void deliver(const event& e) {
    msg::frames frames = std::move(payloads_[e.payload]);
    free_payloads_.push_back(e.payload);
    auto env = msg::decode_envelope(frames);
    if (!env) {
      ++counters_["sim.malformed"];
      return;
    }
    const int64_t now = now_ms();
    if (e.a == target_client) return to_client(*env, frames);
    if (e.a == target_router) {
      auto& core = *router_;
      msg::dispatch(*env, frames, [&](const msg::envelope& en, auto& m) {
        using M = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<M, msg::submit>)
          core.on_submit(en, m, now);
        else if constexpr (std::is_same_v<M, msg::cancel>)
          core.on_cancel(en, m);
        else if constexpr (std::is_same_v<M, msg::prefill_done>)
          core.on_prefill_done(m, now);
        else if constexpr (std::is_same_v<M, msg::stage_failed>)
          core.on_stage_failed(en.src, m);
        else if constexpr (std::is_same_v<M, msg::request_done>)
          core.on_request_done(m);
        else if constexpr (std::is_same_v<M, msg::load_report>)
          core.on_load(en.src, m, now);
      });
      return flush(core.out());
    }
    if (e.a == target_broker) {
      auto& core = *broker_;
      msg::dispatch(*env, frames, [&](const msg::envelope& en, auto& m) {
        using M = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<M, msg::kv_register>) {
          if (auto it = address_to_target_.find(en.src);
              it != address_to_target_.end() && it->second >= first_unit) {
            handles_[m.handle.handle_id] = {it->second - first_unit, m.handle.bytes};
          }
          core.on_register(en.src, m, now);
        } else if constexpr (std::is_same_v<M, msg::kv_pull>)
          core.on_pull(en.src, m, now);
        else if constexpr (std::is_same_v<M, msg::kv_confirm>)
          core.on_confirm(en.src, m);
        else if constexpr (std::is_same_v<M, msg::kv_nack>)
          core.on_nack(en.src, m);
        else if constexpr (std::is_same_v<M, msg::kv_drop>)
          core.on_drop(en.src, m);
        else if constexpr (std::is_same_v<M, msg::kv_renew>)
          core.on_renew(en.src, m, now);
      });
      return flush(core.out());
    }
    const uint32_t index = e.a - first_unit;
    unit& u = *units_[index];
    if (u.synchronous && stepping(index)) {
      // Into the mailbox until the step returns (held_messages); the frames go back in a slot.
      event kept = e;
      kept.payload = store(std::move(frames));
      u.held.push_back({kept, now_});
      return;
    }
    deliver_to_unit(e, u, *env, frames, index, -1);
    kick(u.timeline);
    flush(u.out());
  }

  /// Whether unit `index` has a step in flight: enqueued on its shared stream and not yet
  /// returned, or running on its timeline.
  [[nodiscard]] bool stepping(uint32_t index) const {
    const unit& u = *units_[index];
    const timeline& tl = timelines_[u.timeline];
    if (tl.stream) return u.in_step;
    return tl.busy && tl.running == index;
  }

  /// What the worker's actor does when its synchronous step returns, before it applies the
  /// step (finish_step: its step_done comes after them in the mailbox): the messages that
  /// arrived meanwhile, in order. Their handlers step nothing (the actor is still stepping).
  void held_messages(unit& u, uint32_t index) {
    if (u.held.empty()) return;
    std::vector<unit::held_message> held;
    held.swap(u.held);
    for (const auto& [e, received_ns] : held) {
      msg::frames frames = std::move(payloads_[e.payload]);
      free_payloads_.push_back(e.payload);
      const auto env = msg::decode_envelope(frames);
      if (!env) continue;  // decoded once already
      deliver_to_unit(e, u, *env, frames, index, epoch_ms + received_ns / ns_per_ms);
    }
  }

  /// Hands a message to a worker's core (received_ms: when it reached a mailbox it waited
  /// in, else -1).
  void deliver_to_unit(const event& e, unit& u, const msg::envelope& env_in, msg::frames& frames,
                       uint32_t index, int64_t received) {
    const int64_t now = now_ms();
    const auto* env = &env_in;
    if (u.prefill) {
      auto& core = *u.prefill;
      msg::dispatch(*env, frames, [&](const msg::envelope& en, auto& m) {
        using M = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<M, msg::prefill_request>)
          core.on_request(en, m, now, received);
        else if constexpr (std::is_same_v<M, msg::cancel_seq>)
          core.on_cancel(m);
        else if constexpr (std::is_same_v<M, msg::kv_registered>)
          core.on_registered(m, now);
        else if constexpr (std::is_same_v<M, msg::kv_release>) {
          handles_.erase(m.handle_id);
          core.on_release(m);
        }
      });
    } else {
      if (env->type == static_cast<uint16_t>(msg::type_id::kv_moved) && !e.transferred) {
        if (const int64_t done = transfer_done(*env, frames, index); done > now_) {
          push({done, event_kind::deliver, true, e.a, store(std::move(frames))});
          return;
        }
      }
      auto& core = *u.decode;
      msg::dispatch(*env, frames, [&](const msg::envelope& en, auto& m) {
        using M = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<M, msg::kv_adopt>)
          core.on_adopt(en, m, now);
        else if constexpr (std::is_same_v<M, msg::kv_moved>)
          core.on_moved(m, now);
        else if constexpr (std::is_same_v<M, msg::cancel_seq>)
          core.on_cancel(m);
      });
    }
  }

  /// When the KV of a successful kv_moved has crossed the link to decode unit `dst`: the
  /// transfer starts now, after the link's earlier transfers from the same GPU.
  int64_t transfer_done(const msg::envelope& env, const msg::frames& frames, uint32_t dst) {
    auto moved = msg::decode_body<msg::kv_moved>(frames);
    if (!moved || moved->code != msg::error_code::none) return now_;
    auto it = handles_.find(moved->handle_id);
    if (it == handles_.end()) return now_;
    const uint32_t src_gpu = units_[it->second.owner]->spec.gpu;
    const uint32_t dst_gpu = units_[dst]->spec.gpu;
    const auto [kind, bandwidth] = link_between(src_gpu, dst_gpu);
    if (kind == link_kind::same_gpu || bandwidth <= 0) return now_;
    int64_t& free_at = link_free_[src_gpu * 4 + static_cast<uint32_t>(kind)];
    const int64_t start = std::max(now_, free_at);
    const auto duration =
        static_cast<int64_t>(std::llround(double(it->second.bytes) / bandwidth * 1e9)) +
        link_latency_ns[static_cast<uint32_t>(kind)];
    free_at = start + duration;
    ++counters_["sim.kv_transfers_" + std::string(to_string(kind))];
    counters_["sim.kv_bytes_transferred"] += it->second.bytes;
    counters_["sim.kv_transfer_us"] += static_cast<uint64_t>(duration / 1000);
    counters_["sim.kv_transfer_wait_us"] += static_cast<uint64_t>((start - now_) / 1000);
    return free_at;
  }

  void to_client(const msg::envelope& env, const msg::frames& frames) {
    const double t = now_ * 1e-9;
    auto finish = [&](uint64_t id, std::string outcome) {
      if (id == 0 || id > records_.size() || clients_[id - 1].done) return;
      clients_[id - 1].done = true;
      records_[id - 1].finish_s = t;
      records_[id - 1].outcome = std::move(outcome);
      ++finished_;
    };
    msg::dispatch(env, frames, [&](const msg::envelope&, auto& m) {
      using M = std::decay_t<decltype(m)>;
      if constexpr (std::is_same_v<M, msg::token_batch>) {
        for (const uint64_t id : m.request_ids) {
          if (id == 0 || id > records_.size() || clients_[id - 1].done) continue;
          auto& rec = records_[id - 1];
          auto& c = clients_[id - 1];
          if (!rec.first_token_s)
            rec.first_token_s = t;
          else
            rec.itl_s.push_back(t - c.last_token_s);
          c.last_token_s = t;
          ++rec.output_tokens;
        }
      } else if constexpr (std::is_same_v<M, msg::finish>) {
        const bool ok =
            m.reason == msg::finish_reason::stop || m.reason == msg::finish_reason::length;
        finish(m.request_id,
               ok ? std::string(request_outcome_ok) : std::string(msg::to_string(m.reason)));
      } else if constexpr (std::is_same_v<M, msg::rejected>) {
        finish(m.request_id, "rejected_" + std::string(msg::to_string(m.code)));
      }
    });
  }

  // ------------------------------------------------------------------ GPU timelines

  void kick(uint32_t t) {
    timeline& tl = timelines_[t];
    if (tl.stream) return kick_stream(t);
    if (tl.busy) return;
    const size_t n = tl.units.size();
    auto try_unit = [&](size_t pos) {
      unit& u = *units_[tl.units[pos]];
      const auto wait =
          u.prefill ? u.prefill->begin_step(now_ms()) : u.decode->begin_step(now_ms());
      if (!wait) return false;
      const auto [stretch, delay_ns] = contention(u, tl, u.engine->last_modeled());
      tl.busy = true;
      tl.running = tl.units[pos];
      tl.last = pos;
      tl.step_start = now_;
      const auto work_ns = static_cast<int64_t>(static_cast<double>(u.engine->last_modeled()) * stretch);
      tl.step_end = now_ + work_ns + delay_ns;
      if (u.prefill) {
        tl.step_end += overlap_decode_in_flight(u, tl);
        slow_split_decode_in_flight(tl);
      } else {
        slow_split_prefill_in_flight(tl);
      }
      push({tl.step_end, event_kind::step_done, false, t, ++tl.generation});
      // The prefill in flight loses SM time to the decode step's work, not to its wait.
      if (u.decode) {
        yield_to_decode(u, tl, work_ns);
        auto& peak = counters_["sim.peak_decode_batch"];
        peak = std::max<uint64_t>(peak, u.decode->stepping_batch());
      }
      return true;
    };
    if (n == 1 || deployment_.policy == step_policy::alternate) {
      for (size_t k = 1; k <= n; ++k) {
        if (try_unit((tl.last + k) % n)) return;
      }
      return;
    }
    const bool prefill_first = deployment_.policy == step_policy::prefill_first;
    for (int pass = 0; pass < 2; ++pass) {
      const bool want_prefill = (pass == 0) == prefill_first;
      for (size_t pos = 0; pos < n; ++pos) {
        if (static_cast<bool>(units_[tl.units[pos]]->prefill) == want_prefill && try_unit(pos))
          return;
      }
    }
  }

  /// How much longer a step of `u` (modelled alone at `work_ns`) takes because another engine
  /// of its GPU is busy on its own stream right now: a factor and an added delay in ns (1 and 0
  /// when alone, or on a timeline of its own SMs).
  std::pair<double, int64_t> contention(const unit& u, const timeline& tl, int64_t work_ns) const {
    const bool reserve = reserved_.contains(tl.gpu);
    if (u.spec.sm_share < 1 && !reserve) return {split_contention(u, tl, work_ns), 0};
    if (!u.spec.own_stream && !reserve) return {1.0, 0};
    for (const auto& other : timelines_) {
      if (&other == &tl || other.gpu != tl.gpu || !other.busy) continue;
      const auto& cal = specs_[tl.gpu].calibration;
      if (!u.decode) return {cal.concurrent_prefill_slowdown.value_or(1.0), 0};
      const unit& running = *units_[other.running];
      const double stretch = std::max(
          1.0, cal.concurrent_decode_slowdown.value_or(1.0) *
                   cal.concurrent_decode_slowdown_scale.at(prefill_step_tokens(running), 1.0));
      double delay = cal.concurrent_decode_delay_s.value_or(0.0) * 1e9 *
                     chunk_delay_factor(running, tl.gpu) *
                     cal.concurrent_decode_delay_scale.at(prefill_step_tokens(running), 1.0) *
                     decode_delay_factor(running, u, tl.gpu);
      if (cal.concurrent_decode_delay_by_overlap.value_or(false)) {
        // The step's kernels wait behind the prefill blocks only while the prefill step runs:
        // one that ends partway through this step delays it by that part of the delay.
        // The prefill step's end as it will be once it has yielded to this step's work.
        const double work = static_cast<double>(work_ns) * stretch;
        const double whole = work + delay;
        const double left = static_cast<double>(std::max<int64_t>(other.step_end - now_, 0)) +
                            decode_yield(u, running, tl.gpu) * work;
        if (whole > 0) delay *= std::min(1.0, left / whole);
      }
      return {stretch, static_cast<int64_t>(delay)};
    }
    return {1.0, 0};
  }

  /// A step on an SM share starting while the other share's step runs: a decode step beside a
  /// prefill step (split_decode_slowdown s) or a prefill step beside a decode step
  /// (split_prefill_slowdown at its share) runs s times as long until that step ends, then at its own pace.
  /// Returns the factor on the step's modelled work.
  [[nodiscard]] double split_contention(const unit& u, const timeline& tl, int64_t work_ns) const {
    const double s = split_slowdown(u, tl.gpu);
    if (s <= 1.0 || work_ns <= 0) return 1.0;
    const double left = static_cast<double>(std::max<int64_t>(busy_until(tl, !u.prefill) - now_, 0));
    return slowed_duration(static_cast<double>(work_ns), left, s) / static_cast<double>(work_ns);
  }

  /// The slowdown of `u`'s steps beside the other share's work (1: none).
  [[nodiscard]] double split_slowdown(const unit& u, uint32_t gpu) const {
    const auto& cal = specs_[gpu].calibration;
    if (u.prefill) return cal.split_prefill_slowdown.at(u.spec.sm_share, 1.0);
    return cal.split_decode_slowdown.value_or(1.0);
  }

  /// When the last prefill (or decode) step in flight on `tl`'s GPU, other than `tl`'s own,
  /// ends (now_ when none is).
  [[nodiscard]] int64_t busy_until(const timeline& tl, bool prefill) const {
    int64_t until = now_;
    for (const auto& other : timelines_) {
      if (&other == &tl || other.gpu != tl.gpu || !other.busy) continue;
      const unit& running = *units_[other.running];
      if (prefill ? static_cast<bool>(running.prefill) : static_cast<bool>(running.decode))
        until = std::max(until, other.step_end);
    }
    return until;
  }

  /// The time `work` takes when it runs s times slower for the first `slow_for` of it.
  [[nodiscard]] static double slowed_duration(double work, double slow_for, double s) {
    return slow_for >= work * s ? work * s : slow_for + (work - slow_for / s);
  }

  /// A prefill step starting on an SM share (timeline `tl`) while the other share's decode step
  /// runs: the rest of that decode step runs split_decode_slowdown times slower while both are
  /// in flight (split_contention, seen from the decode step's side).
  void slow_split_decode_in_flight(const timeline& tl) { slow_split_in_flight(tl, true); }

  /// A decode step starting on an SM share while the other share's prefill step runs: the rest
  /// of that prefill step runs split_prefill_slowdown times slower while both are in flight.
  /// The decode step's own end was priced before this moves the prefill step's end (first order).
  void slow_split_prefill_in_flight(const timeline& tl) { slow_split_in_flight(tl, false); }

  /// The steps of the other role on `tl`'s GPU, each on a share, slowed for the part of them
  /// that `tl`'s new step (of role prefill or not) overlaps.
  void slow_split_in_flight(const timeline& tl, bool prefill) {
    if (!tl.busy || units_[tl.running]->spec.sm_share >= 1) return;
    // Another share's step of tl's role in flight already slows the step until it ends; this
    // one slows what is left after that.
    const int64_t slow_from = busy_until(tl, prefill);
    if (tl.step_end <= slow_from) return;
    for (uint32_t t = 0; t < timelines_.size(); ++t) {
      timeline& other = timelines_[t];
      if (&other == &tl || other.gpu != tl.gpu || !other.busy) continue;
      const unit& slowed = *units_[other.running];
      if ((prefill ? !slowed.decode : !slowed.prefill) || slowed.spec.sm_share >= 1) continue;
      const double s = split_slowdown(slowed, tl.gpu);
      if (s <= 1.0) continue;
      const int64_t left = other.step_end - slow_from;
      if (left <= 0) continue;
      other.step_end = slow_from + static_cast<int64_t>(slowed_duration(
                                       static_cast<double>(left), static_cast<double>(tl.step_end - slow_from), s));
      push({other.step_end, event_kind::step_done, false, t, ++other.generation});
    }
  }

  /// A prefill step `u` starting while a decode step of its GPU runs on another stream (with
  /// concurrent_overlap_on_prefill_start): the decode step's kernels still to come queue behind
  /// the prefill blocks, so it ends later by the decode delay beside this chunk times the share
  /// of the step left; and the prefill step loses its yield of that rest, as beside a decode
  /// step starting during it. Returns the prefill step's added ns.
  int64_t overlap_decode_in_flight(const unit& u, const timeline& tl) {
    const auto& cal = specs_[tl.gpu].calibration;
    const bool reserve = reserved_.contains(tl.gpu);
    if (!(u.spec.own_stream || reserve) || (u.spec.sm_share < 1 && !reserve) ||
        !cal.concurrent_overlap_on_prefill_start.value_or(false))
      return 0;
    int64_t added = 0;
    for (uint32_t t = 0; t < timelines_.size(); ++t) {
      timeline& other = timelines_[t];
      if (&other == &tl || other.gpu != tl.gpu || !other.busy || other.stream) continue;
      const unit& decode = *units_[other.running];
      if (!decode.decode || !decode.spec.own_stream || decode.spec.sm_share < 1) continue;
      const int64_t whole = other.step_end - other.step_start, left = other.step_end - now_;
      if (whole <= 0 || left <= 0) continue;
      const double delay = cal.concurrent_decode_delay_s.value_or(0.0) * 1e9 *
                           chunk_delay_factor(u, tl.gpu) *
                           cal.concurrent_decode_delay_scale.at(prefill_step_tokens(u), 1.0) *
                           decode_delay_factor(u, decode, tl.gpu);
      other.step_end +=
          static_cast<int64_t>(delay * static_cast<double>(left) / static_cast<double>(whole));
      push({other.step_end, event_kind::step_done, false, t, ++other.generation});
      added += static_cast<int64_t>(std::min(1.0, decode_yield(decode, u, tl.gpu) *
                                                      reserve_yield_factor(u, decode, tl.gpu)) *
                                    static_cast<double>(left));
    }
    return added;
  }

  /// How the decode delay beside the step `running` has in flight scales with its chunk, when
  /// the calibration has concurrent_decode_tile_keys (else 1). Each decode kernel waits for
  /// the prefill thread block on the SMs it needs to retire, so the step's wait follows the
  /// time-weighted length of those blocks: a GEMM tile (the delay as calibrated), or an
  /// attention block, which reads its rows' keys and lasts (keys / tile_keys) · (GEMM
  /// efficiency / attention efficiency) times as long. The two weigh by the chunk's modelled
  /// GEMM and attention time; the keys are time-weighted too (Σ keys² / Σ keys).
  [[nodiscard]] double chunk_delay_factor(const unit& running, uint32_t gpu) const {
    const auto& cal = specs_[gpu].calibration;
    if (!cal.concurrent_decode_tile_keys) return 1.0;
    const prefill_shape& chunk = running.engine->last_prefill();
    if (chunk.tokens == 0 || chunk.key_sum <= 0) return 1.0;
    const auto& costs = costs_[gpu];
    const auto& m = costs.shape();
    const double per_pair = 4.0 * m.layers * m.heads * m.head_dim;
    const auto parts = costs.prefill_compute_parts(chunk.tokens, per_pair * chunk.key_sum);
    if (parts.gemm_s + parts.attention_s <= 0) return 1.0;
    const double keys = chunk.key_squares / chunk.key_sum;
    const double block = keys / *cal.concurrent_decode_tile_keys * parts.gemm_efficiency /
                         parts.attention_efficiency;
    return (parts.gemm_s + block * parts.attention_s) / (parts.gemm_s + parts.attention_s);
  }

  /// A decode step on its own stream takes SMs first (highest priority): a prefill step of
  /// the GPU in flight on another stream loses a fraction of the decode step's work time,
  /// `decode_yield` of it.
  void yield_to_decode(const unit& u, const timeline& tl, int64_t decode_ns) {
    const bool reserve = reserved_.contains(tl.gpu);
    if (!(u.spec.own_stream || reserve) || u.spec.sm_share < 1) return;
    for (uint32_t t = 0; t < timelines_.size(); ++t) {
      timeline& other = timelines_[t];
      if (&other == &tl || other.gpu != tl.gpu || !other.busy) continue;
      const unit& running = *units_[other.running];
      if (!running.prefill || !running.spec.own_stream || (running.spec.sm_share < 1 && !reserve))
        continue;
      const double yield =
          std::min(1.0, decode_yield(u, running, tl.gpu) * reserve_yield_factor(running, u, tl.gpu));
      if (yield <= 0) continue;
      other.step_end += static_cast<int64_t>(yield * static_cast<double>(decode_ns));
      push({other.step_end, event_kind::step_done, false, t, ++other.generation});
    }
  }

  /// The fraction of a decode step's work that a prefill step beside it loses:
  /// concurrent_prefill_yield, or, with concurrent_prefill_attention_yield set, the two
  /// weighted by the step's attention share a (cost_model::decode_parts): the attention
  /// kernels (KV reads) take that key's fraction of the SMs from prefill, the rest of the
  /// step (the weight GEMMs, norms, sampling) concurrent_prefill_yield. A recompute chunk
  /// (a prefill call of the decode worker) takes concurrent_prefill_yield. Either is scaled by
  /// concurrent_prefill_yield_scale at the tokens of `running` (the prefill step losing it),
  /// up to the whole step. A prefill step on a partition beside a whole-GPU decode takes
  /// reserve_prefill_attention_yield for the attention part, when the calibration has it.
  [[nodiscard]] double decode_yield(const unit& u, const unit& running, uint32_t gpu) const {
    const auto& cal = specs_[gpu].calibration;
    const double scale = cal.concurrent_prefill_yield_scale.at(prefill_step_tokens(running), 1.0);
    const double rest = cal.concurrent_prefill_yield.value_or(0.0);
    const auto attention_yield = free_beside_partition(running, gpu) &&
                                         cal.reserve_prefill_attention_yield
                                     ? cal.reserve_prefill_attention_yield
                                     : cal.concurrent_prefill_attention_yield;
    if (!attention_yield || u.engine->last_prefill().tokens > 0)
      return std::min(1.0, rest * scale);
    const decode_shape& step = u.engine->last_decode();
    const double a =
        costs_[gpu].decode_parts(step.batch, step.context, step.graph_rows).attention_share();
    return std::min(1.0, (rest + (*attention_yield - rest) * a) * scale);
  }

  /// The factor on the delay of a decode step of `decode` beside the prefill step of
  /// `prefill`: a whole-GPU decode beside a prefill on a partition (a share below 1, on a GPU
  /// where a worker at share 1 runs too) takes reserve_decode_delay_scale at the SMs no
  /// partition holds times reserve_decode_delay_batch_scale at the step's rows; on streams,
  /// concurrent_decode_delay_batch_scale at the step's rows.
  [[nodiscard]] double decode_delay_factor(const unit& prefill, const unit& decode,
                                           uint32_t gpu) const {
    const auto& cal = specs_[gpu].calibration;
    const auto rows = decode.engine->last_decode().batch;
    const auto free = free_beside_partition(prefill, gpu);
    if (!free) return cal.concurrent_decode_delay_batch_scale.at(rows, 1.0);
    return cal.reserve_decode_delay_scale.at(*free, 1.0) *
           cal.reserve_decode_delay_batch_scale.at(rows, 1.0);
  }

  /// The factor on the yield a prefill step on a partition (`prefill`) loses to each
  /// whole-GPU decode step of `decode` beside it: reserve_prefill_yield_scale at the SMs no
  /// partition holds, else the partition's share (the decode kernels spread over every SM, and
  /// the part on the free SMs costs prefill nothing), times reserve_prefill_yield_batch_scale
  /// at the step's rows. 1 on streams.
  [[nodiscard]] double reserve_yield_factor(const unit& prefill, const unit& decode,
                                            uint32_t gpu) const {
    const auto free = free_beside_partition(prefill, gpu);
    if (!free) return 1.0;
    const auto& cal = specs_[gpu].calibration;
    return cal.reserve_prefill_yield_scale.at(*free, prefill.spec.sm_share) *
           cal.reserve_prefill_yield_batch_scale.at(decode.engine->last_decode().batch, 1.0);
  }

  /// The fraction of the SMs no partition holds, when `prefill` runs on a partition of a GPU
  /// whose decode runs on the whole of it; nothing otherwise (streams, splits).
  [[nodiscard]] std::optional<double> free_beside_partition(const unit& prefill,
                                                            uint32_t gpu) const {
    const auto it = reserved_.find(gpu);
    if (it == reserved_.end() || prefill.spec.sm_share >= 1) return std::nullopt;
    return it->second;
  }

  /// The tokens of the step `running` has in flight (0 when it is not a prefill step).
  [[nodiscard]] static double prefill_step_tokens(const unit& running) {
    return static_cast<double>(running.engine->last_prefill().tokens);
  }

  // A shared CUDA stream (step_policy::stream), as two cuda engines of one process use it
  // (runtime/cuda_engine.cpp, shared_device_stream): each worker's actor enqueues its step as
  // soon as its core has work, whatever the other one does, and the GPU runs the queue in
  // order. begin_step is that enqueue, so the step's batch or chunks are fixed then; the step
  // returns (finish_step) when its cudaStreamSynchronize does, which waits for everything
  // queued ahead of it as well as its own work. A prefill step that sampled tokens syncs once
  // more after reading them back, by when the decode step enqueued while it ran is on the
  // stream too: it returns only after that step. The hop_step counters read those walls.

  void kick_stream(uint32_t t) {
    timeline& tl = timelines_[t];
    for (const uint32_t i : tl.units) {
      unit& u = *units_[i];
      if (u.in_step) continue;
      const auto wait =
          u.prefill ? u.prefill->begin_step(now_ms()) : u.decode->begin_step(now_ms());
      if (!wait) continue;
      u.in_step = true;
      u.second_sync = u.prefill && u.engine->last_prefill_sampled() > 0;
      u.wait_serial = 0;
      int64_t work = u.engine->last_modeled();
      uint32_t rows = 0;
      if (u.prefill) {
        const double delay = specs_[tl.gpu].calibration.shared_prefill_delay_s.value_or(0.0);
        work += static_cast<int64_t>(std::llround(delay * 1e9));
        work -= lead_decode_enqueued_now(t, i, work);
      } else {
        rows = u.decode->stepping_batch();
        auto& peak = counters_["sim.peak_decode_batch"];
        peak = std::max<uint64_t>(peak, rows);
      }
      tl.fifo.push_back({i, ++tl.serials, work, now_, rows});
      if (tl.fifo.size() == 1) start_stream_head(t);
    }
  }

  /// A prefill step of unit `prefill` (`work` ns) enqueued in the same instant as a decode
  /// step: live, the decode worker prepares its rows on the host before it launches, and the
  /// prefill kernels enqueued meanwhile run first (H200 colocated runs: decode steps that
  /// began with a 2,048-token chunk took 0.5 ms longer than alone at up to 64 rows, 1 ms at
  /// 96-160, 4-5.5 ms at 224-256; docs/sim.md). Moves shared_decode_lag_s at the decode
  /// step's rows of the prefill work in front of it; returns the ns moved.
  int64_t lead_decode_enqueued_now(uint32_t t, uint32_t prefill, int64_t work) {
    timeline& tl = timelines_[t];
    const auto& lag_curve = specs_[tl.gpu].calibration.shared_decode_lag_s;
    if (lag_curve.empty()) return 0;
    auto decode = std::find_if(tl.fifo.begin(), tl.fifo.end(), [&](const stream_item& item) {
      return item.decode_rows > 0 && item.enqueued_ns == now_;
    });
    if (decode == tl.fifo.end()) return 0;
    const bool running = decode == tl.fifo.begin();
    if (running && tl.step_start != now_) return 0;
    const int64_t lead = std::min(
        work, static_cast<int64_t>(std::llround(lag_curve.at(decode->decode_rows, 0.0) * 1e9)));
    if (lead <= 0) return 0;
    tl.fifo.insert(decode, {prefill, ++tl.serials, lead, now_, 0, true});
    if (running) start_stream_head(t);  // its stream_done event goes stale
    ++counters_["sim.stream_decode_lags"];
    return lead;
  }

  void start_stream_head(uint32_t t) {
    timeline& tl = timelines_[t];
    const stream_item& head = tl.fifo.front();
    tl.busy = true;
    tl.running = head.unit;
    tl.step_start = now_;
    tl.step_end = now_ + head.work_ns;
    push({tl.step_end, event_kind::stream_done, false, t, ++tl.generation});
  }

  void stream_done(uint32_t t) {
    timeline& tl = timelines_[t];
    const stream_item done = tl.fifo.front();
    tl.fifo.pop_front();
    tl.busy_since_sample += now_ - std::max(tl.step_start, last_sample_);
    tl.busy = false;
    if (!tl.fifo.empty()) start_stream_head(t);
    // Whose sync returns now: the owner of the finished work, unless it syncs again behind
    // what is queued now, and whoever waited for this item. The owner goes first: the other
    // worker, a prefill worker computing on its actor's thread, also waits for the broker's ack
    // of the prompts it finished before its next step (prefill_settings::register_hold_ms).
    std::vector<uint32_t> returning;
    unit& owner = *units_[done.unit];
    if (done.lead) {
      // the rest of the step is queued behind the decode step
    } else if (owner.second_sync && !tl.fifo.empty()) {
      owner.wait_serial = tl.fifo.back().serial;
      ++counters_["sim.stream_second_sync_waits"];
    } else {
      returning.push_back(done.unit);
    }
    for (const uint32_t i : tl.units) {
      if (units_[i]->wait_serial == done.serial) returning.push_back(i);
    }
    for (const uint32_t i : returning) {
      unit& u = *units_[i];
      u.in_step = false;
      u.wait_serial = 0;
      held_messages(u, i);
      if (u.prefill)
        u.prefill->finish_step(now_ms());
      else
        u.decode->finish_step(now_ms());
      kick_stream(t);
    }
    for (uint32_t i : tl.units) flush(units_[i]->out());
  }

  void step_done(uint32_t t) {
    timeline& tl = timelines_[t];
    unit& u = *units_[tl.running];
    held_messages(u, tl.running);
    if (u.prefill)
      u.prefill->finish_step(now_ms());
    else
      u.decode->finish_step(now_ms());
    tl.busy = false;
    tl.busy_since_sample += now_ - std::max(tl.step_start, last_sample_);
    kick(t);
    for (uint32_t i : tl.units) flush(units_[i]->out());
  }

  // ------------------------------------------------------------------ observation

  void sample() {
    double prefill_waiting = 0, decode_running = 0, decode_waiting = 0;
    double p_used = 0, p_total = 0, d_used = 0, d_total = 0, preemptions = 0;
    for (const auto& u : units_) {
      const auto l = u->load();
      if (u->prefill) {
        prefill_waiting += l.queued;
        p_used += u->pool().used_blocks();
        p_total += u->pool().total_blocks();
      } else {
        decode_running += l.running;
        decode_waiting += l.queued;
        d_used += u->pool().used_blocks();
        d_total += u->pool().total_blocks();
        const auto c = u->decode->counters();
        if (auto it = c.find("preemptions"); it != c.end()) preemptions += double(it->second);
      }
    }
    double busy = 0;
    const double period = double(now_ - last_sample_);
    for (auto& tl : timelines_) {
      if (tl.busy) tl.busy_since_sample += now_ - std::max(tl.step_start, last_sample_);
      busy += period > 0 ? double(tl.busy_since_sample) / period : 0.0;
      tl.busy_since_sample = 0;
    }
    last_sample_ = now_;
    const double values[] = {
        double(router_->in_flight()),
        prefill_waiting,
        decode_running,
        decode_waiting,
        p_total > 0 ? p_used / p_total : 0.0,
        d_total > 0 ? d_used / d_total : 0.0,
        timelines_.empty() ? 0.0 : std::min(1.0, busy / double(timelines_.size())),
        preemptions};
    for (size_t i = 0; i < series_.size(); ++i) {
      series_[i].t_s.push_back(now_ * 1e-9);
      series_[i].values.push_back(values[i]);
    }
    if (finished_ < requests_.size())
      push({now_ + sample_period_ns_, event_kind::sample, false, 0, 0});
  }

  std::map<std::string, uint64_t> collect_counters() const {
    std::map<std::string, uint64_t> out = counters_;
    for (const auto& [k, v] : router_->counters()) out["router." + k] += v;
    for (const auto& [k, v] : broker_->counters()) out["broker." + k] += v;
    for (const auto& u : units_) {
      const std::string prefix = u->prefill ? "prefill." : "decode.";
      for (const auto& [k, v] : u->prefill ? u->prefill->counters() : u->decode->counters())
        out[prefix + k] += v;
      out[prefix + "double_frees"] += u->pool().double_frees();
    }
    out["sim.events"] = events_;
    return out;
  }

  std::vector<std::string> worker_lines() const {
    std::vector<std::string> out;
    for (const auto& u : units_) {
      const auto& w = u->spec;
      char line[288];
      const auto sms = unit_spec_sms_.find(static_cast<uint32_t>(&u - units_.data()));
      const std::string of_sms =
          sms == unit_spec_sms_.end()
              ? std::string()
              : " (" + std::to_string(static_cast<int>(sms->second)) + " of " +
                    std::to_string(specs_[w.gpu].sms) + " SMs)";
      std::snprintf(line, sizeof line,
                    "%-20s %-7s GPU %u (%s, host %u)  SM share %.2f%s  KV %u blocks  batch %u%s%s",
                    w.address.c_str(), u->prefill ? "prefill" : "decode", w.gpu,
                    deployment_.gpus[w.gpu].type.c_str(), deployment_.gpus[w.gpu].host, w.sm_share,
                    of_sms.c_str(),
                    u->kv_blocks, w.max_batch,
                    u->prefill ? ("  chunk " + std::to_string(w.chunk_tokens)).c_str() : "",
                    w.own_stream && w.sm_share >= 1 ? "  own stream" : "");
      out.emplace_back(line);
    }
    return out;
  }

  const deployment_config& config_;
  const sim_deployment& deployment_;
  const sim_options& options_;
  std::vector<trace_request> requests_;
  std::vector<request_record> records_;
  std::vector<client_state> clients_;
  size_t finished_ = 0;
  outbox client_out_;
  std::vector<gpu_spec> specs_;
  std::vector<cost_model> costs_;  // per GPU, at full share: what the contention model prices
  // The config's engine computes inside the actor's step (cuda, cpu): a worker reads no
  // message while its step runs. The live sim engine's step is a timer: messages flow.
  bool synchronous_steps_ = config_.engine.kind != "sim";
  std::unique_ptr<router_core> router_;
  std::unique_ptr<broker_core> broker_;
  std::vector<std::unique_ptr<unit>> units_;
  std::vector<timeline> timelines_;
  // GPU -> the fraction of its SMs no partition holds, on GPUs where workers at share 1 run
  // beside workers on partitions (docs/sim.md, "A prefill partition beside the whole GPU").
  std::map<uint32_t, double> reserved_;
  std::map<uint32_t, double> unit_spec_sms_;  // unit -> the SMs of its partition (sm_share < 1)
  std::unordered_map<std::string, uint32_t> address_to_target_;
  std::unordered_map<uint64_t, handle_info> handles_;
  std::vector<int64_t> link_free_;  // per source GPU and link kind: when its egress is free
  timed_queue<event> queue_;
  std::vector<msg::frames> payloads_;
  std::vector<uint32_t> free_payloads_;
  uint64_t events_ = 0;
  int64_t now_ = 0;
  int64_t hop_ns_ = static_cast<int64_t>(std::llround(options_.hop_s * 1e9));
  int64_t sample_period_ns_ = 0;
  int64_t last_sample_ = 0;
  std::vector<time_series> series_;
  std::map<std::string, uint64_t> counters_;
};

}  // namespace

sim_result run_simulation(const deployment_config& config, const sim_deployment& deployment,
                          std::span<const trace_request> trace, const sim_options& options) {
  event_sim sim(config, deployment, trace, options);
  return sim.run();
}

}  // namespace duet
