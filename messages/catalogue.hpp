#pragma once
// Every message of the lifecycle, as plain structs. Body fields travel as a msgpack map
// (DUET_MSGPACK_MAP, MSGPACK_DEFINE_MAP's format: fields can be added without breaking old
// peers); large arrays are listed by raw() and travel as raw binary frames after the body, in
// raw()'s order.
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <msgpack.hpp>

#include "messages/field_map.hpp"
#include "messages/protocol.hpp"

MSGPACK_ADD_ENUM(duet::msg::finish_reason);
MSGPACK_ADD_ENUM(duet::msg::error_code);
MSGPACK_ADD_ENUM(duet::msg::kv_path);

/// A msgpack map with no fields yet (DUET_MSGPACK_MAP() needs at least one).
#define DUET_MSGPACK_EMPTY_MAP                                                        \
  template <class Packer>                                                             \
  void msgpack_pack(Packer& packer) const {                                           \
    packer.pack_map(0);                                                               \
  }                                                                                   \
  void msgpack_unpack(const msgpack::object& object) {                                \
    if (object.type != msgpack::type::MAP) throw msgpack::type_error();               \
  }                                                                                   \
  void msgpack_object(msgpack::object* object, msgpack::zone&) const {                \
    object->type = msgpack::type::MAP;                                                \
    object->via.map.size = 0;                                                         \
    object->via.map.ptr = nullptr;                                                    \
  }

