#pragma once
#include <map>
#include <memory>
#include <string>

#include "actors/roles.hpp"
#include "runtime/config.hpp"
#include "runtime/transport.hpp"

namespace duet {

/// The CAF settings every duet process runs its actor system with. CAF 0.17's work-stealing
/// workers, once out of work, poll up to 500 times with 50 µs sleeps before they block; the
/// short bursts of a control plane keep them re-entering that phase, so an idle node burned
/// 20-30 % of a core. With that polling off they block right after their short spin
/// (docs/benchmarks.md, "CAF's moderate polling").
void tune_actor_system(caf::actor_system_config& cfg);

/// One process's share of a deployment: its transport (one ZeroMQ endpoint) and its actors.
class node {
 public:
  /// Throws config_error when `name` is not a node of `config`, std::runtime_error when an
  /// engine cannot be built or the endpoint cannot be bound.
  node(caf::actor_system& system, const deployment_config& config, const std::string& name,
       actor_timing timing = {});
  ~node();
  node(const node&) = delete;
  node& operator=(const node&) = delete;

  /// Stops the actors, then the transport. Idempotent.
  void stop();

  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] const transport& net() const { return *net_; }
  [[nodiscard]] std::string endpoint() const { return net_->bound_endpoint(); }

 private:
  caf::actor_system& system_;
  const deployment_config& config_;
  std::string name_;
  std::unique_ptr<transport> net_;
  std::map<std::string, duet_actor> actors_;  // by actor name; fixed once started
  std::atomic<uint64_t> unknown_actor_{0};
};

}  // namespace duet
