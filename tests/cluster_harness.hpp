#pragma once
// A single-thread, in-memory duet cluster: one router, one KV-handle broker, N prefill and M
// decode workers over engines (sim engines with time_scale 0 by default), wired by pumping
// their outboxes. Every message is encoded by the sending core, decoded by its envelope and
// dispatched to the destination core's handler with the same mapping as actors/roles.cpp,
// so the cores see exactly what they would see over ZeroMQ.
//
// The clock is a number the caller advances (timers fire at their periods, as the actors'
// tick/report/reclaim timers do); engine steps run explicitly; the network can drop or
// delay messages matching a rule (fault injection), and a worker can be taken down as if its
// process died; every address that is not one of the
// cluster's actors is a client (as in the transport) and records every admitted, rejected,
// token_batch and finish message it receives, per request.
//
// Header-only and free of any test framework, so tests and a simulator can both use it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "messages/codec.hpp"
#include "messages/dispatch.hpp"
#include "runtime/broker_core.hpp"
#include "runtime/decode_core.hpp"
#include "runtime/engine.hpp"
#include "runtime/model_shape.hpp"
#include "runtime/outbox.hpp"
#include "runtime/prefill_core.hpp"
#include "runtime/router_core.hpp"
#include "runtime/sim_engine.hpp"

namespace duet::testing {

// ------------------------------------------------------------------ reading outboxes

/// One decoded message of type M that a core queued.
template <class M>
struct sent {
  std::string dst;
  msg::envelope env;
  M body;
};

/// The type id of a queued message; throws when the envelope does not decode.
[[nodiscard]] inline msg::type_id type_of(const outgoing& item) {
  auto env = msg::decode_envelope(item.frames);
  if (!env) throw std::runtime_error("undecodable envelope: " + env.error());
  return static_cast<msg::type_id>(env->type);
}

/// The messages of type M among `items`, decoded, in order. Throws on frames the codec
/// refuses: a core produced something its peers could not read.
template <class M>
[[nodiscard]] std::vector<sent<M>> messages_of(const std::vector<outgoing>& items) {
  std::vector<sent<M>> out;
  for (const auto& item : items) {
    auto env = msg::decode_envelope(item.frames);
    if (!env) throw std::runtime_error("undecodable envelope: " + env.error());
    if (env->type != static_cast<uint16_t>(M::id)) continue;
    auto body = msg::decode_body<M>(item.frames);
    if (!body) throw std::runtime_error("undecodable body: " + body.error());
    out.push_back({item.dst, std::move(*env), std::move(*body)});
  }
  return out;
}

template <class M>
[[nodiscard]] std::size_t count_of(const std::vector<outgoing>& items) {
  return messages_of<M>(items).size();
}

// ------------------------------------------------------------------ fault injection

/// What the network does with one message.
struct fault_action {
  enum class kind : uint8_t { deliver, drop, delay };
  kind what = kind::deliver;
  int64_t delay_ms = 0;

  [[nodiscard]] static fault_action deliver() { return {}; }
  [[nodiscard]] static fault_action drop() { return {kind::drop, 0}; }
  [[nodiscard]] static fault_action delay(int64_t ms) { return {kind::delay, ms}; }
};

/// Decides the fate of a message as it enters the network. Rules run in the order they were
/// added; the first that does not answer `deliver` decides.
using fault_rule = std::function<fault_action(const msg::envelope& env, const msg::frames& frames)>;
using message_predicate = std::function<bool(const msg::envelope& env, const msg::frames& frames)>;

/// Matches messages of type M.
template <class M>
[[nodiscard]] message_predicate is_a() {
  return [](const msg::envelope& env, const msg::frames&) { return env.type == static_cast<uint16_t>(M::id); };
}

/// Drops the messages `match` accepts, at most `limit` of them.
[[nodiscard]] inline fault_rule drop_if(message_predicate match, uint64_t limit = UINT64_MAX) {
  auto left = std::make_shared<uint64_t>(limit);
  return [match = std::move(match), left](const msg::envelope& env, const msg::frames& frames) {
    if (*left == 0 || !match(env, frames)) return fault_action::deliver();
    --*left;
    return fault_action::drop();
  };
}

/// Delays the messages `match` accepts by `ms`, at most `limit` of them.
[[nodiscard]] inline fault_rule delay_if(message_predicate match, int64_t ms, uint64_t limit = UINT64_MAX) {
  auto left = std::make_shared<uint64_t>(limit);
  return [match = std::move(match), ms, left](const msg::envelope& env, const msg::frames& frames) {
    if (*left == 0 || !match(env, frames)) return fault_action::deliver();
    --*left;
    return fault_action::delay(ms);
  };
}

// ------------------------------------------------------------------ the client side

/// Everything one request id received at one client address.
struct request_log {
  std::vector<msg::admitted> admitted;
  std::vector<msg::rejected> rejected;
  std::vector<msg::finish> finishes;
  std::vector<int32_t> tokens;      // in arrival order
  std::vector<uint32_t> positions;  // output position of each token
  uint32_t token_batches = 0;       // token_batch messages that carried this request

