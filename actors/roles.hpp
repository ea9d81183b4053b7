#pragma once
#include <memory>

#include "actors/common.hpp"
#include "runtime/broker_core.hpp"
#include "runtime/config.hpp"
#include "runtime/decode_core.hpp"
#include "runtime/engine.hpp"
#include "runtime/prefill_core.hpp"
#include "runtime/router_core.hpp"

namespace duet {

/// Timer periods shared by the actors.
struct actor_timing {
  std::chrono::milliseconds tick{20};
  std::chrono::milliseconds report{100};
  // A worker's load reports come from a reporter actor of their own, so a worker busy in a
  // long synchronous engine step (the CPU engine takes seconds per chunk) stays alive for
  // the router. A step longer than this stops them: the router takes the worker for stuck.
  std::chrono::milliseconds step_stall{120000};
};

/// Everything an actor needs to build its core: its address, its config, the deployment.
struct actor_context {
  std::string address;  // "node/actor"
  const deployment_config* config = nullptr;
  const actor_config* actor = nullptr;
  transport* net = nullptr;
  std::shared_ptr<duet::engine> compute;  // prefill/decode: built by the node, so errors surface at start
  actor_timing timing;
};

[[nodiscard]] duet_actor spawn_router(caf::actor_system& system, actor_context context);
[[nodiscard]] duet_actor spawn_broker(caf::actor_system& system, actor_context context);
[[nodiscard]] duet_actor spawn_prefill(caf::actor_system& system, actor_context context);
[[nodiscard]] duet_actor spawn_decode(caf::actor_system& system, actor_context context);

/// Addresses of the actors of each role across the whole deployment.
struct deployment_addresses {
  std::string router;
  std::string broker;
  std::vector<std::string> prefill;
  std::vector<std::string> decode;
};
[[nodiscard]] deployment_addresses addresses_of(const deployment_config& config);

}  // namespace duet
