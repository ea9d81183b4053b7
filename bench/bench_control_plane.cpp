// Control-plane CPU per request (docs/benchmarks.md, "Transport and control plane"): the
// whole disaggregated lifecycle of a request (submit -> admitted -> prefill -> kv_register /
// kv_registered -> prefill_done -> kv_adopt -> kv_pull / kv_moved / kv_confirm / kv_release
// -> tokens -> finish -> request_done) with the sim engine at time_scale 0, so that nothing
// but the control plane costs anything.
//   cores  the four policy cores pumped by one thread: every message encoded by its sender
//          and decoded and dispatched as in actors/roles.cpp, no actors, no sockets
//   live   live nodes in this process (CAF actors + transports over inproc://) and a client;
//          process CPU time (every thread: client, transports, actors, CAF scheduler) per
//          request, and the same without the client thread
// Requests go in waves of `concurrency`; counters are microseconds of CPU per request.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <ctime>
#include <deque>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "actors/node.hpp"
#include "messages/dispatch.hpp"
#include "runtime/broker_core.hpp"
#include "runtime/client.hpp"
#include "runtime/config.hpp"
#include "runtime/decode_core.hpp"
#include "runtime/engine.hpp"
#include "runtime/prefill_core.hpp"
#include "runtime/router_core.hpp"

using namespace duet;
using clock_type = std::chrono::steady_clock;