  /// Final answers: finish or rejected. Exactly one per submitted request.
  [[nodiscard]] std::size_t finals() const { return finishes.size() + rejected.size(); }
};

struct client_log {
  std::map<uint64_t, request_log> requests;
  uint64_t token_batch_messages = 0;
  std::vector<msg::error> errors;  // refusals of malformed messages
};

// ------------------------------------------------------------------ an engine with KV bytes

/// A sim engine whose pool really holds KV: each token's slot stores the token id. A decode
/// step first checks that the slots of the whole history hold that history, and answers a
/// wrong token when they do not, so a lost, reordered or corrupted transfer shows up in the
/// tokens a client receives, exactly as it would with a real model. Engines given the same
/// `slots` and seats of one shared_kv_pool share one pool, as workers of one process on one
/// device do (handovers between them take the same_pool path).
class kv_tracking_engine final : public engine {
 public:
  explicit kv_tracking_engine(std::unique_ptr<engine> inner, kv_pool_seat seat = {},
                              std::shared_ptr<std::vector<int32_t>> slots = nullptr)
      : inner_(std::move(inner)),
        info_(inner_->info()),
        seat_(std::move(seat)),
        pool_(slots ? std::move(slots) : std::make_shared<std::vector<int32_t>>()) {
    info_.engine = "kv-tracking";
    info_.block_bytes = uint64_t{info_.block_tokens} * sizeof(int32_t);
  }
  [[nodiscard]] const engine_info& info() const override { return info_; }
  [[nodiscard]] kv_pool_seat pool_seat() const override { return seat_; }

  [[nodiscard]] step_output prefill(std::span<const prefill_chunk> chunks) override {
    for (const auto& c : chunks) {
      for (std::size_t i = 0; i < c.tokens.size(); ++i) slot(c.blocks, c.start + uint32_t(i)) = c.tokens[i];
    }
    return inner_->prefill(chunks);
  }
  [[nodiscard]] step_output decode(std::span<const decode_slot> slots) override {
    std::vector<bool> intact(slots.size(), true);
    for (std::size_t k = 0; k < slots.size(); ++k) {
      const auto& h = slots[k].history;
      for (std::size_t p = 0; p + 1 < h.size(); ++p) {
        if (slot(slots[k].blocks, uint32_t(p)) != h[p]) {
          intact[k] = false;
          ++corrupt_reads_;
          break;
        }
      }
      slot(slots[k].blocks, uint32_t(h.size() - 1)) = h.back();
    }
    auto out = inner_->decode(slots);
    for (std::size_t k = 0; k < slots.size(); ++k) {
      if (!intact[k]) out.tokens[k] = (out.tokens[k] + 1) % int32_t(info_.vocab_size);
    }
    return out;
  }
  void release(uint64_t seq_id) override { inner_->release(seq_id); }
  bool read_blocks(std::span<const uint32_t> blocks, std::span<std::byte> out) const override {
    if (out.size() != blocks.size() * info_.block_bytes) return false;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const std::size_t at = std::size_t{blocks[i]} * info_.block_tokens;
      if (at + info_.block_tokens > pool_->size()) return false;  // never written: not KV of ours
      std::memcpy(out.data() + i * info_.block_bytes, pool_->data() + at, info_.block_bytes);
    }
    return true;
  }
  bool write_blocks(std::span<const uint32_t> blocks, std::span<const std::byte> in) override {
    if (in.size() != blocks.size() * info_.block_bytes) return false;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      grow(blocks[i]);
      std::memcpy(pool_->data() + std::size_t{blocks[i]} * info_.block_tokens, in.data() + i * info_.block_bytes,
                  info_.block_bytes);
    }
    return true;
  }
  [[nodiscard]] uint64_t corrupt_reads() const { return corrupt_reads_; }

 private:
  void grow(uint32_t block) {
    const std::size_t need = (std::size_t{block} + 1) * info_.block_tokens;
    if (pool_->size() < need) pool_->resize(need, -1);
  }
  int32_t& slot(std::span<const uint32_t> blocks, uint32_t position) {
    const uint32_t block = blocks[position / info_.block_tokens];
    grow(block);
    return (*pool_)[std::size_t{block} * info_.block_tokens + position % info_.block_tokens];
  }

  std::unique_ptr<engine> inner_;
  engine_info info_;
  kv_pool_seat seat_;
  std::shared_ptr<std::vector<int32_t>> pool_;
  uint64_t corrupt_reads_ = 0;
};

