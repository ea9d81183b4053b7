#pragma once
#include <string>
#include <utility>
#include <vector>

#include "messages/codec.hpp"

namespace duet {

/// A message ready for the transport: destination "node/actor" and its frames.
struct outgoing {
  std::string dst;
  msg::frames frames;
};

/// Where a core puts the messages it wants sent; the actor drains it after each call.
/// Cores never touch sockets or actors, so tests read the outbox directly.
class outbox {
 public:
  explicit outbox(std::string self) : self_(std::move(self)) {}

  /// A message given up (std::move) lends its raw arrays held as frames to the frames.
  template <class M>
  void send(const std::string& dst, M&& message, int64_t deadline_ms = 0, uint64_t correlation = 0) {
    msg::envelope env;
    env.src = self_;
    env.dst = dst;
    env.deadline_ms = deadline_ms;
    env.correlation = correlation;
    items_.push_back({dst, msg::encode(env, std::forward<M>(message))});
  }
  [[nodiscard]] std::vector<outgoing> take() { return std::exchange(items_, {}); }
  [[nodiscard]] const std::vector<outgoing>& pending() const { return items_; }
  [[nodiscard]] const std::string& self() const { return self_; }

 private:
  std::string self_;
  std::vector<outgoing> items_;
};

}  // namespace duet