namespace {

double cpu_seconds(clockid_t clock) {
  timespec ts{};
  ::clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

constexpr uint32_t prompt_tokens = 512;

msg::submit request_of(uint64_t request_id, uint32_t max_new_tokens) {
  msg::submit s;
  s.request_id = request_id;
  s.prompt_tokens.resize(prompt_tokens);
  for (uint32_t i = 0; i < prompt_tokens; ++i)
    s.prompt_tokens[i] = static_cast<int32_t>((request_id * 31 + i) % 50000);
  s.sampling.max_new_tokens = max_new_tokens;
  return s;
}

// ------------------------------------------------------------------ cores, one thread

/// Router, broker, one prefill and one decode core wired through one FIFO "network". Worker
/// steps follow the actors: a step begins after a message when none is running, and ends
/// at a step_done marker queued behind the messages already in flight. The clock stands
/// still (no deadline ever passes); timers run every 64 requests.
class pumped_cluster {
 public:
  explicit pumped_cluster(uint32_t max_new_tokens)
      : config_(make_config()),
        prefill_engine_(make_engine(config_, actor("prefill0"))),
        decode_engine_(make_engine(config_, actor("decode0"))),
        router_(router_address, router_settings_of(config_),
                [](const std::string&) { return std::vector<int32_t>{}; }),
        broker_(broker_address, broker_settings{config_.broker.lease_ms, config_.engine.kind}),
        prefill_(prefill_address, prefill_settings_of(config_), *prefill_engine_),
        decode_(decode_address, decode_settings_of(config_), *decode_engine_),
        client_box_(client_address),
        max_new_tokens_(max_new_tokens) {
    timers();
    pump();
  }

  /// Submits `requests` requests and pumps until the network is quiet. Returns how many
  /// finished as asked (reason length, max_new_tokens tokens).
  uint32_t wave(uint32_t requests) {
    finished_ok_ = 0;
    for (uint32_t i = 0; i < requests; ++i)
      client_box_.send(router_address, request_of(++request_id_, max_new_tokens_));
    collect(client_box_);
    pump();
    since_timers_ += requests;
    if (since_timers_ >= 64) {
      since_timers_ = 0;
      timers();
      pump();
    }
    return finished_ok_;
  }

  /// True when every request is forgotten and every block is back in its pool.
  [[nodiscard]] bool clean() const {
    return router_.in_flight() == 0 && broker_.live_handles() == 0 &&
           prefill_.pool().free_blocks() == prefill_.pool().total_blocks() &&
           decode_.pool().free_blocks() == decode_.pool().total_blocks();
  }

 private:
  static constexpr const char* router_address = "n/router";
  static constexpr const char* broker_address = "n/broker";
  static constexpr const char* prefill_address = "n/prefill0";
  static constexpr const char* decode_address = "n/decode0";
  static constexpr const char* client_address = "n/client";
  enum class target : uint8_t { message, prefill_step_done, decode_step_done };
  struct item {
    target what = target::message;
    outgoing message;
  };

  static deployment_config make_config() {
    auto config = default_config();
    config.engine.time_scale = 0.0;
    return config;
  }
  const actor_config& actor(const std::string& name) const {
    for (const auto& a : config_.nodes.at(0).actors) {
      if (a.name == name) return a;
    }
    throw std::runtime_error("no actor " + name + " in the default deployment");
  }
  static router_settings router_settings_of(const deployment_config& c) {
    router_settings s;
    s.broker = broker_address;
    s.prefill_workers = {prefill_address};
    s.decode_workers = {decode_address};
    s.policy = c.router.policy;
    s.queue_limit = c.router.queue_limit;
    s.request_timeout_ms = c.router.request_timeout_ms;
    s.max_context = c.model.max_context;
    s.max_new_tokens_limit = c.router.max_new_tokens_limit;
    s.give_up_grace_ms = c.broker.transfer_timeout_ms;
    s.worker_timeout_ms = c.transport.peer_timeout_ms;
    return s;
  }
  prefill_settings prefill_settings_of(const deployment_config& c) const {
    const auto& a = actor("prefill0");
    prefill_settings s;
    s.router = router_address;
    s.broker = broker_address;
    s.kv_blocks = a.kv_blocks;
    s.chunk_tokens = a.chunk_tokens;
    s.max_batch = a.max_batch;
    s.register_timeout_ms = c.broker.transfer_timeout_ms;
    return s;
  }
  decode_settings decode_settings_of(const deployment_config& c) const {
    const auto& a = actor("decode0");
    decode_settings s;
    s.router = router_address;
    s.broker = broker_address;
    s.kv_blocks = a.kv_blocks;
    s.max_batch = a.max_batch;
    s.transfer_timeout_ms = c.broker.transfer_timeout_ms;
    s.renew_every_ms = std::max<uint32_t>(c.broker.lease_ms / 3, 1);
    return s;
  }

  void collect(outbox& box) {
    for (auto& m : box.take()) wire_.push_back({target::message, std::move(m)});
  }

  /// The actors' timers: router tick, broker reclaim, worker ticks and load reports.
  void timers() {
    router_.tick(now_);
    broker_.reclaim(now_);
    prefill_.tick(now_);
    decode_.tick(now_);
    prefill_.out().send(router_address, prefill_.load());
    decode_.out().send(router_address, decode_.load());
    collect(router_.out());
    collect(broker_.out());
    collect(prefill_.out());
    collect(decode_.out());
  }

  template <class Core>
  void maybe_step(Core& core, bool& stepping, target done) {
    if (stepping) return;
    if (!core.begin_step(now_)) return;
    stepping = true;
    wire_.push_back({done, {}});
  }

  void pump() {
    while (!wire_.empty()) {
      item it = std::move(wire_.front());
      wire_.pop_front();
      if (it.what == target::prefill_step_done) {
        prefill_.finish_step(now_);
        prefill_stepping_ = false;
        maybe_step(prefill_, prefill_stepping_, target::prefill_step_done);
        collect(prefill_.out());
        continue;
      }
      if (it.what == target::decode_step_done) {
        decode_.finish_step(now_);
        decode_stepping_ = false;
        maybe_step(decode_, decode_stepping_, target::decode_step_done);
        collect(decode_.out());
        continue;
      }
      deliver(it.message);
    }
  }

  void deliver(const outgoing& m) {
    auto env = msg::decode_envelope(m.frames);
    if (!env) throw std::runtime_error("undecodable envelope: " + env.error());
    const std::string_view actor_name = std::string_view(m.dst).substr(m.dst.find('/') + 1);
    if (m.dst == router_address) {
      [[maybe_unused]] auto outcome =
          msg::dispatch(*env, m.frames, [&](const msg::envelope& e, auto& body) {
            using M = std::decay_t<decltype(body)>;
            if constexpr (std::is_same_v<M, msg::submit>)
              router_.on_submit(e, body, now_);
            else if constexpr (std::is_same_v<M, msg::cancel>)
              router_.on_cancel(e, body);
            else if constexpr (std::is_same_v<M, msg::prefill_done>)
              router_.on_prefill_done(body, now_);
            else if constexpr (std::is_same_v<M, msg::stage_failed>)
              router_.on_stage_failed(e.src, body);
            else if constexpr (std::is_same_v<M, msg::request_done>)
              router_.on_request_done(body);
            else if constexpr (std::is_same_v<M, msg::load_report>)
              router_.on_load(e.src, body, now_);
          });
      collect(router_.out());
    } else if (m.dst == broker_address) {
      [[maybe_unused]] auto outcome =
          msg::dispatch(*env, m.frames, [&](const msg::envelope& e, auto& body) {
            using M = std::decay_t<decltype(body)>;
            if constexpr (std::is_same_v<M, msg::kv_register>)
              broker_.on_register(e.src, body, now_);
            else if constexpr (std::is_same_v<M, msg::kv_pull>)
              broker_.on_pull(e.src, body, now_);
            else if constexpr (std::is_same_v<M, msg::kv_confirm>)
              broker_.on_confirm(e.src, body);
            else if constexpr (std::is_same_v<M, msg::kv_nack>)
              broker_.on_nack(e.src, body);
            else if constexpr (std::is_same_v<M, msg::kv_drop>)
              broker_.on_drop(e.src, body);
            else if constexpr (std::is_same_v<M, msg::kv_renew>)
              broker_.on_renew(e.src, body, now_);
          });
      collect(broker_.out());
    } else if (m.dst == prefill_address) {
      [[maybe_unused]] auto outcome =
          msg::dispatch(*env, m.frames, [&](const msg::envelope& e, auto& body) {
            using M = std::decay_t<decltype(body)>;
            if constexpr (std::is_same_v<M, msg::prefill_request>)
              prefill_.on_request(e, body, now_);
            else if constexpr (std::is_same_v<M, msg::cancel_seq>)
              prefill_.on_cancel(body);
            else if constexpr (std::is_same_v<M, msg::kv_registered>)
              prefill_.on_registered(body, now_);
            else if constexpr (std::is_same_v<M, msg::kv_release>)
              prefill_.on_release(body);
          });
      maybe_step(prefill_, prefill_stepping_, target::prefill_step_done);
      collect(prefill_.out());
    } else if (m.dst == decode_address) {
      [[maybe_unused]] auto outcome =
          msg::dispatch(*env, m.frames, [&](const msg::envelope& e, auto& body) {
            using M = std::decay_t<decltype(body)>;
            if constexpr (std::is_same_v<M, msg::kv_adopt>)
              decode_.on_adopt(e, body, now_);
            else if constexpr (std::is_same_v<M, msg::kv_moved>)
              decode_.on_moved(body, now_);
            else if constexpr (std::is_same_v<M, msg::cancel_seq>)
              decode_.on_cancel(body);
          });
      maybe_step(decode_, decode_stepping_, target::decode_step_done);
      collect(decode_.out());
    } else if (m.dst == client_address) {
      // The client reads the final answer of each request; tokens and admissions it skips.
      if (env->type == static_cast<uint16_t>(msg::type_id::finish)) {
        auto f = msg::decode_body<msg::finish>(m.frames);
        if (f && f->reason == msg::finish_reason::length && f->completion_tokens == max_new_tokens_)
          ++finished_ok_;
      }
    } else {
      throw std::runtime_error("a message for an unknown actor: " + std::string(actor_name));
    }
  }

  deployment_config config_;
  std::unique_ptr<engine> prefill_engine_;
  std::unique_ptr<engine> decode_engine_;
  router_core router_;
  broker_core broker_;
  prefill_core prefill_;
  decode_core decode_;
  outbox client_box_;
  std::deque<item> wire_;
  bool prefill_stepping_ = false;
  bool decode_stepping_ = false;
  int64_t now_ = 1'700'000'000'000;
  uint32_t max_new_tokens_;
  uint64_t request_id_ = 0;
  uint32_t since_timers_ = 0;
  uint32_t finished_ok_ = 0;
};

/// Args: concurrency (requests per wave), max_new_tokens.
void BM_cores_one_thread(benchmark::State& state) {
  const auto concurrency = static_cast<uint32_t>(state.range(0));
  const auto max_new = static_cast<uint32_t>(state.range(1));
  state.SetLabel("waves of " + std::to_string(concurrency) + ", max_new_tokens " +
                 std::to_string(max_new));
  pumped_cluster cluster(max_new);
  uint64_t requests = 0;
  double cpu = 0;
  for (auto _ : state) {
    const double before = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    const uint32_t ok = cluster.wave(concurrency);
    cpu += cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - before;
    if (ok != concurrency) {
      state.SkipWithError("a request did not finish with max_new_tokens tokens");
      return;
    }
    requests += concurrency;
  }
  if (!cluster.clean()) state.SkipWithError("blocks or handles were left behind");
  state.SetItemsProcessed(static_cast<int64_t>(requests));
  if (requests > 0)
    state.counters["cpu_us_per_request"] = cpu * 1e6 / static_cast<double>(requests);
}

// ------------------------------------------------------------------ live nodes in this process

/// The built-in deployment (router, broker, prefill0, decode0) on one node, or split over
/// two: n1 = router + broker + prefill0, n2 = decode0. inproc:// endpoints, sim at time_scale 0.
deployment_config live_config(int nodes) {
  auto config = default_config();
  config.engine.time_scale = 0.0;
  // A fresh name for every cluster: ZeroMQ releases an inproc name only once its reaper has
  // closed the socket, which can be after the next cluster wants to bind it.
  static std::atomic<uint32_t> serial{0};
  const std::string stem =
      "inproc://duet-cp-" + std::to_string(::getpid()) + "-" + std::to_string(serial++) + "-";
  if (nodes == 1) {
    config.nodes.at(0).endpoint = stem + "local";
  } else {
    node_config decode_node;
    decode_node.name = "n2";
    decode_node.endpoint = stem + "n2";
    auto& first = config.nodes.at(0);
    first.name = "n1";
    first.endpoint = stem + "n1";
    for (auto it = first.actors.begin(); it != first.actors.end();) {
      if (it->role == actor_role::decode) {
        decode_node.actors.push_back(*it);
        it = first.actors.erase(it);
      } else {
        ++it;
      }
    }
    config.nodes.push_back(std::move(decode_node));
  }
  validate_config(config);
  return config;
}

/// CAF's default scheduler, or the one `duet` runs (duet::tune_actor_system): its moderate
/// polling phase (up to 500 sleeps of 50 us after a worker runs out of work) turned off, so idle
/// workers block on their condition variable after the short aggressive spin.
enum class scheduler_mode : int { caf_defaults = 0, as_duet_runs_it = 1 };

class live_cluster {
 public:
  live_cluster(int nodes, scheduler_mode mode) : config_(live_config(nodes)) {
    if (mode == scheduler_mode::as_duet_runs_it) tune_actor_system(system_config_);
    system_ = std::make_unique<caf::actor_system>(system_config_);
    for (const auto& n : config_.nodes)
      nodes_.push_back(std::make_unique<node>(*system_, config_, n.name));
    router_ = config_.nodes.at(0).name + "/router";
    client_ = std::make_unique<client>(nodes_.at(0)->endpoint(), router_);
  }
  ~live_cluster() {
    client_.reset();
    for (auto& n : nodes_) n->stop();
    nodes_.clear();
    system_.reset();
  }

  /// Waits until the router has seen load reports from both workers.
  bool ready(std::chrono::milliseconds timeout) {
    const auto until = clock_type::now() + timeout;
    while (clock_type::now() < until) {
      auto replies = client_->stats({router_}, std::chrono::milliseconds(200));
      if (!replies.empty() && replies[0].counters["ready_prefill"] > 0 &&
          replies[0].counters["ready_decode"] > 0) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  /// Submits `requests` at once and waits for every final answer. Returns how many
  /// finished as asked (reason length, max_new_tokens tokens streamed).
  uint32_t wave(uint32_t requests, uint32_t max_new_tokens) {
    std::map<uint64_t, uint32_t> tokens;
    for (uint32_t i = 0; i < requests; ++i) {
      const auto s = request_of(++request_id_, max_new_tokens);
      if (!client_->submit(s)) return 0;
      tokens[s.request_id] = 0;
    }
    uint32_t ended = 0, ok = 0;
    const auto until = clock_type::now() + std::chrono::seconds(10);
    while (ended < requests && clock_type::now() < until) {
      for (const auto& e : client_->poll(std::chrono::milliseconds(100))) {
        auto it = tokens.find(e.request_id);
        if (it == tokens.end()) continue;
        if (e.what == client_event::kind::tokens)
          it->second += static_cast<uint32_t>(e.tokens.size());
        if (e.what == client_event::kind::rejected) ++ended;
        if (e.what == client_event::kind::finished) {
          ++ended;
          if (e.finish.reason == msg::finish_reason::length && it->second == max_new_tokens) ++ok;
        }
      }
    }
    return ok;
  }

 private:
  deployment_config config_;
  caf::actor_system_config system_config_;
  std::unique_ptr<caf::actor_system> system_;
  std::vector<std::unique_ptr<node>> nodes_;
  std::string router_;
  std::unique_ptr<client> client_;
  uint64_t request_id_ = 0;
};

const char* mode_name(scheduler_mode mode) {
  return mode == scheduler_mode::caf_defaults ? "CAF defaults" : "as duet runs it (no moderate polling)";
}

/// Args: nodes (1 or 2), concurrency (requests per wave), max_new_tokens, scheduler mode.
void BM_live_nodes(benchmark::State& state) {
  const int nodes = static_cast<int>(state.range(0));
  const auto concurrency = static_cast<uint32_t>(state.range(1));
  const auto max_new = static_cast<uint32_t>(state.range(2));
  const auto mode = static_cast<scheduler_mode>(state.range(3));
  state.SetLabel(std::to_string(nodes) + (nodes == 1 ? " node" : " nodes") + ", waves of " +
                 std::to_string(concurrency) + ", max_new_tokens " + std::to_string(max_new) +
                 ", " + mode_name(mode));
  live_cluster cluster(nodes, mode);
  if (!cluster.ready(std::chrono::seconds(10))) {
    state.SkipWithError("the cluster did not become ready within 10 s");
    return;
  }
  for (int i = 0; i < 4; ++i) {
    if (cluster.wave(concurrency, max_new) != concurrency) {
      state.SkipWithError("a warm-up request did not finish as asked");
      return;
    }
  }
  uint64_t requests = 0;
  double process_cpu = 0, client_cpu = 0, wall = 0;
  for (auto _ : state) {
    const double p0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID),
                 t0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    const auto w0 = clock_type::now();
    const uint32_t ok = cluster.wave(concurrency, max_new);
    const double w = std::chrono::duration<double>(clock_type::now() - w0).count();
    client_cpu += cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - t0;
    process_cpu += cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - p0;
    if (ok != concurrency) {
      state.SkipWithError("a request did not finish with max_new_tokens tokens");
      return;
    }
    state.SetIterationTime(w);
    wall += w;
    requests += concurrency;
  }
  state.SetItemsProcessed(static_cast<int64_t>(requests));
  if (requests > 0) {
    const double n = static_cast<double>(requests);
    state.counters["cpu_us_per_request"] = process_cpu * 1e6 / n;
    state.counters["node_cpu_us_per_request"] = (process_cpu - client_cpu) * 1e6 / n;
    state.counters["client_cpu_us_per_request"] = client_cpu * 1e6 / n;
    state.counters["wall_us_per_request"] = wall * 1e6 / n;
  }
}

/// What an idle node costs: process CPU over 100 ms with no request (timers, load reports,
/// the CAF scheduler's polling), as a share of one core. Arg: scheduler mode.
void BM_live_node_idle(benchmark::State& state) {
  const auto mode = static_cast<scheduler_mode>(state.range(0));
  state.SetLabel(mode_name(mode));
  live_cluster cluster(1, mode);
  if (!cluster.ready(std::chrono::seconds(10))) {
    state.SkipWithError("the cluster did not become ready within 10 s");
    return;
  }
  double cpu = 0, wall = 0;
  for (auto _ : state) {
    const double p0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
    const auto w0 = clock_type::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const double w = std::chrono::duration<double>(clock_type::now() - w0).count();
    cpu += cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - p0;
    state.SetIterationTime(w);
    wall += w;
  }
  if (wall > 0) state.counters["idle_cpu_percent"] = 100.0 * cpu / wall;
}

}  // namespace

BENCHMARK(BM_cores_one_thread)
    ->Args({1, 1})
    ->Args({1, 2})
    ->Args({64, 2})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_live_nodes)
    ->Args({1, 1, 1, 0})
    ->Args({1, 1, 2, 0})
    ->Args({1, 64, 2, 0})
    ->Args({2, 1, 2, 0})
    ->Args({2, 64, 2, 0})
    ->Args({1, 1, 2, 1})
    ->Args({1, 64, 2, 1})
    ->Args({2, 64, 2, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_live_node_idle)
    ->Arg(0)
    ->Arg(1)
    ->Iterations(10)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
