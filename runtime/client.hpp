#pragma once
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "messages/codec.hpp"

namespace duet {

struct deployment_config;

/// Where a deployment's router listens: its node's endpoint and its actor address.
struct router_location {
  std::string endpoint;
  std::string address;  // "node/actor"
};

/// The first router of the deployment; throws config_error when there is none.
[[nodiscard]] router_location find_router(const deployment_config& config);

/// Something that happened to one of this client's requests.
struct client_event {
  enum class kind : uint8_t { admitted, rejected, tokens, finished };
  kind what = kind::tokens;
  uint64_t request_id = 0;
  std::vector<int32_t> tokens;     // kind::tokens
  std::vector<uint32_t> positions; // kind::tokens: output index of each token
  /// kind::tokens: empty, or one per token (nullopt: none for that token); values come only
  /// when the request's sampling wants_logprobs() and the engine computes them (not sim).
  std::vector<std::optional<msg::token_logprobs>> logprobs;
  msg::finish finish;              // kind::finished
  msg::rejected rejection;         // kind::rejected
};

/// The result of a whole request, gathered by client::generate.
struct generation {
  uint64_t request_id = 0;
  bool admitted = false;
  std::vector<int32_t> tokens;
  std::vector<std::optional<msg::token_logprobs>> logprobs;  // one per token
  std::optional<msg::finish> finish;
  std::optional<msg::rejected> rejection;
  double ttft_s = 0;  // submit to first token
  std::vector<double> token_times_s;  // since submit, per token
};

/// The embedded message endpoint: a DEALER socket to the router's node. Not thread-safe:
/// one client per thread (its socket has one owner).
class client {
 public:
  /// `endpoint` is the router node's endpoint; `router` its actor address ("n1/router").
  client(const std::string& endpoint, std::string router, std::string name = {});
  ~client();

  /// Sends a request; returns false when the socket would block (router unreachable).
  bool submit(const msg::submit& request, int64_t deadline_ms = 0);
  bool cancel(uint64_t request_id);
  /// Waits up to `timeout` for messages and returns what arrived (possibly nothing).
  [[nodiscard]] std::vector<client_event> poll(std::chrono::milliseconds timeout);
  /// Submits and waits for the final answer or the timeout (then cancels and reports).
  [[nodiscard]] generation generate(const msg::submit& request, std::chrono::milliseconds timeout);
  /// Asks actors for their counters; replies that do not come within `timeout` are missing.
  [[nodiscard]] std::vector<msg::stats_reply> stats(const std::vector<std::string>& actors,
                                                    std::chrono::milliseconds timeout);

  [[nodiscard]] const std::string& address() const { return address_; }
  [[nodiscard]] uint64_t malformed() const { return malformed_; }

 private:
  template <class M>
  bool send(const std::string& dst, const M& message, int64_t deadline_ms = 0);
  std::vector<msg::stats_reply> stats_replies_;

  zmq::socket_t socket_;
  std::string router_;
  std::string address_;
  uint64_t malformed_ = 0;
};

/// True once `router` reports at least one ready prefill and one ready decode worker;
/// false after `timeout`.
[[nodiscard]] bool wait_ready(client& c, const std::string& router, std::chrono::milliseconds timeout);

}  // namespace duet
