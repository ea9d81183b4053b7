#pragma once
// DUET_MSGPACK_MAP: MSGPACK_DEFINE_MAP's wire format (a map from field names to values, unknown
// keys skipped, missing fields left at their defaults, the first of repeated keys kept), decoded
// without msgpack-c's per-message std::map. msgpack-c 4.1 builds a std::map<std::string, ...>
// of every key, and a std::string for every field it looks up, on each decode; this walks the
// map's pairs once and compares each key with the field names in place.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <tuple>
#include <utility>

#include <msgpack.hpp>

namespace duet::msg::detail {

/// Args alternate: a field's name (a string literal), the field.
template <class... Args>
class field_map {
 public:
  static constexpr std::size_t field_count = sizeof...(Args) / 2;
  static_assert(sizeof...(Args) % 2 == 0, "names and fields alternate");
  static_assert(field_count <= 64, "repeated keys are tracked in a 64-bit mask");

  explicit field_map(Args&... args) : fields_(args...) {}

  void msgpack_unpack(const msgpack::object& o) const {
    if (o.type != msgpack::type::MAP) throw msgpack::type_error();
    uint64_t seen = 0;
    for (uint32_t i = 0; i < o.via.map.size; ++i) {
      const msgpack::object_kv& kv = o.via.map.ptr[i];
      if (kv.key.type != msgpack::type::STR) throw msgpack::type_error();
      take(std::string_view(kv.key.via.str.ptr, kv.key.via.str.size), kv.val, seen,
           std::make_index_sequence<field_count>{});
    }
  }

 private:
  template <std::size_t... I>
  void take(std::string_view key, const msgpack::object& value, uint64_t& seen, std::index_sequence<I...>) const {
    (void)((key == std::string_view(std::get<2 * I>(fields_)) && (assign<I>(value, seen), true)) || ...);
  }

  template <std::size_t I>
  void assign(const msgpack::object& value, uint64_t& seen) const {
    constexpr uint64_t bit = uint64_t{1} << I;
    if (seen & bit) return;  // a repeated key: the first one counts
    seen |= bit;
    msgpack::v1::type::convert_helper(value, std::get<2 * I + 1>(fields_));
  }

  std::tuple<Args&...> fields_;
};

template <class... Args>
field_map<Args...> make_field_map(Args&... args) {
  return field_map<Args...>(args...);
}

}  // namespace duet::msg::detail

/// MSGPACK_DEFINE_MAP with the decoder above; encoding is msgpack-c's.
#define DUET_MSGPACK_MAP(...)                                                                 \
  template <class Packer>                                                                     \
  void msgpack_pack(Packer& msgpack_pk) const {                                               \
    msgpack::type::make_define_map MSGPACK_DEFINE_MAP_IMPL(__VA_ARGS__).msgpack_pack(msgpack_pk); \
  }                                                                                           \
  void msgpack_unpack(const msgpack::object& msgpack_o) {                                     \
    ::duet::msg::detail::make_field_map MSGPACK_DEFINE_MAP_IMPL(__VA_ARGS__).msgpack_unpack(msgpack_o); \
  }                                                                                           \
  template <class MSGPACK_OBJECT>                                                             \
  void msgpack_object(MSGPACK_OBJECT* msgpack_o, msgpack::zone& msgpack_z) const {            \
    msgpack::type::make_define_map MSGPACK_DEFINE_MAP_IMPL(__VA_ARGS__).msgpack_object(msgpack_o, msgpack_z); \
  }
