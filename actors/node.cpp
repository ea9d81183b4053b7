#include "actors/node.hpp"

#include "runtime/clock.hpp"
#include "runtime/compat.hpp"

namespace duet {

void tune_actor_system(caf::actor_system_config& cfg) {
  cfg.set("work-stealing.moderate-poll-attempts", caf::config_value::integer{0});
}

node::node(caf::actor_system& system, const deployment_config& config, const std::string& name,
           actor_timing timing)
    : system_(system), config_(config), name_(name) {
  const node_config* self = config.find_node(name);
  if (!self) throw config_error("no node named '" + name + "' in " + config.source.string());
  transport_settings settings;
  settings.node = name;
  settings.endpoint = self->endpoint;
  for (const auto& other : config.nodes) {
    if (other.name != name) settings.peers[other.name] = other.endpoint;
  }
  for (const auto& a : self->actors) settings.local_actors.insert(a.name);
  settings.queue_limit = config.transport.queue_limit;
  settings.max_frame_bytes = config.transport.max_frame_bytes;
  settings.compat_hash = compat_hash(config);
  settings.hello_interval_ms = config.transport.heartbeat_ms;
  // Engines first: a model that cannot load stops the node before it takes traffic.
  std::map<std::string, std::shared_ptr<engine>> engines;
  const auto seats = plan_shared_kv_pools(config, *self);
  for (const auto& a : self->actors) {
    if (a.role != actor_role::prefill && a.role != actor_role::decode) continue;
    const auto seat = seats.find(a.name);
    engines[a.name] = make_engine(config, a, seat == seats.end() ? kv_pool_seat{} : seat->second);
  }
  net_ = std::make_unique<transport>(settings, [this](msg::envelope&& env, msg::frames&& frames) {
    const auto slash = env.dst.find('/');
    auto it = actors_.find(env.dst.substr(slash + 1));
    if (it == actors_.end()) {
      ++unknown_actor_;
      return;
    }
    caf::anon_send(it->second, inbound{std::move(env), std::move(frames), unix_ms()});
  });
  for (const auto& a : self->actors) {
    actor_context context{name + "/" + a.name, &config, &a, net_.get(), engines[a.name], timing};
    switch (a.role) {
      case actor_role::router: actors_.emplace(a.name, spawn_router(system, context)); break;
      case actor_role::broker: actors_.emplace(a.name, spawn_broker(system, context)); break;
      case actor_role::prefill: actors_.emplace(a.name, spawn_prefill(system, context)); break;
      case actor_role::decode: actors_.emplace(a.name, spawn_decode(system, context)); break;
    }
  }
  try {
    net_->start();
  } catch (...) {
    stop();
    throw;
  }
}

node::~node() { stop(); }

void node::stop() {
  if (actors_.empty()) {
    if (net_) net_->stop();
    return;
  }
  caf::scoped_actor waiter{system_};
  for (auto& [name, a] : actors_) {
    waiter->send_exit(a, caf::exit_reason::user_shutdown);
  }
  for (auto& [name, a] : actors_) waiter->wait_for(a);
  // The transport may still deliver to an actor that has exited: CAF drops such mail.
  net_->stop();
  actors_.clear();
}

}  // namespace duet
