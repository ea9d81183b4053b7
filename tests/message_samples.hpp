#pragma once
// One sample of every message type with every field set to a value other than its default,
// shared by the codec tests (round trips) and the decoder fuzzer (its seed corpus).
// sample(tag<M>{}) fails to compile for a catalogue type that has no sample here.
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "messages/catalogue.hpp"
#include "messages/codec.hpp"

namespace duet::msg::samples {

template <class M>
using tag = std::type_identity<M>;

/// Calls f(tag<M>{}) for every type M of the catalogue, in catalogue order.
template <class F, class... Ms>
void for_each_message(type_list<Ms...>, F&& f) {
  (f(tag<Ms>{}), ...);
}
template <class F>
void for_each_message(F&& f) {
  for_each_message(all_messages{}, f);
}

inline sampling_params sample_sampling() {
  sampling_params s;
  s.temperature = 0.75f;
  s.top_p = 0.875f;
  s.top_k = 40;
  s.min_p = 0.0625f;
  s.presence_penalty = -0.5f;
  s.frequency_penalty = 0.25f;
  s.repetition_penalty = 1.125f;
  s.seed = 0xfedcba9876543210ull;  // above INT64_MAX: must travel as an unsigned integer
  s.has_seed = true;
  s.max_new_tokens = 333;
  s.ignore_eos = true;
  s.top_logprobs = 5;
  s.stop_token_ids = {128009, -7};
  s.stop_strings = {"</s>", "\n\nUser:", "\xc3\xbc\xe2\x82\xac"};  // "ü€" in UTF-8
  s.logprobs = true;
  return s;
}

inline hello sample(tag<hello>) {
  return {.node = "n1", .protocol = 7, .compat_hash = 0x0123456789abcdefull, .pid = -4242};
}
inline heartbeat sample(tag<heartbeat>) {
  return {.node = "n2", .time_ms = 1764420000123};
}
inline error sample(tag<error>) {
  return {.code = error_code::unavailable, .message = "no route to n9/decode0", .about = 77};
}
inline submit sample(tag<submit>) {
  return {.request_id = std::numeric_limits<uint64_t>::max(),
          .prompt = std::string("hello\0world", 11),  // an embedded NUL survives
          .prompt_tokens = {1, 128000, -1, 0x7fffffff, std::numeric_limits<int32_t>::min()},
          .sampling = sample_sampling()};
}
inline admitted sample(tag<admitted>) {
  return {.request_id = 42, .prompt_tokens = 4096, .queue_position = 3};
}
inline rejected sample(tag<rejected>) {
  return {.request_id = 43,
          .code = error_code::overloaded,
          .message = "queue full",
          .retry_after_ms = 250};
}
inline cancel sample(tag<cancel>) { return {.request_id = 44}; }
inline token_batch sample(tag<token_batch>) {
  return {.request_ids = {1, 2, 0xffffffffffffffffull},
          .tokens = {128001, 15, -3},
          .positions = {0, 17, 0xffffffffu},
          .logprobs = {-0.125f, -3.5f, -1e-30f},
          .top_counts = {2, 0, 1},
          .top_ids = {128001, 7, -3},
          .top_logprobs = {-0.125f, -2.25f, -1e-30f}};
}
inline finish sample(tag<finish>) {
  return {.request_id = 45,
          .reason = finish_reason::error,
          .code = error_code::internal,
          .message = "decode worker n2/decode0 died",
          .prompt_tokens = 12,
          .completion_tokens = 34};
}
inline prefill_request sample(tag<prefill_request>) {
  return {.seq_id = 1001, .tokens = {128000, 9906, 1917}, .sampling = sample_sampling(), .stream_to = "n1/decode0"};
}
inline prefill_done sample(tag<prefill_done>) {
  return {.seq_id = 1002,
          .handle_id = 9001,
          .first_token = -12,
          .prompt_tokens = 3,
          .layout_hash = 0xa5a5a5a5a5a5a5a5ull,
          .has_first_logprobs = true,
          .first_logprobs = {.logprob = -0.75f, .top_ids = {-12, 40}, .top_logprobs = {-0.75f, -1.5f}}};
}
inline stage_failed sample(tag<stage_failed>) {
  return {.seq_id = 1003,
          .reason = finish_reason::timeout,
          .code = error_code::timeout,
          .message = "prefill deadline passed"};
}
inline cancel_seq sample(tag<cancel_seq>) {
  return {.seq_id = 1004, .reason = finish_reason::timeout};
}
inline request_done sample(tag<request_done>) {
  return {.seq_id = 1005, .reason = finish_reason::length, .completion_tokens = 99};
}
inline kv_adopt sample(tag<kv_adopt>) {
  return {.seq_id = 1006,
          .handle_id = 9002,
          .layout_hash = 0x1122334455667788ull,
          .client = "client-77/client",
          .request_id = 46,
          .first_token = 791,
          .sampling = sample_sampling(),
          .prompt = {128000, 791, 4320},
          .send_first = true,
          .has_first_logprobs = true,
          .first_logprobs = {.logprob = -0.5f, .top_ids = {791, 7}, .top_logprobs = {-0.5f, -2.25f}}};
}
inline kv_pool_export sample_pool_export() {
  return {.path = kv_path::cuda_ipc,
          .host = "0b3f6a2e-5c1d-4e8f-9a7b-1c2d3e4f5a6b",
          .pid = 4242,
          .handle = "00ff10ab",
          .base = 0x7f0000000000ull,
          .pool_bytes = 1ull << 36,
          .device = 2,
          .arena = 0x1234567890ull};
}
inline kv_register sample(tag<kv_register>) {
  return {.handle = {.handle_id = 9003,
                     .owner = "n1/prefill0",
                     .device = 3,
                     .token_count = 4097,
                     .layout_hash = 0x99aabbccddeeff00ull,
                     .bytes = 536870912,
                     .pool = sample_pool_export()},
          .block_ids = {0, 1, 2, 4096, 0xfffffffeu}};
}
inline kv_registered sample(tag<kv_registered>) {
  return {.handle_id = 9004, .lease_expiry_ms = 1764420010000};
}
inline kv_pull sample(tag<kv_pull>) {
  return {.handle_id = 9005,
          .layout_hash = 0x0f0f0f0f0f0f0f0full,
          .device = 1,
          .host = "0b3f6a2e-5c1d-4e8f-9a7b-1c2d3e4f5a6b",
          .can_import = kv_path::host_shm,
          .pid = 4243,
          .arena = 77,
          .block_ids = {7, 8, 9}};
}
inline kv_moved sample(tag<kv_moved>) {
  return {.handle_id = 9006,
          .path = kv_path::cuda_ipc,
          .bytes = 1ull << 40,
          .code = error_code::incompatible,
          .message = "layout differs",
          .source = sample_pool_export(),
          .source_blocks = {3, 1, 4}};
}
inline kv_confirm sample(tag<kv_confirm>) { return {.handle_id = 9007}; }
inline kv_release sample(tag<kv_release>) { return {.handle_id = 9008, .reason = "confirmed"}; }
inline kv_nack sample(tag<kv_nack>) { return {.handle_id = 9009, .reason = "no free blocks"}; }
inline kv_renew sample(tag<kv_renew>) { return {.handle_id = 9010}; }
inline kv_drop sample(tag<kv_drop>) { return {.handle_id = 9011, .reason = "client cancelled"}; }
inline kv_send sample(tag<kv_send>) { return {.handle_id = 9012, .to = "n2/decode1"}; }
inline kv_chunk sample(tag<kv_chunk>) {
  return {.handle_id = 9013,
          .first = 4,
          .count = 2,
          .total = 9,
          .layout_hash = 0xfeedface,
          .checksum = 0x0123456789abcdefull,
          .bytes = std::string("\x01\x02\xff", 3)};
}
inline kv_chunk_ack sample(tag<kv_chunk_ack>) { return {.handle_id = 9014, .received = 6, .resend = true}; }
inline load_report sample(tag<load_report>) {
  return {.actor = "n1/decode0", .queued = 5, .running = 60, .free_blocks = 100, .total_blocks = 4096};
}
inline stats_request sample(tag<stats_request>) { return {}; }
inline stats_reply sample(tag<stats_reply>) {
  return {.actor = "n1/prefill0",
          .role = "prefill",
          .free_blocks = 17,
          .total_blocks = 4096,
          .counters = {{"registered", 12}, {"bytes_registered", 1ull << 33}}};
}

/// The envelope every sample travels in: every field away from its default.
inline envelope sample_envelope() {
  envelope env;
  env.src = "n1/router";
  env.dst = "client-1234/client";
  env.correlation = 0x8000000000000001ull;
  env.deadline_ms = 1764420000000;
  return env;
}

template <class M>
frames sample_frames() {
  return encode(sample_envelope(), sample(tag<M>{}));
}

}  // namespace duet::msg::samples
