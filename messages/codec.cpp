#include "messages/codec.hpp"

namespace duet::msg::detail {

result<msgpack::object_handle> unpack_frame(const frame& bytes, const codec_limits& limits) {
  if (bytes.size() > limits.max_frame_bytes) {
    return result<msgpack::object_handle>::failure("frame of " + std::to_string(bytes.size()) +
                                                   " bytes exceeds the limit");
  }
  const msgpack::unpack_limit unpack_limits(limits.max_container_items, limits.max_container_items,
                                            limits.max_string_bytes, limits.max_string_bytes,
                                            limits.max_string_bytes, limits.max_depth);
  try {
    std::size_t offset = 0;
    auto handle = msgpack::unpack(bytes.data(), bytes.size(), offset, nullptr, nullptr, unpack_limits);
    if (offset != bytes.size()) {
      return result<msgpack::object_handle>::failure("trailing bytes after the msgpack value");
    }
    return handle;
  } catch (const std::exception& e) {
    return result<msgpack::object_handle>::failure(std::string("malformed msgpack: ") + e.what());
  }
}

}  // namespace duet::msg::detail

namespace duet::msg {

result<envelope> decode_envelope(const frames& in, const codec_limits& limits) {
  if (in.size() < 2) return result<envelope>::failure("a message needs at least 2 frames");
  if (in.size() > limits.max_frames) return result<envelope>::failure("too many frames");
  for (const auto& f : in) {
    if (f.size() > limits.max_frame_bytes) return result<envelope>::failure("frame exceeds the size limit");
  }
  auto handle = detail::unpack_frame(in[0], limits);
  if (!handle) return result<envelope>::failure("envelope: " + handle.error());
  envelope env;
  const msgpack::object& object = handle->get();
  if (object.type != msgpack::type::MAP) return result<envelope>::failure("envelope is not a map");
  try {
    object.convert(env);
  } catch (const std::exception&) {
    return result<envelope>::failure("envelope: " + detail::failing_field<envelope>(object) +
                                     " has the wrong type or is out of range");
  }
  // The defaults must not stand in for these two: a peer that sends no version is not ours.
  for (const std::string_view key : {"version", "type"}) {
    bool found = false;
    for (uint32_t i = 0; i < object.via.map.size && !found; ++i) {
      const msgpack::object& k = object.via.map.ptr[i].key;
      found = std::string_view(k.via.str.ptr, k.via.str.size) == key;
    }
    if (!found) return result<envelope>::failure("envelope has no '" + std::string(key) + "' field");
  }
  if (env.version != protocol_version) {
    return result<envelope>::failure("protocol version " + std::to_string(env.version) +
                                     " is not the supported " + std::to_string(protocol_version));
  }
  if (env.type == 0 || to_string(static_cast<type_id>(env.type)) == "unknown") {
    return result<envelope>::failure("unknown message type " + std::to_string(env.type));
  }
  return env;
}

}  // namespace duet::msg