// ------------------------------------------------------------------ the cluster

struct cluster_options {
  uint32_t prefill_workers = 1;
  uint32_t decode_workers = 1;
  std::string node = "n0";
  std::string model = "tiny";  // runtime/model_shape.hpp preset of the sim engines
  std::string gpu = "h200";
  uint32_t max_context = 4096;
  uint32_t block_tokens = 16;
  /// Settings of each core. Addresses (broker, router, worker lists) and router.max_context
  /// are filled in by the cluster.
  router_settings router;
  prefill_settings prefill;
  decode_settings decode;
  broker_settings broker;
  /// Builds a worker's engine instead of a sim engine (is_prefill, index). Every engine of
  /// one cluster must agree on the KV layout, as real workers must.
  std::function<std::unique_ptr<engine>(bool is_prefill, std::size_t index)> make_engine;

  int64_t start_ms = 1'700'000'000'000;  // unix ms
  uint32_t tick_ms = 20;                 // router, prefill and decode timers (actor_timing.tick)
  uint32_t report_ms = 100;              // load reports (actor_timing.report)
  uint32_t reclaim_ms = 250;             // the broker's sweep (broker.reclaim_interval_ms)
  /// Engine steps each worker may run per tick period; 0 runs every worker until it has
  /// no work at each instant. A small number makes sequences live across ticks, so cancels,
  /// deadlines and memory waits meet them in every state.
  uint32_t steps_per_tick = 0;
  /// settle() gives up (throws) after this many rounds without reaching quiescence.
  std::size_t max_settle_rounds = 10'000'000;
};

/// Counters of the in-memory network.
struct network_stats {
  uint64_t sent = 0;        // entered the network
  uint64_t delivered = 0;
  uint64_t dropped = 0;     // by a fault rule
  uint64_t delayed = 0;     // by a fault rule
  uint64_t unroutable = 0;  // destination is not an address ("node/actor")
  uint64_t malformed = 0;   // refused by the codec at the receiver
  uint64_t unhandled = 0;   // a type the destination does not take
  uint64_t lost_down = 0;   // to or from a worker that is down
  std::map<msg::type_id, uint64_t> delivered_by_type;
  std::map<msg::type_id, uint64_t> dropped_by_type;
};

class cluster {
 public:
  static constexpr std::string_view default_client = "client-0/client";