namespace duet::msg {

/// Sampling settings of one request, carried from the client to prefill and decode.
struct sampling_params {
  float temperature = 0.0f;  // 0 = greedy
  float top_p = 1.0f;
  int32_t top_k = 0;  // 0 = off
  float min_p = 0.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  uint64_t seed = 0;
  bool has_seed = false;
  uint32_t max_new_tokens = 16;
  bool ignore_eos = false;
  uint32_t top_logprobs = 0;  // alternatives to return per sampled token (implies logprobs)
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop_strings;
  bool logprobs = false;  // return each sampled token's log-probability
  DUET_MSGPACK_MAP(temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
                   repetition_penalty, seed, has_seed, max_new_tokens, ignore_eos,
                   top_logprobs, stop_token_ids, stop_strings, logprobs);
  /// Whether the client wants log-probabilities of the sampled tokens.
  [[nodiscard]] bool wants_logprobs() const { return logprobs || top_logprobs > 0; }
  friend bool operator==(const sampling_params&, const sampling_params&) = default;
};

/// Log-probabilities of one sampled token: log_softmax of the raw logits (before penalties
/// and temperature) at the token, and the most likely alternatives, most likely first.
struct token_logprobs {
  float logprob = 0.0f;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;  // parallel to top_ids
  DUET_MSGPACK_MAP(logprob, top_ids, top_logprobs);
  friend bool operator==(const token_logprobs&, const token_logprobs&) = default;
};

/// msgpack-c 4.1 packs a float that equals 2^64 (what a uint64 near its maximum converts to)
/// through an out-of-range cast to uint64_t (undefined behaviour, msgpack/v1/pack.hpp), so a
/// decoded message holding one could not be encoded again. Float fields on the wire must stay
/// below 2^63, far beyond any sampling setting or log-probability; decoding refuses the others.
[[nodiscard]] inline bool wire_float_ok(float f) { return !(f >= 9.2233720e18f); }
[[nodiscard]] inline bool wire_floats_ok(const std::vector<float>& fs) {
  for (float f : fs) {
    if (!wire_float_ok(f)) return false;
  }
  return true;
}

// ---------------------------------------------------------------- node to node

/// First message on every new peer connection; peers refuse mismatched hashes.
struct hello {
  static constexpr type_id id = type_id::hello;
  std::string node;
  uint16_t protocol = protocol_version;
  uint64_t compat_hash = 0;  // model, dtype, KV layout, block size (runtime/compat.hpp)
  int64_t pid = 0;
  DUET_MSGPACK_MAP(node, protocol, compat_hash, pid);
  auto raw() { return std::tie(); }
  friend bool operator==(const hello&, const hello&) = default;
};

struct heartbeat {
  static constexpr type_id id = type_id::heartbeat;
  std::string node;
  int64_t time_ms = 0;
  DUET_MSGPACK_MAP(node, time_ms);
  auto raw() { return std::tie(); }
  friend bool operator==(const heartbeat&, const heartbeat&) = default;
};

/// A refusal of a message that could not be handled (unknown destination, incompatible peer).
struct error {
  static constexpr type_id id = type_id::error;
  error_code code = error_code::internal;
  std::string message;
  uint64_t about = 0;  // correlation id of the message this answers
  DUET_MSGPACK_MAP(code, message, about);
  auto raw() { return std::tie(); }
  friend bool operator==(const error&, const error&) = default;
};

// ---------------------------------------------------------------- client <-> cluster

/// A generation request. `request_id` is chosen by the client, unique per client.
struct submit {
  static constexpr type_id id = type_id::submit;
  uint64_t request_id = 0;
  std::string prompt;                  // text; used when prompt_tokens is empty
  std::vector<int32_t> prompt_tokens;  // raw frame
  sampling_params sampling;
  DUET_MSGPACK_MAP(request_id, prompt, sampling);
  auto raw() { return std::tie(prompt_tokens); }
  friend bool operator==(const submit&, const submit&) = default;
};

struct admitted {
  static constexpr type_id id = type_id::admitted;
  uint64_t request_id = 0;
  uint32_t prompt_tokens = 0;
  uint32_t queue_position = 0;
  DUET_MSGPACK_MAP(request_id, prompt_tokens, queue_position);
  auto raw() { return std::tie(); }
  friend bool operator==(const admitted&, const admitted&) = default;
};

/// Refused before admission: nothing was reserved, nothing needs releasing.
struct rejected {
  static constexpr type_id id = type_id::rejected;
  uint64_t request_id = 0;
  error_code code = error_code::bad_request;
  std::string message;
  uint32_t retry_after_ms = 0;
  DUET_MSGPACK_MAP(request_id, code, message, retry_after_ms);
  auto raw() { return std::tie(); }
  friend bool operator==(const rejected&, const rejected&) = default;
};

struct cancel {
  static constexpr type_id id = type_id::cancel;
  uint64_t request_id = 0;
  DUET_MSGPACK_MAP(request_id);
  auto raw() { return std::tie(); }
  friend bool operator==(const cancel&, const cancel&) = default;
};

/// New tokens of one step for every request of one client (one message per step per
/// destination). Entry i: request_ids[i] got token tokens[i] at output position positions[i].
/// Log-probabilities (body fields, so peers that predate them still agree on the frames):
/// `logprobs` is empty (no entry has any) or one per entry, NaN for an entry whose request
/// did not ask; entry i's alternatives are the next top_counts[i] items of the flattened
/// top_ids / top_logprobs. token_batch_push and token_batch_logprobs keep this layout.
struct token_batch {
  static constexpr type_id id = type_id::token_batch;
  std::vector<uint64_t> request_ids;
  std::vector<int32_t> tokens;
  std::vector<uint32_t> positions;
  std::vector<float> logprobs;
  std::vector<uint32_t> top_counts;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
  DUET_MSGPACK_MAP(logprobs, top_counts, top_ids, top_logprobs);
  auto raw() { return std::tie(request_ids, tokens, positions); }
  friend bool operator==(const token_batch&, const token_batch&) = default;
};

/// Appends one entry; `lp` null: the request did not ask for log-probabilities.
void token_batch_push(token_batch& batch, uint64_t request_id, int32_t token, uint32_t position,
                      const token_logprobs* lp = nullptr);
/// Entry i's log-probabilities, one per entry; nullopt where an entry has none. Every entry
/// is nullopt when the arrays do not fit together (a malformed or older peer).
[[nodiscard]] std::vector<std::optional<token_logprobs>> token_batch_logprobs(const token_batch& batch);

/// The final response of an admitted request, success or error.
struct finish {
  static constexpr type_id id = type_id::finish;
  uint64_t request_id = 0;
  finish_reason reason = finish_reason::stop;
  error_code code = error_code::none;
  std::string message;
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  DUET_MSGPACK_MAP(request_id, reason, code, message, prompt_tokens, completion_tokens);
  auto raw() { return std::tie(); }
  friend bool operator==(const finish&, const finish&) = default;
};

// ---------------------------------------------------------------- router <-> workers

/// Router to prefill: run this prompt. seq_id is the router's cluster-wide request id.
struct prefill_request {
  static constexpr type_id id = type_id::prefill_request;
  uint64_t seq_id = 0;
  std::vector<int32_t> tokens;  // raw frame
  sampling_params sampling;
  // broker.stream_prefill = "chunks": the decode worker reserved for the request; the prompt's
  // finished blocks stream to it while later chunks compute. Empty: after the whole prompt.
  std::string stream_to;
  DUET_MSGPACK_MAP(seq_id, sampling, stream_to);
  auto raw() { return std::tie(tokens); }
  friend bool operator==(const prefill_request&, const prefill_request&) = default;
};

/// Prefill to router: KV is registered with the broker under handle_id; first token sampled.
struct prefill_done {
  static constexpr type_id id = type_id::prefill_done;
  uint64_t seq_id = 0;
  uint64_t handle_id = 0;
  int32_t first_token = 0;
  uint32_t prompt_tokens = 0;
  uint64_t layout_hash = 0;
  bool has_first_logprobs = false;  // the request asked and the engine computed them
  token_logprobs first_logprobs;
  DUET_MSGPACK_MAP(seq_id, handle_id, first_token, prompt_tokens, layout_hash, has_first_logprobs,
                   first_logprobs);
  auto raw() { return std::tie(); }
  friend bool operator==(const prefill_done&, const prefill_done&) = default;
};

/// A worker gave up on a sequence (no memory, engine failure, timeout, cancel done).
struct stage_failed {
  static constexpr type_id id = type_id::stage_failed;
  uint64_t seq_id = 0;
  finish_reason reason = finish_reason::error;
  error_code code = error_code::internal;
  std::string message;
  DUET_MSGPACK_MAP(seq_id, reason, code, message);
  auto raw() { return std::tie(); }
  friend bool operator==(const stage_failed&, const stage_failed&) = default;
};

/// Router to a worker: stop this sequence and release what it holds.
struct cancel_seq {
  static constexpr type_id id = type_id::cancel_seq;
  uint64_t seq_id = 0;
  finish_reason reason = finish_reason::cancelled;
  DUET_MSGPACK_MAP(seq_id, reason);
  auto raw() { return std::tie(); }
  friend bool operator==(const cancel_seq&, const cancel_seq&) = default;
};

/// Decode to router: the sequence ended and its final `finish` went to the client.
struct request_done {
  static constexpr type_id id = type_id::request_done;
  uint64_t seq_id = 0;
  finish_reason reason = finish_reason::stop;
  uint32_t completion_tokens = 0;
  DUET_MSGPACK_MAP(seq_id, reason, completion_tokens);
  auto raw() { return std::tie(); }
  friend bool operator==(const request_done&, const request_done&) = default;
};

/// Router to decode: take over this sequence; pull its KV from the broker.
struct kv_adopt {
  static constexpr type_id id = type_id::kv_adopt;
  uint64_t seq_id = 0;
  uint64_t handle_id = 0;
  uint64_t layout_hash = 0;
  std::string client;  // address the tokens stream to
  uint64_t request_id = 0;  // the client's id
  int32_t first_token = 0;
  sampling_params sampling;
  std::vector<int32_t> prompt;  // raw frame; penalties need the history
  // router.first_token = "decode": the client has not had first_token; the decode worker
  // sends it (position 0, with these logprobs) when the sequence's first step starts.
  bool send_first = false;
  bool has_first_logprobs = false;
  token_logprobs first_logprobs;
  DUET_MSGPACK_MAP(seq_id, handle_id, layout_hash, client, request_id, first_token, sampling, send_first,
                   has_first_logprobs, first_logprobs);
  auto raw() { return std::tie(prompt); }
  friend bool operator==(const kv_adopt&, const kv_adopt&) = default;
};

// ---------------------------------------------------------------- KV-handle broker

/// The KV cache of one prefilled sequence, owned by one actor's pool.
/// A KV pool another process on the same host can map: a CUDA IPC memory handle or a
/// POSIX shared-memory name. `path` none: the pool is private (stream path only).
struct kv_pool_export {
  kv_path path = kv_path::none;
  std::string host;    // boot id of the host; only processes there can map the pool
  int32_t pid = 0;     // the exporting process (in-process adopters use `base` directly)
  std::string handle;  // hex: cudaIpcMemHandle_t bytes, or the shm name
  uint64_t base = 0;   // the pool's address in the exporting process
  uint64_t pool_bytes = 0;
  int32_t device = 0;  // CUDA ordinal of the pool
  uint64_t arena = 0;  // nonzero: the pool is shared with other workers of process `pid` (same_pool)
  DUET_MSGPACK_MAP(path, host, pid, handle, base, pool_bytes, device, arena);
  friend bool operator==(const kv_pool_export&, const kv_pool_export&) = default;
};

struct kv_handle {
  uint64_t handle_id = 0;
  std::string owner;  // address of the actor whose pool holds the blocks
  int32_t device = 0;
  uint32_t token_count = 0;
  uint64_t layout_hash = 0;
  uint64_t bytes = 0;
  kv_pool_export pool;  // how a process on the owner's host can read the blocks directly
  DUET_MSGPACK_MAP(handle_id, owner, device, token_count, layout_hash, bytes, pool);
  friend bool operator==(const kv_handle&, const kv_handle&) = default;
};

struct kv_register {
  static constexpr type_id id = type_id::kv_register;
  kv_handle handle;
  std::vector<uint32_t> block_ids;  // raw frame
  DUET_MSGPACK_MAP(handle);
  auto raw() { return std::tie(block_ids); }
  friend bool operator==(const kv_register&, const kv_register&) = default;
};

struct kv_registered {
  static constexpr type_id id = type_id::kv_registered;
  uint64_t handle_id = 0;
  int64_t lease_expiry_ms = 0;
  DUET_MSGPACK_MAP(handle_id, lease_expiry_ms);
  auto raw() { return std::tie(); }
  friend bool operator==(const kv_registered&, const kv_registered&) = default;
};

/// Decode to broker: move the handle's KV into these blocks of my pool.
struct kv_pull {
  static constexpr type_id id = type_id::kv_pull;
  uint64_t handle_id = 0;
  uint64_t layout_hash = 0;
  int32_t device = 0;
  std::string host;          // the adopter's host (boot id)
  kv_path can_import = kv_path::none;  // the kind of exported pool the adopter can read
  int32_t pid = 0;                     // the adopter's process
  uint64_t arena = 0;                  // the adopter's shared pool (kv_pool_export::arena), 0 none
  std::vector<uint32_t> block_ids;  // raw frame
  DUET_MSGPACK_MAP(handle_id, layout_hash, device, host, can_import, pid, arena);
  auto raw() { return std::tie(block_ids); }
  friend bool operator==(const kv_pull&, const kv_pull&) = default;
};

/// Broker to decode: the KV is in place (ok), is to be copied from `source` (host_shm,
/// cuda_ipc), or will never be (error).
struct kv_moved {
  static constexpr type_id id = type_id::kv_moved;
  uint64_t handle_id = 0;
  kv_path path = kv_path::none;
  uint64_t bytes = 0;
  error_code code = error_code::none;
  std::string message;
  kv_pool_export source;             // host_shm / cuda_ipc: the pool to copy from
  std::vector<uint32_t> source_blocks;  // raw frame; host_shm / cuda_ipc / same_pool: the handle's blocks there
  DUET_MSGPACK_MAP(handle_id, path, bytes, code, message, source);
  auto raw() { return std::tie(source_blocks); }
  friend bool operator==(const kv_moved&, const kv_moved&) = default;
};

/// A kv_moved that says the KV will never arrive.
inline kv_moved kv_moved_failure(uint64_t handle_id, kv_path path, error_code code, std::string message) {
  kv_moved m;
  m.handle_id = handle_id;
  m.path = path;
  m.code = code;
  m.message = std::move(message);
  return m;
}

/// Decode to broker: the KV is mine now; the source may free its blocks.
struct kv_confirm {
  static constexpr type_id id = type_id::kv_confirm;
  uint64_t handle_id = 0;
  DUET_MSGPACK_MAP(handle_id);
  auto raw() { return std::tie(); }
  friend bool operator==(const kv_confirm&, const kv_confirm&) = default;
};

/// Broker to owner: free the handle's blocks (after confirm, nack, drop or lease expiry).
struct kv_release {
  static constexpr type_id id = type_id::kv_release;
  uint64_t handle_id = 0;
  std::string reason;
  DUET_MSGPACK_MAP(handle_id, reason);
  auto raw() { return std::tie(); }
  friend bool operator==(const kv_release&, const kv_release&) = default;
};

/// Decode to broker: I will not take this handle (no memory, cancelled, incompatible).
struct kv_nack {
  static constexpr type_id id = type_id::kv_nack;
  uint64_t handle_id = 0;
  std::string reason;
  DUET_MSGPACK_MAP(handle_id, reason);
  auto raw() { return std::tie(); }
  friend bool operator==(const kv_nack&, const kv_nack&) = default;
};

struct kv_renew {
  static constexpr type_id id = type_id::kv_renew;
  uint64_t handle_id = 0;
  DUET_MSGPACK_MAP(handle_id);
  auto raw() { return std::tie(); }
  friend bool operator==(const kv_renew&, const kv_renew&) = default;
};

/// Router to broker: the request died before adoption; release the handle.
struct kv_drop {
  static constexpr type_id id = type_id::kv_drop;
  uint64_t handle_id = 0;
  std::string reason;
  DUET_MSGPACK_MAP(handle_id, reason);
  auto raw() { return std::tie(); }
  friend bool operator==(const kv_drop&, const kv_drop&) = default;
};

// ---------------------------------------------------------------- KV bytes (stream path)

/// Broker to the owner of a handle: stream its blocks to `to`, in order.
struct kv_send {
  static constexpr type_id id = type_id::kv_send;
  uint64_t handle_id = 0;
  std::string to;  // the adopter's address
  DUET_MSGPACK_MAP(handle_id, to);
  auto raw() { return std::tie(); }
  friend bool operator==(const kv_send&, const kv_send&) = default;
};

/// Owner to adopter: blocks [first, first + count) of the handle's block list, as the
/// engine's read_blocks lays them out; `checksum` is XXH3-64 of `bytes`.
struct kv_chunk {
  static constexpr type_id id = type_id::kv_chunk;
  uint64_t handle_id = 0;
  uint32_t first = 0;
  uint32_t count = 0;
  uint32_t total = 0;  // blocks in the whole handle
  uint64_t layout_hash = 0;
  uint64_t checksum = 0;
  std::string bytes;  // raw frame, held as one (msg::frame): it moves in and out of the frames
  DUET_MSGPACK_MAP(handle_id, first, count, total, layout_hash, checksum);
  auto raw() { return std::tie(bytes); }
  friend bool operator==(const kv_chunk&, const kv_chunk&) = default;
};

/// Adopter to owner: `received` blocks are written; the owner may have `window` chunks
/// beyond that in flight (credit-based flow control).
struct kv_chunk_ack {
  static constexpr type_id id = type_id::kv_chunk_ack;
  uint64_t handle_id = 0;
  uint32_t received = 0;
  bool resend = false;  // a chunk after a lost one came (a stream begun during prefill): send from `received`
  DUET_MSGPACK_MAP(handle_id, received, resend);
  auto raw() { return std::tie(); }
  friend bool operator==(const kv_chunk_ack&, const kv_chunk_ack&) = default;
};

// ---------------------------------------------------------------- observation

/// Worker to router, periodically and on change: what placement decisions need.
struct load_report {
  static constexpr type_id id = type_id::load_report;
  std::string actor;
  uint32_t queued = 0;
  uint32_t running = 0;
  uint32_t free_blocks = 0;
  uint32_t total_blocks = 0;
  DUET_MSGPACK_MAP(actor, queued, running, free_blocks, total_blocks);
  auto raw() { return std::tie(); }
  friend bool operator==(const load_report&, const load_report&) = default;
};

struct stats_request {
  static constexpr type_id id = type_id::stats_request;
  DUET_MSGPACK_EMPTY_MAP
  auto raw() { return std::tie(); }
  friend bool operator==(const stats_request&, const stats_request&) = default;
};

/// One actor's counters; KV pool state where it has one.
struct stats_reply {
  static constexpr type_id id = type_id::stats_reply;
  std::string actor;
  std::string role;
  uint32_t free_blocks = 0;
  uint32_t total_blocks = 0;
  std::map<std::string, uint64_t> counters;
  DUET_MSGPACK_MAP(actor, role, free_blocks, total_blocks, counters);
  auto raw() { return std::tie(); }
  friend bool operator==(const stats_reply&, const stats_reply&) = default;
};

/// The catalogue: every message type, in type-id order.
template <class... Ts>
struct type_list {};
using all_messages =
    type_list<hello, heartbeat, error, submit, admitted, rejected, cancel, token_batch, finish,
              prefill_request, prefill_done, stage_failed, cancel_seq, request_done, kv_adopt,
              kv_register, kv_registered, kv_pull, kv_moved, kv_confirm, kv_release, kv_nack,
              kv_renew, kv_drop, load_report, stats_request, stats_reply, kv_send, kv_chunk,
              kv_chunk_ack>;

}  // namespace duet::msg

