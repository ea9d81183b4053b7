#include "actors/roles.hpp"

#include <algorithm>
#include <cstdio>
#include <mutex>

#include "messages/dispatch.hpp"
#include "runtime/http_api.hpp"
#include "runtime/clock.hpp"

namespace duet {

deployment_addresses addresses_of(const deployment_config& config) {
  deployment_addresses out;
  for (const auto& node : config.nodes) {
    for (const auto& a : node.actors) {
      const std::string address = node.name + "/" + a.name;
      switch (a.role) {
        case actor_role::router: out.router = address; break;
        case actor_role::broker: out.broker = address; break;
        case actor_role::prefill: out.prefill.push_back(address); break;
        case actor_role::decode: out.decode.push_back(address); break;
      }
    }
  }
  return out;
}

namespace {

// A frame that failed to decode is answered, so its sender never waits on it to time out.
void refuse_if_malformed(outbox& box, const inbound& in, const msg::dispatch_outcome& outcome) {
  if (outcome.status == msg::dispatch_status::malformed) {
    box.send(in.env.src, msg::error{msg::error_code::bad_request, outcome.error, in.env.correlation});
  }
}

void reply_stats(transport& net, outbox& box, const msg::envelope& env, std::string role, uint32_t free_blocks,
                 uint32_t total_blocks, std::map<std::string, uint64_t> counters) {
  msg::stats_reply reply;
  reply.actor = box.self();
  reply.role = std::move(role);
  reply.free_blocks = free_blocks;
  reply.total_blocks = total_blocks;
  reply.counters = std::move(counters);
  const auto& c = net.counters();
  reply.counters["transport_malformed"] = c.malformed;
  reply.counters["transport_received"] = c.received;
  reply.counters["transport_unroutable"] = c.unroutable;
  reply.counters["transport_refused_incompatible"] = c.refused_incompatible;
  reply.counters["transport_incompatible_hellos"] = c.incompatible_hellos;
  reply.counters["transport_dropped"] = c.dropped_queue_full + c.dropped_peer_busy;
  reply.counters["transport_fault_dropped"] = c.fault_dropped;
  reply.counters["transport_fault_delayed"] = c.fault_delayed;
  box.send(env.src, reply);
}

/// The sim engine has no tokenizer: a text prompt becomes one token per UTF-8 byte.
std::vector<int32_t> byte_tokens(const std::string& text) {
  std::vector<int32_t> out;
  out.reserve(text.size());
  for (unsigned char c : text) out.push_back(c);
  return out;
}

/// How the router turns a text prompt into token ids: the model's tokenizer (with its bos),
/// or one token per byte for the sim engine. A model whose tokenizer cannot be loaded takes
/// token ids only: text prompts become empty and are refused as bad requests.
router_core::text_encoder prompt_encoder(const deployment_config& cfg) {
  if (cfg.engine.kind == "sim") return byte_tokens;
  try {
    auto codec = make_text_codec(cfg);
    return [codec](const std::string& text) { return codec->encode(text, true); };
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet: router: text prompts are refused (send prompt token ids): %s\n", e.what());
    return [](const std::string&) { return std::vector<int32_t>{}; };
  }
}

// ------------------------------------------------------------------ router

struct router_state {
  std::unique_ptr<router_core> core;
  actor_context context;
  static inline const char* name = "duet.router";
};

duet_actor::behavior_type router_behavior(duet_actor::stateful_pointer<router_state> self, actor_context context) {
  const auto& cfg = *context.config;
  const auto addrs = addresses_of(cfg);
  router_settings settings;
  settings.broker = addrs.broker;
  settings.prefill_workers = addrs.prefill;
  settings.decode_workers = addrs.decode;
  settings.policy = cfg.router.policy;
  settings.queue_limit = cfg.router.queue_limit;
  settings.request_timeout_ms = cfg.router.request_timeout_ms;
  settings.max_context = cfg.model.max_context;
  settings.max_new_tokens_limit = cfg.router.max_new_tokens_limit;
  settings.give_up_grace_ms = cfg.broker.transfer_timeout_ms;
  settings.worker_timeout_ms = cfg.transport.peer_timeout_ms;
  settings.stream_prefill = cfg.broker.stream_prefill == "chunks";
  settings.first_token_from_decode = cfg.router.first_token == "decode";
  self->state.core = std::make_unique<router_core>(context.address, settings, prompt_encoder(cfg));
  self->state.context = context;
  self->send(self, tick_atom::value);
  return {
      [=](inbound& in) {
        auto& core = *self->state.core;
        auto& net = *self->state.context.net;
        const int64_t now = unix_ms();
        auto outcome = msg::dispatch(in.env, in.frames, [&](const msg::envelope& env, auto& m) {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, msg::submit>) core.on_submit(env, m, now);
          else if constexpr (std::is_same_v<M, msg::cancel>) core.on_cancel(env, m);
          else if constexpr (std::is_same_v<M, msg::prefill_done>) core.on_prefill_done(m, now);
          else if constexpr (std::is_same_v<M, msg::stage_failed>) core.on_stage_failed(env.src, m);
          else if constexpr (std::is_same_v<M, msg::request_done>) core.on_request_done(m);
          else if constexpr (std::is_same_v<M, msg::load_report>) core.on_load(env.src, m, now);
          else if constexpr (std::is_same_v<M, msg::stats_request>) {
            auto counters = core.counters();
            counters["in_flight"] = core.in_flight();
            counters["ready_prefill"] = core.ready_prefill();
            counters["ready_decode"] = core.ready_decode();
            reply_stats(net, core.out(), env, "router", 0, 0, std::move(counters));
          }
        });
        refuse_if_malformed(core.out(), in, outcome);
        flush(core.out(), net);
      },
      [=](tick_atom) {
        self->state.core->tick(unix_ms());
        flush(self->state.core->out(), *self->state.context.net);
        self->delayed_send(self, self->state.context.timing.tick, tick_atom::value);
      },
      [=](step_done_atom) {},
      [=](report_atom) {},
  };
}

// ------------------------------------------------------------------ broker

struct broker_state {
  std::unique_ptr<broker_core> core;
  actor_context context;
  static inline const char* name = "duet.broker";
};

duet_actor::behavior_type broker_behavior(duet_actor::stateful_pointer<broker_state> self, actor_context context) {
  broker_settings settings;
  settings.lease_ms = context.config->broker.lease_ms;
  settings.engine_kind = context.config->engine.kind;
  settings.direct_paths = context.config->broker.transfer != "stream";
  self->state.core = std::make_unique<broker_core>(context.address, settings);
  self->state.context = context;
  self->send(self, tick_atom::value);
  return {
      [=](inbound& in) {
        auto& core = *self->state.core;
        auto& net = *self->state.context.net;
        const int64_t now = unix_ms();
        auto outcome = msg::dispatch(in.env, in.frames, [&](const msg::envelope& env, auto& m) {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, msg::kv_register>) core.on_register(env.src, m, now);
          else if constexpr (std::is_same_v<M, msg::kv_pull>) core.on_pull(env.src, m, now);
          else if constexpr (std::is_same_v<M, msg::kv_confirm>) core.on_confirm(env.src, m);
          else if constexpr (std::is_same_v<M, msg::kv_nack>) core.on_nack(env.src, m);
          else if constexpr (std::is_same_v<M, msg::kv_drop>) core.on_drop(env.src, m);
          else if constexpr (std::is_same_v<M, msg::kv_renew>) core.on_renew(env.src, m, now);
          else if constexpr (std::is_same_v<M, msg::stats_request>) {
            auto counters = core.counters();
            counters["live_handles"] = core.live_handles();
            counters["bytes_in_flight"] = core.bytes_in_flight();
            reply_stats(net, core.out(), env, "broker", 0, 0, std::move(counters));
          }
        });
        refuse_if_malformed(core.out(), in, outcome);
        flush(core.out(), net);
      },
      [=](tick_atom) {
        // Reclamation runs on this timer, never only on the request path.
        self->state.core->reclaim(unix_ms());
        flush(self->state.core->out(), *self->state.context.net);
        self->delayed_send(self, std::chrono::milliseconds(self->state.context.config->broker.reclaim_interval_ms),
                           tick_atom::value);
      },
      [=](step_done_atom) {},
      [=](report_atom) {},
  };
}