  explicit cluster(cluster_options options = {}) : options_(std::move(options)), now_(options_.start_ms) {
    const std::string& node = options_.node;
    router_address_ = node + "/router";
    broker_address_ = node + "/broker";
    std::vector<std::string> prefill_names, decode_names;
    for (uint32_t i = 0; i < options_.prefill_workers; ++i) prefill_names.push_back(node + "/prefill" + std::to_string(i));
    for (uint32_t i = 0; i < options_.decode_workers; ++i) decode_names.push_back(node + "/decode" + std::to_string(i));

    router_settings rs = options_.router;
    rs.broker = broker_address_;
    rs.prefill_workers = prefill_names;
    rs.decode_workers = decode_names;
    rs.max_context = options_.max_context;  // as actors/roles.cpp: the model's context
    router_ = std::make_unique<router_core>(router_address_, rs, [](const std::string& text) {
      std::vector<int32_t> out;  // as actors/roles.cpp: one token per UTF-8 byte
      for (unsigned char c : text) out.push_back(c);
      return out;
    });
    routes_[router_address_] = {role::router, 0};
    broker_ = std::make_unique<broker_core>(broker_address_, options_.broker);
    routes_[broker_address_] = {role::broker, 0};

    for (std::size_t i = 0; i < prefill_names.size(); ++i) {
      prefill_settings ps = options_.prefill;
      ps.router = router_address_;
      ps.broker = broker_address_;
      prefill_engines_.push_back(build_engine(true, i));
      prefills_.push_back(std::make_unique<prefill_core>(prefill_names[i], ps, *prefill_engines_.back()));
      routes_[prefill_names[i]] = {role::prefill, i};
    }
    for (std::size_t i = 0; i < decode_names.size(); ++i) {
      decode_settings ds = options_.decode;
      ds.router = router_address_;
      ds.broker = broker_address_;
      decode_engines_.push_back(build_engine(false, i));
      decodes_.push_back(std::make_unique<decode_core>(decode_names[i], ds, *decode_engines_.back()));
      routes_[decode_names[i]] = {role::decode, i};
    }
    prefill_budget_.assign(prefills_.size(), 0);
    decode_budget_.assign(decodes_.size(), 0);
    reset_budgets();
    next_tick_ = now_ + options_.tick_ms;
    next_report_ = now_ + options_.report_ms;
    next_reclaim_ = now_ + options_.reclaim_ms;
    // Workers report their load when they start, as the actors do.
    report_load();
    settle();
  }

  cluster(const cluster&) = delete;
  cluster& operator=(const cluster&) = delete;

  // ---------------------------------------------------------------- addresses and cores

  [[nodiscard]] const std::string& router_address() const { return router_address_; }
  [[nodiscard]] const std::string& broker_address() const { return broker_address_; }
  [[nodiscard]] const std::string& prefill_address(std::size_t i) const { return prefills_.at(i)->out().self(); }
  [[nodiscard]] const std::string& decode_address(std::size_t i) const { return decodes_.at(i)->out().self(); }

  [[nodiscard]] router_core& router() { return *router_; }
  [[nodiscard]] broker_core& broker() { return *broker_; }
  [[nodiscard]] prefill_core& prefill(std::size_t i = 0) { return *prefills_.at(i); }
  [[nodiscard]] decode_core& decode(std::size_t i = 0) { return *decodes_.at(i); }
  [[nodiscard]] engine& prefill_engine(std::size_t i = 0) { return *prefill_engines_.at(i); }
  [[nodiscard]] engine& decode_engine(std::size_t i = 0) { return *decode_engines_.at(i); }
  [[nodiscard]] std::size_t prefill_count() const { return prefills_.size(); }
  [[nodiscard]] std::size_t decode_count() const { return decodes_.size(); }
  [[nodiscard]] const cluster_options& options() const { return options_; }
  /// Whether `address` is one of the cluster's actors (anything else is a client).
  [[nodiscard]] bool is_core(const std::string& address) const { return routes_.contains(address); }

  // ---------------------------------------------------------------- the client side

  /// Queues a submit from `client` (not delivered until settle() or advance()).
  void submit(const msg::submit& m, int64_t deadline_ms = 0, std::string_view client = default_client) {
    send_from(std::string(client), router_address_, m, deadline_ms);
  }
  void submit(uint64_t request_id, std::vector<int32_t> prompt, msg::sampling_params sampling = {},
              int64_t deadline_ms = 0, std::string_view client = default_client) {
    msg::submit m;
    m.request_id = request_id;
    m.prompt_tokens = std::move(prompt);
    m.sampling = std::move(sampling);
    submit(m, deadline_ms, client);
  }
  void cancel(uint64_t request_id, std::string_view client = default_client) {
    send_from(std::string(client), router_address_, msg::cancel{request_id});
  }
  /// Queues any message as if `src` had sent it.
  template <class M>
  void send_from(const std::string& src, const std::string& dst, const M& m, int64_t deadline_ms = 0) {
    outbox box(src);
    box.send(dst, m, deadline_ms);
    for (auto& item : box.take()) enqueue(std::move(item));
  }

