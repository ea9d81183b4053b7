#pragma once
// Wire format (docs/protocol.md): a message is a list of frames
//   [0] envelope  msgpack map
//   [1] body      msgpack map (the message struct's fields)
//   [2..] raw     one frame per array listed by the struct's raw(), little-endian elements
#include <cstddef>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "messages/catalogue.hpp"
#include "messages/result.hpp"

namespace duet::msg {

using frame = std::string;
using frames = std::vector<frame>;

/// Routing and lifecycle data carried by every message.
struct envelope {
  uint16_t version = protocol_version;
  uint16_t type = 0;
  std::string src;  // "node/actor"
  std::string dst;  // "node/actor"
  uint64_t correlation = 0;
  int64_t deadline_ms = 0;  // unix epoch milliseconds; 0 = none
  DUET_MSGPACK_MAP(version, type, src, dst, correlation, deadline_ms);
};

/// Bounds applied while decoding untrusted bytes.
struct codec_limits {
  std::size_t max_frames = 8;
  std::size_t max_frame_bytes = std::size_t{64} << 20;
  std::size_t max_container_items = 1u << 16;  // msgpack array/map entries
  std::size_t max_string_bytes = 1u << 24;
  std::size_t max_depth = 16;
};

namespace detail {
result<msgpack::object_handle> unpack_frame(const frame& bytes, const codec_limits& limits);

template <class T>
frame raw_frame(const std::vector<T>& values) {
  static_assert(std::is_trivially_copyable_v<T>);
  frame out(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}
// A raw array held as a frame (bytes: KV chunks) is the frame itself, moved where it can be.
inline frame raw_frame(const frame& bytes) { return bytes; }
inline frame raw_frame(frame&& bytes) { return std::move(bytes); }

/// After a map failed to convert into T: names the first field whose value alone fails.
/// Unknown keys never fail (they are skipped), so the name is always one of T's fields.
template <class T>
std::string failing_field(const msgpack::object& map) {
  for (uint32_t i = 0; i < map.via.map.size; ++i) {
    msgpack::object_kv& kv = map.via.map.ptr[i];
    if (kv.key.type != msgpack::type::STR) return "a key that is not a string";
    msgpack::object single;
    single.type = msgpack::type::MAP;
    single.via.map.size = 1;
    single.via.map.ptr = &kv;
    try {
      T probe;
      single.convert(probe);
    } catch (const std::exception&) {
      return "field '" + std::string(kv.key.via.str.ptr, kv.key.via.str.size) + "'";
    }
  }
  return "a field";
}

template <class T>
bool read_raw_frame(const frame& bytes, std::vector<T>& out) {
  if (bytes.size() % sizeof(T) != 0) return false;
  out.resize(bytes.size() / sizeof(T));
  if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return true;
}
template <class T>
bool read_raw_frame(frame&& bytes, std::vector<T>& out) {
  return read_raw_frame(static_cast<const frame&>(bytes), out);
}
inline bool read_raw_frame(const frame& bytes, frame& out) {
  out = bytes;
  return true;
}
inline bool read_raw_frame(frame&& bytes, frame& out) {
  out = std::move(bytes);
  return true;
}

template <class M>
void encode_head(envelope& env, const M& message, frames& out) {
  env.type = static_cast<uint16_t>(M::id);
  msgpack::sbuffer buffer;
  msgpack::pack(buffer, env);
  out.emplace_back(buffer.data(), buffer.size());
  buffer.clear();
  msgpack::pack(buffer, message);
  out.emplace_back(buffer.data(), buffer.size());
}
}  // namespace detail

/// Encodes a message with its envelope; sets env.type from the message type.
template <class M>
[[nodiscard]] frames encode(envelope env, const M& message) {
  frames out;
  detail::encode_head(env, message, out);
  // raw() hands out references for reading only; it is non-const because std::tie is.
  auto arrays = const_cast<M&>(message).raw();
  std::apply([&](const auto&... array) { (out.push_back(detail::raw_frame(array)), ...); }, arrays);
  return out;
}

/// The same for a message given up by the caller: raw arrays held as frames (a KV chunk's
/// bytes) move into the frames instead of being copied.
template <class M>
  requires(!std::is_lvalue_reference_v<M>)
[[nodiscard]] frames encode(envelope env, M&& message) {
  frames out;
  detail::encode_head(env, message, out);
  std::apply([&](auto&... array) { (out.push_back(detail::raw_frame(std::move(array))), ...); },
             message.raw());
  return out;
}

/// Decodes and checks the envelope (frame 0) and the frame count.
[[nodiscard]] result<envelope> decode_envelope(const frames& in, const codec_limits& limits = {});

/// Decodes the body and raw frames as message type M (the caller checked the type id). From
/// frames given up by the caller (an rvalue), raw arrays held as frames take theirs over.
template <class M, class Frames>
  requires std::is_same_v<std::remove_cvref_t<Frames>, frames>
[[nodiscard]] result<M> decode_body(Frames&& in, const codec_limits& limits = {}) {
  M message;
  constexpr std::size_t raw_count = std::tuple_size_v<decltype(message.raw())>;
  if (in.size() != 2 + raw_count) {
    return result<M>::failure(std::string(to_string(M::id)) + ": expected " +
                              std::to_string(2 + raw_count) + " frames, got " +
                              std::to_string(in.size()));
  }
  auto handle = detail::unpack_frame(in[1], limits);
  if (!handle) return result<M>::failure(std::string(to_string(M::id)) + " body: " + handle.error());
  try {
    if (handle->get().type != msgpack::type::MAP) {
      return result<M>::failure(std::string(to_string(M::id)) + " body is not a map");
    }
    handle->get().convert(message);
  } catch (const std::exception&) {
    return result<M>::failure(std::string(to_string(M::id)) + " body: " +
                              detail::failing_field<M>(handle->get()) +
                              " has the wrong type or is out of range");
  }
  for (std::size_t i = 2; i < in.size(); ++i) {
    if (in[i].size() > limits.max_frame_bytes) {
      return result<M>::failure(std::string(to_string(M::id)) + ": raw frame of " +
                                std::to_string(in[i].size()) + " bytes exceeds the limit");
    }
  }
  std::size_t index = 2;
  bool raw_ok = true;
  auto take = [&](std::size_t i) -> decltype(auto) {  // frame i, moved out of frames given up
    if constexpr (std::is_rvalue_reference_v<Frames&&>) {
      return std::move(in[i]);
    } else {
      return std::as_const(in[i]);
    }
  };
  std::apply([&](auto&... array) { ((raw_ok = raw_ok && detail::read_raw_frame(take(index++), array)), ...); },
             message.raw());
  if (!raw_ok) return result<M>::failure(std::string(to_string(M::id)) + ": raw frame size is not a whole number of elements");
  return message;
}

}  // namespace duet::msg