// ------------------------------------------------------------------ prefill and decode

/// A worker's last load and whether an engine step is running, written by the worker after
/// every handler and read by its reporter actor.
struct load_board {
  std::mutex lock;
  msg::load_report last;
  int64_t step_since_ms = 0;  // 0: no step in flight
};

/// Sends the worker's load report on a timer of its own: a worker computing a synchronous
/// engine step reads no messages and fires no timers, yet it is busy, not dead. A step
/// running past `step_stall` silences the reports, so the router stops placing work there
/// and answers what the worker holds.
caf::behavior load_reporter(caf::event_based_actor* self, std::shared_ptr<load_board> board, actor_context context,
                            std::string router) {
  auto box = std::make_shared<outbox>(context.address);
  self->send(self, report_atom::value);
  return {
      [=](report_atom) {
        msg::load_report report;
        int64_t since = 0;
        {
          std::lock_guard<std::mutex> guard(board->lock);
          report = board->last;
          since = board->step_since_ms;
        }
        if (since == 0 || unix_ms() - since <= context.timing.step_stall.count()) {
          box->send(router, report);
          flush(*box, *context.net);
        }
        self->delayed_send(self, context.timing.report, report_atom::value);
      },
  };
}

/// What both workers hold; Role adds the core's construction and its message handlers.
template <class Core>
struct worker_state {
  std::shared_ptr<engine> engine_;
  std::unique_ptr<Core> core;
  actor_context context;
  std::string router;
  bool stepping = false;
  std::shared_ptr<load_board> board = std::make_shared<load_board>();
};