  /// What a client address received; empty when it received nothing.
  [[nodiscard]] const client_log& client(std::string_view address = default_client) const {
    static const client_log none;
    auto it = clients_.find(std::string(address));
    return it == clients_.end() ? none : it->second;
  }
  [[nodiscard]] const request_log& request(uint64_t request_id, std::string_view address = default_client) const {
    static const request_log none;
    const auto& log = client(address);
    auto it = log.requests.find(request_id);
    return it == log.requests.end() ? none : it->second;
  }
  [[nodiscard]] const std::map<std::string, client_log>& clients() const { return clients_; }

  // ---------------------------------------------------------------- the network

  void add_fault(fault_rule rule) { faults_.push_back(std::move(rule)); }
  void clear_faults() { faults_.clear(); }
  /// Called for every message at delivery, before its handler runs.
  void set_trace(std::function<void(int64_t now_ms, const msg::envelope&, const msg::frames&)> trace) {
    trace_ = std::move(trace);
  }
  [[nodiscard]] const network_stats& network() const { return stats_; }

  /// The worker at `address` dies: from now on it receives nothing, sends nothing (what it
  /// had queued is lost), runs no step or timer and reports no load. Its pool is left out of
  /// pools_full() and idle(), as a dead process's memory is.
  void take_down(const std::string& address) {
    auto it = routes_.find(address);
    if (it == routes_.end() || it->second.kind == role::router || it->second.kind == role::broker) {
      throw std::invalid_argument("cluster: only a prefill or decode worker can be taken down: " + address);
    }
    down_.insert(address);
  }
  [[nodiscard]] bool is_down(const std::string& address) const { return down_.contains(address); }
  /// Messages sent and not yet delivered (delayed ones included).
  [[nodiscard]] std::size_t in_network() const { return ready_.size() + delayed_.size(); }

  // ---------------------------------------------------------------- time and steps

  [[nodiscard]] int64_t now() const { return now_; }

  /// Moves the clock forward by `ms`, firing every timer and delayed message at its instant
  /// and settling the cluster after each.
  void advance(int64_t ms) { advance_to(now_ + ms); }
  void advance_to(int64_t target_ms) {
    settle();
    while (now_ < target_ms) {
      int64_t next = std::min({target_ms, next_tick_, next_report_, next_reclaim_});
      if (!delayed_.empty()) next = std::min(next, delayed_.begin()->first.first);
      now_ = std::max(now_, next);
      if (now_ >= next_reclaim_) {
        broker_->reclaim(now_);
        flush(broker_->out());
        next_reclaim_ += options_.reclaim_ms;
      }
      if (now_ >= next_tick_) {
        tick_all();
        next_tick_ += options_.tick_ms;
      }
      if (now_ >= next_report_) {
        report_load();
        next_report_ += options_.report_ms;
      }
      settle();
    }
  }

  /// Runs every core's timer handler once at the current instant (and refills step budgets).
  void tick_all() {
    for (auto& p : prefills_) {
      if (is_down(p->out().self())) continue;
      p->tick(now_);
      flush(p->out());
    }
    for (auto& d : decodes_) {
      if (is_down(d->out().self())) continue;
      d->tick(now_);
      flush(d->out());
    }
    router_->tick(now_);
    flush(router_->out());
    reset_budgets();
  }

  /// Every worker sends its load report to the router now.
  void report_load() {
    for (auto& p : prefills_) {
      if (!is_down(p->out().self())) p->out().send(router_address_, p->load());
    }
    for (auto& d : decodes_) {
      if (!is_down(d->out().self())) d->out().send(router_address_, d->load());
    }
    for (auto& p : prefills_) flush(p->out());
    for (auto& d : decodes_) flush(d->out());
  }

