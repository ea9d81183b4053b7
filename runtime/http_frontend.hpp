#pragma once
// The OpenAI-compatible HTTP front end (docs/http.md): an asynchronous HTTP/1.1 server on
// Boost.Beast, one io_context run by 1-2 threads, no thread per connection. Connections hand
// requests to one bridge thread that owns the cluster `client` (its ZeroMQ socket has one
// owner) through a queue; the bridge posts each request's events back to its connection's
// strand. A second thread polls the actors' counters for /health and /metrics.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/http_api.hpp"

namespace duet {

struct deployment_config;

/// Everything the front end needs; every default lives here.
struct http_frontend_settings {
  std::string host = "127.0.0.1";
  uint16_t port = 8080;              // 0 = any free port (see http_frontend::port())
  std::string router_endpoint;       // ZeroMQ endpoint of the router's node
  std::string router_address;        // "n1/router"
  std::vector<std::string> pool_actors;  // prefill/decode/broker addresses polled for /metrics
  std::string model_name = "duet-sim-llama-8b";
  uint32_t max_context = 32768;
  uint32_t max_new_tokens_limit = 32768;
  uint32_t completion_default_max_tokens = 16;  // /v1/completions without max_tokens (OpenAI's 16)
  uint32_t chat_default_max_tokens = 0;         // chat without max_tokens; 0 = to the end of the context
  std::string api_key;                          // non-empty: /v1/* needs "Authorization: Bearer <key>"
  reasoning_format reasoning = reasoning_format::split;  // default for chat responses
  std::size_t max_body_bytes = 4u << 20;        // larger bodies get 413
  std::size_t max_header_bytes = 16u << 10;     // larger headers get 431
  std::chrono::milliseconds header_timeout{10000};  // first request's headers must arrive within
  std::chrono::milliseconds body_timeout{30000};    // the body must arrive within, once headers are in
  std::chrono::milliseconds idle_timeout{30000};    // keep-alive: the next request must start within
  std::chrono::milliseconds write_timeout{30000};   // one write to a client that stops reading
  std::chrono::milliseconds request_timeout{135000};  // no final answer from the cluster: 504
  std::chrono::milliseconds stats_interval{250};    // counter polling period (/health, /metrics)
  uint32_t io_threads = 2;
  uint32_t max_connections = 16384;  // further connections are closed at once
};

/// Splits "host:port" ("[::1]:8080" for IPv6). Throws std::invalid_argument naming the text.
[[nodiscard]] std::pair<std::string, uint16_t> parse_host_port(std::string_view text);

/// The node whose process serves `--http` for a deployment: the one hosting the router,
/// else the first node.
[[nodiscard]] std::string http_host_node(const deployment_config& config);

/// Settings for a front end serving `http` ("host:port") for `config`: the router's
/// endpoint and address, the pool actors, model name and limits from the config.
/// Throws std::invalid_argument for a bad "host:port" or a deployment without a router.
[[nodiscard]] http_frontend_settings http_settings_from_config(const deployment_config& config,
                                                               std::string_view http);

/// Raises the soft open-files limit to the hard limit; returns the soft limit now in force.
uint64_t raise_fd_limit();

class http_frontend {
 public:
  /// `codec` turns text into tokens and back; `chat` renders chat messages (the plain
  /// fallback when null).
  http_frontend(http_frontend_settings settings, std::shared_ptr<const text_codec> codec,
                std::shared_ptr<const chat_template_renderer> chat = nullptr);
  ~http_frontend();
  http_frontend(const http_frontend&) = delete;
  http_frontend& operator=(const http_frontend&) = delete;

  /// Binds the listening socket and starts the threads. Throws std::runtime_error when the
  /// address cannot be bound.
  void start();
  /// Stops accepting, cancels every request in flight in the cluster, closes every
  /// connection and joins the threads. Idempotent.
  void stop();

  /// The bound port (the chosen one when settings.port was 0).
  [[nodiscard]] uint16_t port() const;
  /// Whether the router reported live prefill and decode workers at the last poll.
  [[nodiscard]] bool ready() const;
  /// The /metrics text.
  [[nodiscard]] std::string metrics_text() const;
  [[nodiscard]] const http_frontend_settings& settings() const;

  struct impl;  // the server's state (runtime/http_frontend.cpp)

 private:
  std::unique_ptr<impl> impl_;
};

/// What `duet node` and `duet up` call: starts the front end that node `node_name` serves,
/// or returns null when it serves none. `http_override` ("host:port", from --http), when not
/// empty, replaces the node's `http` key (`duet up` gives it to http_host_node(config) only).
/// `api_key` empty takes env DUET_API_KEY. Prints the address to stderr.
/// Throws std::runtime_error (bind failure, no tokenizer) or std::invalid_argument.
[[nodiscard]] std::unique_ptr<http_frontend> start_node_frontend(const deployment_config& config,
                                                                 const std::string& node_name,
                                                                 const std::string& http_override,
                                                                 const std::string& api_key);

}  // namespace duet
