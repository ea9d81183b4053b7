#pragma once
// Open-loop replay of a trace against an OpenAI-compatible HTTP server (duet's front end, or
// any server that takes token-id prompts and `ignore_eos`): each request is POSTed to
// /v1/completions at its arrival time on its own connection, streamed (SSE), and timed as
// the bytes arrive. Records are the ones sim/live_replay.hpp and the simulator produce, so
// `duet bench serve` puts live HTTP, live ZeroMQ and simulated runs in one report.
//
// What a record holds: arrival = when the request was sent; first token = the first SSE
// event carrying a choice; each later such event is one inter-token gap (events the client
// receives in one read give 0 gaps); output_tokens = the usage chunk's completion_tokens;
// finish = [DONE] (or the error / the end of the body). Outcomes: "ok" when the server
// generated exactly the asked number of tokens, "rejected_<status>" for 429/503,
// "http_<status>" for other statuses, "http_error" for an error event or a short answer,
// "connect_failed", "client_timeout", "not_sent".
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "runtime/latency_stats.hpp"
#include "sim/trace.hpp"

namespace duet {

struct http_target {
  std::string host = "127.0.0.1";
  uint16_t port = 8080;
  std::string base_path;  // prefix before /v1/..., usually empty
};

/// Reads http://HOST:PORT[/PREFIX]; throws std::invalid_argument on anything else (https
/// included: the replay speaks plain HTTP/1.1).
[[nodiscard]] http_target parse_http_url(const std::string& url);

struct http_replay_options {
  std::string model;    // the "model" field; empty: the first id of GET /v1/models
  std::string api_key;  // sent as "Authorization: Bearer ..." when set
  double temperature = 0.0;
  uint32_t prompt_vocab = 30000;              // prompt token ids are drawn below this
  std::chrono::milliseconds timeout{600000};  // the whole replay; every wait is bounded
  std::function<void(size_t sent, size_t done, size_t total)> progress;  // may be empty
};

/// GET /v1/models until the server answers 200 or `wait` passes; returns the first model id.
/// Throws std::runtime_error naming the target when it never answers.
[[nodiscard]] std::string wait_for_http_model(const http_target& target,
                                              const std::string& api_key,
                                              std::chrono::milliseconds wait);

/// Sends every request of `trace` at its arrival time and returns one record per request,
/// in trace order, with times in seconds since the replay started.
[[nodiscard]] std::vector<request_record> replay_http(const http_target& target,
                                                      std::span<const trace_request> trace,
                                                      const http_replay_options& options);

/// The prompt both live replays send for request `index` of a trace: `length` ids below
/// `vocab`, different for every request (no shared prefixes).
[[nodiscard]] std::vector<int32_t> replay_prompt(size_t index, uint32_t length, uint32_t vocab);

}  // namespace duet
