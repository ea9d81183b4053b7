#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace duet::msg {

/// Bumped on any incompatible change of the envelope or of a message's meaning.
inline constexpr uint16_t protocol_version = 1;

/// Stable numeric ids of every message type. Never reuse or renumber a value.
enum class type_id : uint16_t {
  // node to node
  hello = 1,
  heartbeat = 2,
  error = 3,
  // client <-> router / decode
  submit = 10,
  admitted = 11,
  rejected = 12,
  cancel = 13,
  token_batch = 14,
  finish = 15,
  // router <-> prefill / decode
  prefill_request = 20,
  prefill_done = 21,
  stage_failed = 22,
  cancel_seq = 23,
  request_done = 24,
  kv_adopt = 25,
  // KV-handle broker
  kv_register = 30,
  kv_registered = 31,
  kv_pull = 32,
  kv_moved = 33,
  kv_confirm = 34,
  kv_release = 35,
  kv_nack = 36,
  kv_renew = 37,
  kv_drop = 38,
  // observation
  load_report = 40,
  stats_request = 41,
  stats_reply = 42,
  // KV bytes between pools (the stream path)
  kv_send = 50,
  kv_chunk = 51,
  kv_chunk_ack = 52,
};

[[nodiscard]] std::string_view to_string(type_id id);

/// Why a request ended. Sent in `finish` and `request_done`.
enum class finish_reason : uint8_t { stop = 0, length = 1, cancelled = 2, timeout = 3, error = 4 };
[[nodiscard]] std::string_view to_string(finish_reason reason);

/// Error codes a client can read (HTTP front ends map them to status codes).
enum class error_code : uint16_t {
  none = 0,
  bad_request = 400,
  unauthorized = 401,
  not_found = 404,
  prompt_too_long = 413,
  overloaded = 429,
  internal = 500,
  unavailable = 503,
  timeout = 504,
  incompatible = 505,
};
[[nodiscard]] std::string_view to_string(error_code code);

/// KV transfer paths the broker can choose (DESIGN.md, "Request lifecycle" step 4).
enum class kv_path : uint8_t {
  none = 0,       // no bytes move: sim engine, accounting only
  same_pool = 1,  // one pool shared by both workers (same process, same device): ownership moves, no copy
  host_shm = 2,   // POSIX shared memory pools (cpu engine, other process)
  cuda_ipc = 3,   // cudaIpcMemHandle of the source pool, same host
  nccl = 4,       // NCCL send/recv between hosts with GPUs
  tcp = 5,        // block bytes as a stream over the control plane
};
[[nodiscard]] std::string_view to_string(kv_path path);

/// An actor's address: "node/actor". Clients use "client-<id>" as node and "client" as actor.
struct address {
  std::string node;
  std::string actor;

  [[nodiscard]] std::string str() const { return node + "/" + actor; }
  [[nodiscard]] bool empty() const { return node.empty(); }
  friend bool operator==(const address&, const address&) = default;
  friend auto operator<=>(const address&, const address&) = default;
};

/// Parses "node/actor"; returns an empty address when malformed.
[[nodiscard]] address parse_address(std::string_view text);

}  // namespace duet::msg