struct prefill_role : worker_state<prefill_core> {
  static inline const char* name = "duet.prefill";
  static constexpr const char* role = "prefill";
  static std::unique_ptr<prefill_core> make_core(const actor_context& context, const deployment_addresses& addrs) {
    prefill_settings settings;
    settings.router = addrs.router;
    settings.broker = addrs.broker;
    settings.kv_blocks = context.actor->kv_blocks;
    settings.chunk_tokens = context.actor->chunk_tokens;
    settings.max_batch = context.actor->max_batch;
    settings.register_timeout_ms = context.config->broker.transfer_timeout_ms;
    settings.stream.chunk_bytes = context.config->broker.stream_chunk_bytes;
    settings.stream.window = context.config->broker.stream_window;
    return std::make_unique<prefill_core>(context.address, settings, *context.compute);
  }
  template <class M>
  static void on(prefill_core& core, const msg::envelope& env, M& m, int64_t now, int64_t received) {
    if constexpr (std::is_same_v<M, msg::prefill_request>) core.on_request(env, m, now, received);
    else if constexpr (std::is_same_v<M, msg::cancel_seq>) core.on_cancel(m);
    else if constexpr (std::is_same_v<M, msg::kv_registered>) core.on_registered(m, now);
    else if constexpr (std::is_same_v<M, msg::kv_release>) core.on_release(m);
    else if constexpr (std::is_same_v<M, msg::kv_send>) core.on_kv_send(env.src, m);
    else if constexpr (std::is_same_v<M, msg::kv_chunk_ack>) core.on_chunk_ack(env.src, m);
  }
};

struct decode_role : worker_state<decode_core> {
  static inline const char* name = "duet.decode";
  static constexpr const char* role = "decode";
  static std::unique_ptr<decode_core> make_core(const actor_context& context, const deployment_addresses& addrs) {
    decode_settings settings;
    settings.router = addrs.router;
    settings.broker = addrs.broker;
    settings.kv_blocks = context.actor->kv_blocks;
    settings.max_batch = context.actor->max_batch;
    settings.allocation = kv_allocation_of(*context.actor);
    settings.chunk_tokens = context.actor->chunk_tokens;
    settings.transfer_timeout_ms = context.config->broker.transfer_timeout_ms;
    settings.renew_every_ms = std::max<uint32_t>(context.config->broker.lease_ms / 3, 1);
    settings.accept_early = context.config->broker.stream_prefill == "chunks";
    return std::make_unique<decode_core>(context.address, settings, *context.compute);
  }
  template <class M>
  static void on(decode_core& core, const msg::envelope& env, M& m, int64_t now, int64_t /*received*/) {
    if constexpr (std::is_same_v<M, msg::kv_adopt>) core.on_adopt(env, m, now);
    else if constexpr (std::is_same_v<M, msg::kv_moved>) core.on_moved(m, now);
    else if constexpr (std::is_same_v<M, msg::kv_chunk>) core.on_chunk(env, std::move(m), now);
    else if constexpr (std::is_same_v<M, msg::cancel_seq>) core.on_cancel(m);
  }
};

/// The step loop both workers share: run the engine when idle, wait the modelled time
/// (sim engine), then apply the results. Messages keep flowing in between.
template <class Role>
void maybe_step(typename duet_actor::stateful_pointer<Role> self) {
  auto& st = self->state;
  if (st.stepping) return;
  const int64_t now = unix_ms();
  {
    std::lock_guard<std::mutex> guard(st.board->lock);
    st.board->step_since_ms = now;  // a cuda or cpu engine computes inside begin_step
  }
  auto wait = st.core->begin_step(now);
  if (!wait) {
    std::lock_guard<std::mutex> guard(st.board->lock);
    st.board->step_since_ms = 0;
    return;
  }
  st.stepping = true;
  if (st.core->step_in_background()) return;  // the step thread sends step_done
  if (wait->count() > 0) {
    self->delayed_send(self, *wait, step_done_atom::value);
  } else {
    self->send(self, step_done_atom::value);
  }
}