  /// Delivers messages and runs engine steps until nothing moves at this instant. Each round
  /// begins a step on every idle worker that has work, delivers the messages already in the
  /// network (so they meet those steps in flight, as in the actors), then finishes the steps.
  void settle() {
    for (std::size_t round = 0;; ++round) {
      if (round >= options_.max_settle_rounds) throw std::runtime_error("the cluster did not settle");
      flush_all();
      release_due();
      std::vector<std::size_t> prefill_started, decode_started;
      for (std::size_t i = 0; i < prefills_.size(); ++i) {
        if (!has_budget(prefill_budget_[i]) || is_down(prefills_[i]->out().self())) continue;
        if (prefills_[i]->begin_step(now_)) {
          prefill_started.push_back(i);
          --prefill_budget_[i];
        }
      }
      for (std::size_t i = 0; i < decodes_.size(); ++i) {
        if (!has_budget(decode_budget_[i]) || is_down(decodes_[i]->out().self())) continue;
        if (decodes_[i]->begin_step(now_)) {
          decode_started.push_back(i);
          --decode_budget_[i];
        }
      }
      const std::size_t deliveries = ready_.size();
      for (std::size_t n = 0; n < deliveries; ++n) {
        auto item = std::move(ready_.front());
        ready_.pop_front();
        deliver(item);
      }
      for (std::size_t i : prefill_started) {
        prefills_[i]->finish_step(now_);
        flush(prefills_[i]->out());
      }
      for (std::size_t i : decode_started) {
        decodes_[i]->finish_step(now_);
        flush(decodes_[i]->out());
      }
      steps_ += prefill_started.size() + decode_started.size();
      if (prefill_started.empty() && decode_started.empty() && deliveries == 0) return;
    }
  }

  /// Engine steps run since the cluster started.
  [[nodiscard]] uint64_t steps() const { return steps_; }

  /// Advances tick by tick until idle() or `limit_ms` passed; returns idle().
  bool run_until_idle(int64_t limit_ms) {
    const int64_t end = now_ + limit_ms;
    settle();
    while (!idle() && now_ < end) advance(std::min<int64_t>(options_.tick_ms, end - now_));
    return idle();
  }

  // ---------------------------------------------------------------- invariants

  /// Every KV pool of a live worker is back to full.
  [[nodiscard]] bool pools_full() const {
    for (const auto& p : prefills_) {
      if (!is_down(p->out().self()) && p->pool().free_blocks() != p->pool().total_blocks()) return false;
    }
    for (const auto& d : decodes_) {
      if (!is_down(d->out().self()) && d->pool().free_blocks() != d->pool().total_blocks()) return false;
    }
    return true;
  }
  /// Double frees (or frees of foreign blocks) over every pool: always 0 when accounting holds.
  [[nodiscard]] uint64_t double_frees() const {
    uint64_t n = 0;
    for (const auto& p : prefills_) n += p->pool().double_frees();
    for (const auto& d : decodes_) n += d->pool().double_frees();
    return n;
  }
  /// Nothing in flight anywhere (workers that are down aside): no message, no request, no
  /// handle, no sequence, no block.
  [[nodiscard]] bool idle() const {
    if (in_network() != 0 || router_->in_flight() != 0 || broker_->live_handles() != 0 || !pools_full()) return false;
    for (const auto& p : prefills_) {
      const auto l = p->load();
      if (!is_down(l.actor) && (l.queued != 0 || l.running != 0)) return false;
    }
    for (const auto& d : decodes_) {
      const auto l = d->load();
      if (!is_down(l.actor) && (l.queued != 0 || l.running != 0)) return false;
    }
    return true;
  }

 private:
  enum class role : uint8_t { router, broker, prefill, decode };
  struct route {
    role kind = role::router;
    std::size_t index = 0;
  };
  struct queued {
    msg::envelope env;
    outgoing item;
  };

  std::unique_ptr<engine> build_engine(bool is_prefill, std::size_t index) {
    if (options_.make_engine) return options_.make_engine(is_prefill, index);
    auto shape = find_model_shape(options_.model);
    auto gpu = find_gpu_spec(options_.gpu);
    if (!shape) throw std::invalid_argument("cluster: unknown model preset " + options_.model);
    if (!gpu) throw std::invalid_argument("cluster: unknown gpu " + options_.gpu);
    return std::make_unique<sim_engine>(*shape, *gpu, options_.model, options_.max_context, options_.block_tokens,
                                        1.0, 0.0);
  }