namespace msgpack {
MSGPACK_API_VERSION_NAMESPACE(MSGPACK_DEFAULT_API_NS) {
namespace adaptor {
// The messages with float fields decode as DUET_MSGPACK_MAP does, then refuse floats that
// could not be encoded again (duet::msg::wire_float_ok): the decoder names the field.
template <>
struct convert<duet::msg::sampling_params> {
  msgpack::object const& operator()(msgpack::object const& o, duet::msg::sampling_params& v) const {
    v.msgpack_unpack(o);
    for (float f : {v.temperature, v.top_p, v.min_p, v.presence_penalty, v.frequency_penalty, v.repetition_penalty}) {
      if (!duet::msg::wire_float_ok(f)) throw msgpack::type_error();
    }
    return o;
  }
};
template <>
struct convert<duet::msg::token_logprobs> {
  msgpack::object const& operator()(msgpack::object const& o, duet::msg::token_logprobs& v) const {
    v.msgpack_unpack(o);
    if (!duet::msg::wire_float_ok(v.logprob) || !duet::msg::wire_floats_ok(v.top_logprobs)) {
      throw msgpack::type_error();
    }
    return o;
  }
};
template <>
struct convert<duet::msg::token_batch> {
  msgpack::object const& operator()(msgpack::object const& o, duet::msg::token_batch& v) const {
    v.msgpack_unpack(o);
    if (!duet::msg::wire_floats_ok(v.logprobs) || !duet::msg::wire_floats_ok(v.top_logprobs)) {
      throw msgpack::type_error();
    }
    return o;
  }
};
}  // namespace adaptor
}  // MSGPACK_API_VERSION_NAMESPACE(MSGPACK_DEFAULT_API_NS)
}  // namespace msgpack
