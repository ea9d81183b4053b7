#pragma once
// The `duet sim` and `duet plan` subcommands (docs/sim.md). apps/duet.cpp adds them to its
// CLI11 app and runs the one selected after parsing.
#include <memory>
#include <string_view>

#include "runtime/latency_stats.hpp"

namespace CLI {
class App;
}

namespace duet {

class sim_commands {
 public:
  /// Adds `sim` and `plan` to `app`.
  explicit sim_commands(CLI::App& app);
  ~sim_commands();
  sim_commands(const sim_commands&) = delete;
  sim_commands& operator=(const sim_commands&) = delete;

  /// Whether the parsed command line chose `sim` or `plan`.
  [[nodiscard]] bool selected() const;
  /// Runs the chosen command; returns the exit code (0 ok, 1 failure, 2 bad input).
  /// Errors are printed to stderr.
  [[nodiscard]] int run();

  struct state;  // the parsed options (sim/cli.cpp)

 private:
  std::unique_ptr<state> state_;
};

/// Reads "ttft=2s,tpot=50ms" (units s, ms, us; a bare number is seconds; either part may be
/// left out). Throws std::invalid_argument naming the bad part.
[[nodiscard]] latency_slo parse_slo(std::string_view text);

}  // namespace duet