  [[nodiscard]] bool has_budget(uint32_t budget) const { return options_.steps_per_tick == 0 || budget > 0; }
  void reset_budgets() {
    std::fill(prefill_budget_.begin(), prefill_budget_.end(), options_.steps_per_tick);
    std::fill(decode_budget_.begin(), decode_budget_.end(), options_.steps_per_tick);
  }

  void enqueue(outgoing item) {
    auto env = msg::decode_envelope(item.frames);
    ++stats_.sent;
    if (!env) {
      ++stats_.malformed;
      return;
    }
    if (is_down(env->src)) {
      ++stats_.lost_down;
      return;
    }
    for (const auto& rule : faults_) {
      const fault_action action = rule(*env, item.frames);
      if (action.what == fault_action::kind::drop) {
        ++stats_.dropped;
        ++stats_.dropped_by_type[static_cast<msg::type_id>(env->type)];
        return;
      }
      if (action.what == fault_action::kind::delay) {
        ++stats_.delayed;
        delayed_.emplace(std::make_pair(now_ + action.delay_ms, sequence_++), queued{std::move(*env), std::move(item)});
        return;
      }
    }
    ready_.push_back({std::move(*env), std::move(item)});
  }

  void flush(outbox& box) {
    for (auto& item : box.take()) enqueue(std::move(item));
  }
  void flush_all() {
    flush(router_->out());
    flush(broker_->out());
    for (auto& p : prefills_) flush(p->out());
    for (auto& d : decodes_) flush(d->out());
  }
  void release_due() {
    while (!delayed_.empty() && delayed_.begin()->first.first <= now_) {
      ready_.push_back(std::move(delayed_.begin()->second));
      delayed_.erase(delayed_.begin());
    }
  }