/// Sends what the handler produced, then steps. A cuda or cpu engine computes on this thread:
/// a step started first held every message behind it for the whole step (a prompt's
/// prefill_done, and with it the first token, waited for the next prompt's chunk; on the
/// H200 17-21 ms of mean TTFT at conversation x3).
template <class Role>
void step_after_flush(typename duet_actor::stateful_pointer<Role> self) {
  auto publish_load = [&] {
    std::lock_guard<std::mutex> guard(self->state.board->lock);
    self->state.board->last = self->state.core->load();
  };
  flush(self->state.core->out(), *self->state.context.net);
  publish_load();  // what the reporter sends while a synchronous step runs
  maybe_step<Role>(self);
  flush(self->state.core->out(), *self->state.context.net);
  publish_load();
}

template <class Role>
duet_actor::behavior_type worker_behavior(duet_actor::stateful_pointer<Role> self, actor_context context) {
  const auto addrs = addresses_of(*context.config);
  auto& st = self->state;
  st.engine_ = context.compute;
  st.core = Role::make_core(context, addrs);
  st.context = context;
  st.router = addrs.router;
  st.board->last = st.core->load();
  // Steps of an engine that computes (cpu, cuda) run on a thread of their own, so messages
  // are taken while the GPU works: KV-stream acks, cancels and prompts during a prefill
  // chunk; adoptions during a decode step, whose sequences then join the next step.
  const bool background = std::is_same_v<Role, prefill_role>
                              ? prefill_steps_in_background(context.config->engine.kind)
                              : decode_steps_in_background(context.config->engine.kind);
  if constexpr (std::is_same_v<Role, decode_role>) {
    if (!background) {
      // The step computes here: a first token owed to a client leaves before it, not after.
      st.core->send_before_computing([self] { flush(self->state.core->out(), *self->state.context.net); });
    }
  }
  if (background) {
    auto weak = caf::actor_cast<caf::weak_actor_ptr>(self);
    st.core->compute_in_background([weak] {
      if (auto strong = caf::actor_cast<caf::strong_actor_ptr>(weak)) {
        caf::anon_send(caf::actor_cast<duet_actor>(strong), step_done_atom::value);
      }
    });
  }
  self->send(self, tick_atom::value);
  self->template spawn<caf::linked>(load_reporter, st.board, context, addrs.router);
  return {
      [=](inbound& in) {
        auto& core = *self->state.core;
        auto& net = *self->state.context.net;
        const int64_t now = unix_ms();
        const int64_t received = in.received_ms > 0 ? std::min(in.received_ms, now) : now;
        // The frames are given up: a KV chunk's bytes move into the message, uncopied.
        auto outcome = msg::dispatch(in.env, std::move(in.frames), [&](const msg::envelope& env, auto& m) {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, msg::stats_request>) {
            reply_stats(net, core.out(), env, Role::role, core.pool().free_blocks(), core.pool().total_blocks(),
                        core.counters());
          } else {
            Role::on(core, env, m, now, received);
          }
        });
        refuse_if_malformed(core.out(), in, outcome);
        step_after_flush<Role>(self);
      },
      [=](step_done_atom) {
        self->state.core->finish_step(unix_ms());
        self->state.stepping = false;
        {
          std::lock_guard<std::mutex> guard(self->state.board->lock);
          self->state.board->step_since_ms = 0;
        }
        step_after_flush<Role>(self);
      },
      [=](tick_atom) {
        self->state.core->tick(unix_ms());
        step_after_flush<Role>(self);
        self->delayed_send(self, self->state.context.timing.tick, tick_atom::value);
      },
      [=](report_atom) {},  // load_reporter sends the reports
  };
}

}  // namespace

duet_actor spawn_router(caf::actor_system& system, actor_context context) {
  return system.spawn(router_behavior, context);
}
duet_actor spawn_broker(caf::actor_system& system, actor_context context) {
  return system.spawn(broker_behavior, context);
}
duet_actor spawn_prefill(caf::actor_system& system, actor_context context) {
  return system.spawn(worker_behavior<prefill_role>, context);
}
duet_actor spawn_decode(caf::actor_system& system, actor_context context) {
  return system.spawn(worker_behavior<decode_role>, context);
}

}  // namespace duet