  void deliver(queued& q) {
    const msg::envelope& env = q.env;
    const msg::frames& frames = q.item.frames;
    ++stats_.delivered;
    ++stats_.delivered_by_type[static_cast<msg::type_id>(env.type)];
    if (trace_) trace_(now_, env, frames);
    if (is_down(q.item.dst)) {
      ++stats_.lost_down;
      return;
    }
    auto it = routes_.find(q.item.dst);
    if (it == routes_.end()) {
      if (msg::parse_address(q.item.dst).empty()) {
        ++stats_.unroutable;
      } else {
        record_client(q.item.dst, env, frames);
      }
      return;
    }
    const int64_t now = now_;
    bool handled = true;
    msg::dispatch_outcome outcome;
    switch (it->second.kind) {
      case role::router: {
        auto& core = *router_;
        outcome = msg::dispatch(env, frames, [&](const msg::envelope& e, auto& m) {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, msg::submit>) core.on_submit(e, m, now);
          else if constexpr (std::is_same_v<M, msg::cancel>) core.on_cancel(e, m);
          else if constexpr (std::is_same_v<M, msg::prefill_done>) core.on_prefill_done(m, now);
          else if constexpr (std::is_same_v<M, msg::stage_failed>) core.on_stage_failed(e.src, m);
          else if constexpr (std::is_same_v<M, msg::request_done>) core.on_request_done(m);
          else if constexpr (std::is_same_v<M, msg::load_report>) core.on_load(e.src, m, now);
          else handled = false;
        });
        flush(core.out());
        break;
      }
      case role::broker: {
        auto& core = *broker_;
        outcome = msg::dispatch(env, frames, [&](const msg::envelope& e, auto& m) {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, msg::kv_register>) core.on_register(e.src, m, now);
          else if constexpr (std::is_same_v<M, msg::kv_pull>) core.on_pull(e.src, m, now);
          else if constexpr (std::is_same_v<M, msg::kv_confirm>) core.on_confirm(e.src, m);
          else if constexpr (std::is_same_v<M, msg::kv_nack>) core.on_nack(e.src, m);
          else if constexpr (std::is_same_v<M, msg::kv_drop>) core.on_drop(e.src, m);
          else if constexpr (std::is_same_v<M, msg::kv_renew>) core.on_renew(e.src, m, now);
          else handled = false;
        });
        flush(core.out());
        break;
      }
      case role::prefill: {
        auto& core = *prefills_[it->second.index];
        outcome = msg::dispatch(env, frames, [&](const msg::envelope& e, auto& m) {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, msg::prefill_request>) core.on_request(e, m, now);
          else if constexpr (std::is_same_v<M, msg::cancel_seq>) core.on_cancel(m);
          else if constexpr (std::is_same_v<M, msg::kv_registered>) core.on_registered(m, now);
          else if constexpr (std::is_same_v<M, msg::kv_release>) core.on_release(m);
          else if constexpr (std::is_same_v<M, msg::kv_send>) core.on_kv_send(e.src, m);
          else if constexpr (std::is_same_v<M, msg::kv_chunk_ack>) core.on_chunk_ack(e.src, m);
          else handled = false;
        });
        flush(core.out());
        break;
      }
      case role::decode: {
        auto& core = *decodes_[it->second.index];
        outcome = msg::dispatch(env, frames, [&](const msg::envelope& e, auto& m) {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, msg::kv_adopt>) core.on_adopt(e, m, now);
          else if constexpr (std::is_same_v<M, msg::kv_moved>) core.on_moved(m, now);
          else if constexpr (std::is_same_v<M, msg::kv_chunk>) core.on_chunk(e, m, now);
          else if constexpr (std::is_same_v<M, msg::cancel_seq>) core.on_cancel(m);
          else handled = false;
        });
        flush(core.out());
        break;
      }
    }
    if (outcome.status == msg::dispatch_status::malformed) ++stats_.malformed;
    else if (outcome.status == msg::dispatch_status::unhandled || !handled) ++stats_.unhandled;
  }

  void record_client(const std::string& address, const msg::envelope& env, const msg::frames& frames) {
    client_log& log = clients_[address];
    auto outcome = msg::dispatch(env, frames, [&](const msg::envelope&, auto& m) {
      using M = std::decay_t<decltype(m)>;
      if constexpr (std::is_same_v<M, msg::admitted>) {
        log.requests[m.request_id].admitted.push_back(m);
      } else if constexpr (std::is_same_v<M, msg::rejected>) {
        log.requests[m.request_id].rejected.push_back(m);
      } else if constexpr (std::is_same_v<M, msg::finish>) {
        log.requests[m.request_id].finishes.push_back(m);
      } else if constexpr (std::is_same_v<M, msg::token_batch>) {
        ++log.token_batch_messages;
        std::map<uint64_t, bool> seen;
        for (std::size_t i = 0; i < m.request_ids.size(); ++i) {
          request_log& r = log.requests[m.request_ids[i]];
          r.tokens.push_back(i < m.tokens.size() ? m.tokens[i] : -1);
          r.positions.push_back(i < m.positions.size() ? m.positions[i] : UINT32_MAX);
          if (!seen[m.request_ids[i]]) {
            seen[m.request_ids[i]] = true;
            ++r.token_batches;
          }
        }
      } else if constexpr (std::is_same_v<M, msg::error>) {
        log.errors.push_back(m);
      } else {
        ++stats_.unhandled;
      }
    });
    if (outcome.status == msg::dispatch_status::malformed) ++stats_.malformed;
  }

  cluster_options options_;
  int64_t now_;
  int64_t next_tick_ = 0;
  int64_t next_report_ = 0;
  int64_t next_reclaim_ = 0;
  std::string router_address_;
  std::string broker_address_;
  std::unique_ptr<router_core> router_;
  std::unique_ptr<broker_core> broker_;
  std::vector<std::unique_ptr<engine>> prefill_engines_;
  std::vector<std::unique_ptr<engine>> decode_engines_;
  std::vector<std::unique_ptr<prefill_core>> prefills_;
  std::vector<std::unique_ptr<decode_core>> decodes_;
  std::vector<uint32_t> prefill_budget_;
  std::vector<uint32_t> decode_budget_;
  std::map<std::string, route> routes_;
  std::deque<queued> ready_;
  std::map<std::pair<int64_t, uint64_t>, queued> delayed_;  // (deliver at, send order)
  uint64_t sequence_ = 0;
  std::vector<fault_rule> faults_;
  std::set<std::string> down_;
  std::function<void(int64_t, const msg::envelope&, const msg::frames&)> trace_;
  std::map<std::string, client_log> clients_;
  network_stats stats_;
  uint64_t steps_ = 0;
};

}  // namespace duet::testing
