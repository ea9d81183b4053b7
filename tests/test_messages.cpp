// The wire format of every message (docs/protocol.md): round trips of the whole catalogue,
// the refusal of every kind of bad input, dispatch outcomes and forward compatibility.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "messages/codec.hpp"
#include "messages/dispatch.hpp"
#include "tests/message_samples.hpp"

namespace msg = duet::msg;
using msg::samples::for_each_message;
using msg::samples::sample;
using msg::samples::tag;

namespace {

// ---------------------------------------------------------------- compile-time catalogue checks

template <class... Ms>
constexpr bool ids_unique(msg::type_list<Ms...>) {
  constexpr uint16_t ids[] = {static_cast<uint16_t>(Ms::id)...};
  for (std::size_t i = 0; i < sizeof...(Ms); ++i) {
    for (std::size_t j = i + 1; j < sizeof...(Ms); ++j) {
      if (ids[i] == ids[j]) return false;
    }
  }
  return true;
}
static_assert(ids_unique(msg::all_messages{}), "two catalogue types share a type id");

template <class... Ms>
constexpr bool ids_ascending_and_nonzero(msg::type_list<Ms...>) {
  constexpr uint16_t ids[] = {static_cast<uint16_t>(Ms::id)...};
  for (std::size_t i = 0; i < sizeof...(Ms); ++i) {
    if (ids[i] == 0 || (i > 0 && ids[i - 1] >= ids[i])) return false;
  }
  return true;
}
static_assert(ids_ascending_and_nonzero(msg::all_messages{}),
              "the catalogue lists types in type-id order and 0 is never an id");

// to_string(type_id) is defined out of line (catalogue.cpp), so it cannot run in a constant
// expression. What can be proven at compile time is proven here: every type's id is a named
// enumerator of type_id, spelled like the struct itself. The compiler spells a template
// argument with its enumerator name, or as a cast "(ns::type_id)99" when no enumerator has
// that value. -Wswitch in catalogue.cpp then covers every enumerator, and the test
// "every catalogue type has a to_string name equal to its struct name" closes the loop.
template <auto V>
constexpr std::string_view enumerator_name() {
  constexpr std::string_view f = __PRETTY_FUNCTION__;  // "... [with auto V = a::b::c; ...]"
  constexpr auto start = f.find("V = ") + 4;
  constexpr auto spelled = f.substr(start, f.find_first_of(";]", start) - start);
  if (spelled.starts_with('(')) return {};
  return spelled.substr(spelled.rfind("::") + 2);
}
template <class T>
constexpr std::string_view struct_name() {
  constexpr std::string_view f = __PRETTY_FUNCTION__;  // "... [with T = a::b::c; ...]"
  constexpr auto start = f.find("T = ") + 4;
  constexpr auto spelled = f.substr(start, f.find_first_of(";]", start) - start);
  return spelled.substr(spelled.rfind("::") + 2);
}
template <class... Ms>
constexpr bool ids_named_like_structs(msg::type_list<Ms...>) {
  return ((!enumerator_name<Ms::id>().empty() && enumerator_name<Ms::id>() == struct_name<Ms>()) &&
          ...);
}
static_assert(enumerator_name<msg::type_id::kv_pull>() == "kv_pull");
static_assert(enumerator_name<static_cast<msg::type_id>(9999)>().empty());
static_assert(ids_named_like_structs(msg::all_messages{}),
              "a catalogue type's id is not the type_id enumerator of the same name");

// ---------------------------------------------------------------- helpers

const auto accept_all = [](const msg::envelope&, auto&) {};

/// The whole receive path: decode_envelope, then dispatch to a handler taking every type.
/// Returns the error text, or "" when the message decoded.
std::string receive_error(const msg::frames& in, const msg::codec_limits& limits = {}) {
  auto env = msg::decode_envelope(in, limits);
  if (!env) return env.error();
  const auto outcome = msg::dispatch(*env, in, accept_all, limits);
  if (outcome.status == msg::dispatch_status::malformed) return outcome.error;
  REQUIRE(outcome.status == msg::dispatch_status::handled);
  return {};
}

/// Bad input: refused with an error that names the problem; never a throw.
void check_refused(const msg::frames& in, const std::string& needle,
                   const msg::codec_limits& limits = {}) {
  std::string error;
  CHECK_NOTHROW(error = receive_error(in, limits));
  INFO("error: \"" << error << "\", expected it to mention \"" << needle << "\"");
  CHECK_FALSE(error.empty());
  CHECK(error.find(needle) != std::string::npos);
}

using packer = msgpack::packer<msgpack::sbuffer>;

template <class F>
std::string pack_with(F&& write) {
  msgpack::sbuffer buffer;
  packer p(buffer);
  write(p);
  return {buffer.data(), buffer.size()};
}

template <class T>
std::string pack_value(const T& value) {
  return pack_with([&](packer& p) { p.pack(value); });
}

/// An envelope written field by field, as a peer in another language would.
std::string envelope_bytes(uint16_t type, uint16_t version = msg::protocol_version) {
  return pack_with([&](packer& p) {
    p.pack_map(4);
    p.pack("version").pack(version);
    p.pack("type").pack(type);
    p.pack("src").pack("client-1/client");
    p.pack("dst").pack("n1/router");
  });
}

msg::frames message(msg::type_id type, std::string body, std::vector<std::string> raw = {}) {
  msg::frames out{envelope_bytes(static_cast<uint16_t>(type)), std::move(body)};
  for (auto& f : raw) out.push_back(std::move(f));
  return out;
}

/// A body with one key, the value written by `write_value`.
template <class F>
std::string body_with(std::string_view key, F&& write_value) {
  return pack_with([&](packer& p) {
    p.pack_map(1);
    p.pack(key);
    write_value(p);
  });
}

std::string nested_arrays(std::size_t depth) {
  return std::string(depth, '\x91') + '\x00';  // [[[...[0]...]]]
}

/// A map of one key whose value is the given msgpack bytes.
std::string map_with_value_bytes(std::string_view key, const std::string& value) {
  return pack_with([&](packer& p) {
    p.pack_map(1);
    p.pack(key);
  }) + value;
}

/// Every leaf of `defaults` must differ in `actual`; recurses into non-empty nested maps.
void check_every_field_differs(const msgpack::object& defaults, const msgpack::object& actual,
                               const std::string& path) {
  REQUIRE(defaults.type == msgpack::type::MAP);
  REQUIRE(actual.type == msgpack::type::MAP);
  REQUIRE(defaults.via.map.size == actual.via.map.size);
  for (uint32_t i = 0; i < defaults.via.map.size; ++i) {
    const auto& d = defaults.via.map.ptr[i];
    const auto& a = actual.via.map.ptr[i];
    const std::string key = d.key.as<std::string>();
    REQUIRE(key == a.key.as<std::string>());
    if (d.val.type == msgpack::type::MAP && d.val.via.map.size > 0) {
      check_every_field_differs(d.val, a.val, path + key + ".");
    } else {
      INFO("field " << path << key << " keeps its default in the sample");
      CHECK(d.val != a.val);
    }
  }
}

template <class M>
std::size_t raw_count() {
  return std::tuple_size_v<decltype(std::declval<M&>().raw())>;
}

}  // namespace

// ================================================================ the catalogue

TEST_CASE("every catalogue type has a to_string name equal to its struct name") {
  for_each_message([]<class M>(tag<M>) {
    CHECK(std::string(msg::to_string(M::id)) == std::string(struct_name<M>()));
  });
}

TEST_CASE("a type id has a name exactly when a catalogue type carries it") {
  std::set<uint16_t> catalogue;
  for_each_message([&]<class M>(tag<M>) { catalogue.insert(static_cast<uint16_t>(M::id)); });
  std::size_t named = 0;
  for (uint32_t id = 0; id <= std::numeric_limits<uint16_t>::max(); ++id) {
    const bool has_name = msg::to_string(static_cast<msg::type_id>(id)) != "unknown";
    named += has_name;
    if (has_name != catalogue.contains(static_cast<uint16_t>(id))) {
      FAIL_CHECK("type id " << id << (has_name ? " has a name but no catalogue type"
                                               : " has a catalogue type but no name"));
    }
  }
  CHECK(named == catalogue.size());
}

TEST_CASE("every sample sets every field to a value other than its default") {
  for_each_message([]<class M>(tag<M>) {
    INFO("message " << msg::to_string(M::id));
    const auto sample_frames = msg::encode(msg::envelope{}, sample(tag<M>{}));
    const auto default_frames = msg::encode(msg::envelope{}, M{});
    const auto s = msgpack::unpack(sample_frames[1].data(), sample_frames[1].size());
    const auto d = msgpack::unpack(default_frames[1].data(), default_frames[1].size());
    check_every_field_differs(d.get(), s.get(), "");
    REQUIRE(sample_frames.size() == 2 + raw_count<M>());
    for (std::size_t i = 2; i < sample_frames.size(); ++i) {
      CHECK(sample_frames[i].size() > default_frames[i].size());
    }
  });
  // The envelope's version keeps its default (the one value accepted); encode sets its type.
  const auto env = msg::samples::sample_envelope();
  const msg::envelope defaults;
  CHECK(env.src != defaults.src);
  CHECK(env.dst != defaults.dst);
  CHECK(env.correlation != defaults.correlation);
  CHECK(env.deadline_ms != defaults.deadline_ms);
}

// ================================================================ round trips

TEST_CASE("every message type survives encode, decode_envelope and decode_body unchanged") {
  for_each_message([]<class M>(tag<M>) {
    INFO("message " << msg::to_string(M::id));
    const M original = sample(tag<M>{});
    const auto sent = msg::samples::sample_envelope();
    const auto frames = msg::encode(sent, original);
    CHECK(frames.size() == 2 + raw_count<M>());

    auto env = msg::decode_envelope(frames);
    REQUIRE_MESSAGE(env.ok(), env.error());
    CHECK(env->version == msg::protocol_version);
    CHECK(env->type == static_cast<uint16_t>(M::id));
    CHECK(env->src == sent.src);
    CHECK(env->dst == sent.dst);
    CHECK(env->correlation == sent.correlation);
    CHECK(env->deadline_ms == sent.deadline_ms);

    auto body = msg::decode_body<M>(frames);
    REQUIRE_MESSAGE(body.ok(), body.error());
    CHECK(*body == original);
    // Encoding is canonical: the decoded message encodes to the very same bytes.
    CHECK(msg::encode(*env, *body) == frames);
  });
}

TEST_CASE("dispatch hands every message type to a generic handler as its concrete struct") {
  for_each_message([]<class M>(tag<M>) {
    INFO("message " << msg::to_string(M::id));
    const auto frames = msg::samples::sample_frames<M>();
    auto env = msg::decode_envelope(frames);
    REQUIRE(env.ok());
    int calls = 0;
    const auto outcome = msg::dispatch(*env, frames, [&](const msg::envelope& e, auto& m) {
      ++calls;
      CHECK(e.type == static_cast<uint16_t>(M::id));
      if constexpr (std::is_same_v<std::decay_t<decltype(m)>, M>) {
        CHECK(m == sample(tag<M>{}));
      } else {
        FAIL("dispatched as " << msg::to_string(std::decay_t<decltype(m)>::id));
      }
    });
    CHECK(outcome.status == msg::dispatch_status::handled);
    CHECK(outcome.error.empty());
    CHECK(calls == 1);
  });
}

TEST_CASE("encode sets the envelope's type from the message, whatever the caller put there") {
  msg::envelope env;
  env.type = static_cast<uint16_t>(msg::type_id::finish);
  const auto frames = msg::encode(env, msg::cancel{.request_id = 5});
  auto decoded = msg::decode_envelope(frames);
  REQUIRE(decoded.ok());
  CHECK(decoded->type == static_cast<uint16_t>(msg::type_id::cancel));
}

TEST_CASE("the body is a msgpack map keyed by field name, in declaration order") {
  const auto frames = msg::encode(msg::envelope{}, msg::cancel{.request_id = 44});
  CHECK(frames[1] == std::string("\x81\xaarequest_id\x2c", 13));
  const auto envelope = msgpack::unpack(frames[0].data(), frames[0].size());
  const auto& map = envelope.get().via.map;
  REQUIRE(envelope.get().type == msgpack::type::MAP);
  const std::vector<std::string> keys{"version", "type", "src", "dst", "correlation", "deadline_ms"};
  REQUIRE(map.size == keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) CHECK(map.ptr[i].key.as<std::string>() == keys[i]);
}

TEST_CASE("raw arrays travel as little-endian frames in raw() order, not in the body") {
  const auto frames = msg::samples::sample_frames<msg::token_batch>();
  REQUIRE(frames.size() == 5);
  {  // token_batch's body holds only its optional log-probabilities
    const auto batch_body = msgpack::unpack(frames[1].data(), frames[1].size());
    std::set<std::string> keys;
    for (uint32_t i = 0; i < batch_body.get().via.map.size; ++i) {
      keys.insert(batch_body.get().via.map.ptr[i].key.as<std::string>());
    }
    CHECK(keys == std::set<std::string>{"logprobs", "top_counts", "top_ids", "top_logprobs"});
  }
  CHECK(frames[2].size() == 3 * sizeof(uint64_t));
  CHECK(frames[3] == std::string("\x01\xf4\x01\x00\x0f\x00\x00\x00\xfd\xff\xff\xff", 12));
  CHECK(frames[4].substr(4, 4) == std::string("\x11\x00\x00\x00", 4));

  const auto submit = msg::samples::sample_frames<msg::submit>();
  const auto body = msgpack::unpack(submit[1].data(), submit[1].size());
  std::set<std::string> keys;
  for (uint32_t i = 0; i < body.get().via.map.size; ++i) {
    keys.insert(body.get().via.map.ptr[i].key.as<std::string>());
  }
  CHECK(keys == std::set<std::string>{"request_id", "prompt", "sampling"});
  CHECK(submit[2].size() == 5 * sizeof(int32_t));
}

TEST_CASE("empty raw arrays travel as empty frames and decode as empty arrays") {
  const auto frames = msg::encode(msg::envelope{}, msg::token_batch{});
  REQUIRE(frames.size() == 5);
  for (std::size_t i = 2; i < 5; ++i) CHECK(frames[i].empty());
  auto body = msg::decode_body<msg::token_batch>(frames);
  REQUIRE(body.ok());
  CHECK(*body == msg::token_batch{});
}

TEST_CASE("a KV chunk's bytes move into the frames and back out, uncopied, when given up") {
  msg::kv_chunk chunk = msg::samples::sample(msg::samples::tag<msg::kv_chunk>{});
  chunk.bytes.assign(1 << 20, '\x5a');
  const auto expected = chunk;
  const char* bytes_at = chunk.bytes.data();
  // Given up: the raw frame is the chunk's own buffer.
  auto frames = msg::encode(msg::envelope{}, std::move(chunk));
  REQUIRE(frames.size() == 3);
  CHECK(frames[2].data() == bytes_at);
  // Kept (an lvalue): copied, and the frames stay whole for another decode.
  const auto copied = msg::decode_body<msg::kv_chunk>(frames);
  REQUIRE(copied.ok());
  CHECK(copied->bytes.data() != bytes_at);
  CHECK(*copied == expected);
  CHECK(frames[2].size() == expected.bytes.size());
  // Given up: the message takes the frame's buffer.
  const auto moved = msg::decode_body<msg::kv_chunk>(std::move(frames));
  REQUIRE(moved.ok());
  CHECK(moved->bytes.data() == bytes_at);
  CHECK(*moved == expected);
  // An lvalue message is copied: the caller keeps its bytes.
  const auto again = msg::encode(msg::envelope{}, expected);
  CHECK(again[2] == expected.bytes);
  CHECK(expected.bytes.size() == std::size_t{1} << 20);
}

TEST_CASE("token_batch log-probabilities: entries without any read as none, and an older peer's empty body as none for all") {
  msg::token_batch batch;
  msg::token_batch_push(batch, 1, 10, 0);
  const msg::token_logprobs two{.logprob = -0.5f, .top_ids = {10, 11}, .top_logprobs = {-0.5f, -1.25f}};
  msg::token_batch_push(batch, 2, 10, 3, &two);
  msg::token_batch_push(batch, 3, 12, 1);
  const msg::token_logprobs bare{.logprob = -2.0f, .top_ids = {}, .top_logprobs = {}};
  msg::token_batch_push(batch, 4, 13, 7, &bare);
  CHECK(batch.request_ids == std::vector<uint64_t>{1, 2, 3, 4});
  CHECK(batch.logprobs.size() == 4);
  CHECK(batch.top_counts == std::vector<uint32_t>{0, 2, 0, 0});

  auto decoded = msg::decode_body<msg::token_batch>(msg::encode(msg::envelope{}, batch));
  REQUIRE_MESSAGE(decoded.ok(), decoded.error());
  const auto lps = msg::token_batch_logprobs(*decoded);
  REQUIRE(lps.size() == 4);
  CHECK_FALSE(lps[0].has_value());
  REQUIRE(lps[1].has_value());
  CHECK(*lps[1] == two);
  CHECK_FALSE(lps[2].has_value());
  REQUIRE(lps[3].has_value());
  CHECK(*lps[3] == bare);

  msg::token_batch plain;
  msg::token_batch_push(plain, 5, 6, 0);
  CHECK(plain.logprobs.empty());
  // What a peer from before log-probabilities sends: an empty body.
  auto frames = msg::encode(msg::envelope{}, plain);
  frames[1] = std::string("\x80", 1);
  auto old = msg::decode_body<msg::token_batch>(frames);
  REQUIRE_MESSAGE(old.ok(), old.error());
  CHECK(*old == plain);
  CHECK(msg::token_batch_logprobs(*old) == std::vector<std::optional<msg::token_logprobs>>(1));

  msg::token_batch broken = batch;
  broken.top_ids.pop_back();  // counts no longer add up: nothing is trusted
  CHECK(msg::token_batch_logprobs(broken) == std::vector<std::optional<msg::token_logprobs>>(4));
}

// ================================================================ bad input

TEST_CASE("every truncated envelope or body is refused with a message") {
  for_each_message([]<class M>(tag<M>) {
    INFO("message " << msg::to_string(M::id));
    const auto frames = msg::samples::sample_frames<M>();
    for (std::size_t f = 0; f < 2; ++f) {
      for (std::size_t length = 0; length < frames[f].size(); ++length) {
        auto cut = frames;
        cut[f].resize(length);
        INFO("frame " << f << " cut to " << length << " of " << frames[f].size() << " bytes");
        check_refused(cut, f == 0 ? "envelope" : std::string(msg::to_string(M::id)) + " body");
      }
    }
  });
}

TEST_CASE("a raw frame cut inside an element is refused") {
  for_each_message([]<class M>(tag<M>) {
    INFO("message " << msg::to_string(M::id));
    const auto frames = msg::samples::sample_frames<M>();
    for (std::size_t f = 2; f < frames.size(); ++f) {
      for (std::size_t length = 0; length < frames[f].size(); ++length) {
        auto cut = frames;
        cut[f].resize(length);
        const auto error = receive_error(cut);
        // a whole number of elements is a shorter array, which is still well formed
        const std::size_t element = M::id == msg::type_id::kv_chunk     ? 1  // bytes
                                    : f == 2 && M::id == msg::type_id::token_batch ? 8
                                                                                   : 4;
        const bool whole = length % element == 0;
        INFO("frame " << f << " cut to " << length << " bytes: " << error);
        CHECK(error.empty() == whole);
        if (!whole) CHECK(error.find("whole number of elements") != std::string::npos);
      }
    }
  });
}

TEST_CASE("flipping, dropping or inserting any byte never throws or crashes the decoder") {
  std::size_t decoded = 0;
  std::size_t refused = 0;
  for_each_message([&]<class M>(tag<M>) {
    const auto frames = msg::samples::sample_frames<M>();
    auto run = [&](const msg::frames& in) {
      std::string error;
      CHECK_NOTHROW(error = receive_error(in));
      ++(error.empty() ? decoded : refused);
    };
    for (std::size_t f = 0; f < frames.size(); ++f) {
      for (std::size_t at = 0; at < frames[f].size(); ++at) {
        for (int bit = 0; bit < 8; ++bit) {
          auto flipped = frames;
          flipped[f][at] = static_cast<char>(flipped[f][at] ^ (1 << bit));
          run(flipped);
        }
        auto dropped = frames;
        dropped[f].erase(at, 1);
        run(dropped);
        auto inserted = frames;
        inserted[f].insert(at, 1, '\xc1');  // the one byte msgpack never uses
        run(inserted);
      }
    }
  });
  MESSAGE(decoded << " mutants decoded, " << refused << " refused");
  CHECK(refused > 0);
  CHECK(decoded > 0);
}

TEST_CASE("a field of the wrong msgpack type is refused, naming the field") {
  using msg::type_id;
  SUBCASE("a string where an integer is expected") {
    check_refused(message(type_id::cancel, body_with("request_id", [](packer& p) { p.pack("42"); })),
                  "cancel body: field 'request_id' has the wrong type");
  }
  SUBCASE("a float where an integer is expected") {
    check_refused(message(type_id::cancel, body_with("request_id", [](packer& p) { p.pack(4.2); })),
                  "field 'request_id'");
  }
  SUBCASE("a negative number where an unsigned integer is expected") {
    check_refused(message(type_id::cancel, body_with("request_id", [](packer& p) { p.pack(-1); })),
                  "field 'request_id'");
  }
  SUBCASE("an integer beyond the field's range") {
    check_refused(message(type_id::hello, body_with("protocol", [](packer& p) { p.pack(70000); })),
                  "hello body: field 'protocol' has the wrong type or is out of range");
  }
  SUBCASE("an integer where a bool is expected") {
    const auto body = body_with("sampling", [](packer& p) {
      p.pack_map(1);
      p.pack("has_seed").pack(1);
    });
    check_refused(message(type_id::submit, body, {""}), "submit body: field 'sampling'");
  }
  SUBCASE("a string where a float is expected") {
    const auto body = body_with("sampling", [](packer& p) {
      p.pack_map(1);
      p.pack("temperature").pack("hot");
    });
    check_refused(message(type_id::prefill_request, body, {""}), "field 'sampling'");
  }
  SUBCASE("a float at 2^64 (which msgpack-c could not encode again) is out of range") {
    // The largest uint64 converts to the float 2^64: packing that again is undefined behaviour
    // in msgpack-c 4.1 (found by fuzz_decode), so the decoder refuses it.
    const auto body = body_with("sampling", [](packer& p) {
      p.pack_map(1);
      p.pack("temperature").pack(std::numeric_limits<uint64_t>::max());
    });
    check_refused(message(type_id::submit, body, {""}), "submit body: field 'sampling'");
    const auto logprobs = body_with("top_logprobs", [](packer& p) {
      p.pack(std::vector<float>{-1.0f, 18446744073709551616.0f});
    });
    check_refused(message(type_id::token_batch, logprobs, {"", "", ""}), "token_batch body: field 'top_logprobs'");
    CHECK(msg::wire_float_ok(9.0e18f));
    CHECK_FALSE(msg::wire_float_ok(1.8446744e19f));
  }
  SUBCASE("an array where a string is expected") {
    check_refused(message(type_id::kv_nack, body_with("reason", [](packer& p) { p.pack_array(0); })),
                  "kv_nack body: field 'reason'");
  }
  SUBCASE("an array of strings where a map is expected") {
    const auto body = body_with("counters", [](packer& p) { p.pack(std::vector<std::string>{"a"}); });
    check_refused(message(type_id::stats_reply, body), "field 'counters'");
  }
  SUBCASE("a nil where an enum is expected") {
    check_refused(message(type_id::finish, body_with("reason", [](packer& p) { p.pack_nil(); })),
                  "field 'reason'");
  }
  SUBCASE("a string where the envelope's type is expected") {
    const auto envelope = pack_with([](packer& p) {
      p.pack_map(2);
      p.pack("version").pack(msg::protocol_version);
      p.pack("type").pack("submit");
    });
    check_refused({envelope, pack_value(std::map<std::string, int>{})},
                  "envelope: field 'type' has the wrong type");
  }
  SUBCASE("a negative correlation id") {
    const auto envelope = pack_with([](packer& p) {
      p.pack_map(3);
      p.pack("version").pack(msg::protocol_version);
      p.pack("type").pack(static_cast<uint16_t>(type_id::cancel));
      p.pack("correlation").pack(-5);
    });
    check_refused({envelope, pack_value(std::map<std::string, int>{})}, "field 'correlation'");
  }
}

TEST_CASE("a body or envelope that is not a map is refused") {
  using msg::type_id;
  check_refused(message(type_id::cancel, pack_value(std::vector<int>{44})), "cancel body is not a map");
  check_refused(message(type_id::cancel, pack_value(44)), "cancel body is not a map");
  check_refused(message(type_id::cancel, pack_with([](packer& p) { p.pack_nil(); })), "not a map");
  check_refused(message(type_id::token_batch, pack_value(std::string("{}")), {"", "", ""}),
                "token_batch body is not a map");
  check_refused(message(type_id::stats_request, pack_value(std::vector<int>{})),
                "stats_request body is not a map");
  check_refused({pack_value(std::vector<int>{1, 10}), pack_value(std::map<std::string, int>{})},
                "envelope is not a map");
}

TEST_CASE("a map key that is not a string is refused") {
  const auto body = pack_with([](packer& p) {
    p.pack_map(1);
    p.pack(1).pack(44);
  });
  check_refused(message(msg::type_id::cancel, body), "a key that is not a string");
}

TEST_CASE("an unknown type id is refused by decode_envelope") {
  for (const uint16_t type : {0, 4, 16, 99, 9999, 65535}) {
    INFO("type " << type);
    check_refused({envelope_bytes(type), pack_value(std::map<std::string, int>{})},
                  "unknown message type " + std::to_string(type));
  }
}

TEST_CASE("an envelope of another protocol version, or of none, is refused") {
  const auto cancel = static_cast<uint16_t>(msg::type_id::cancel);
  const std::string body = pack_value(std::map<std::string, int>{{"request_id", 1}});
  for (const uint16_t version : {0, 2, 65535}) {
    INFO("version " << version);
    check_refused({envelope_bytes(cancel, version), body},
                  "protocol version " + std::to_string(version) + " is not the supported 1");
  }
  const auto no_version = pack_with([&](packer& p) {
    p.pack_map(1);
    p.pack("type").pack(cancel);
  });
  check_refused({no_version, body}, "envelope has no 'version' field");
  const auto no_type = pack_with([](packer& p) {
    p.pack_map(1);
    p.pack("version").pack(msg::protocol_version);
  });
  check_refused({no_type, body}, "envelope has no 'type' field");
}

TEST_CASE("a message with too few or too many frames is refused") {
  const auto frames = msg::samples::sample_frames<msg::submit>();  // 3 frames
  check_refused({}, "at least 2 frames");
  check_refused({frames[0]}, "at least 2 frames");
  check_refused({frames[0], frames[1]}, "submit: expected 3 frames, got 2");
  check_refused({frames[0], frames[1], frames[2], ""}, "submit: expected 3 frames, got 4");
  msg::frames nine = frames;
  nine.resize(9);
  check_refused(nine, "too many frames");
  msg::codec_limits three;
  three.max_frames = 3;
  check_refused({frames[0], frames[1], frames[2], ""}, "too many frames", three);
  CHECK(receive_error(frames, three).empty());
  // decode_body alone checks the count too
  auto body = msg::decode_body<msg::cancel>(frames);
  REQUIRE_FALSE(body.ok());
  CHECK(body.error() == "cancel: expected 2 frames, got 3");
}

TEST_CASE("a raw frame whose size is not a multiple of the element size is refused") {
  auto submit = msg::samples::sample_frames<msg::submit>();
  submit[2].resize(7);
  check_refused(submit, "submit: raw frame size is not a whole number of elements");
  auto batch = msg::samples::sample_frames<msg::token_batch>();
  batch[2].resize(12);  // request ids are 8 bytes each
  check_refused(batch, "token_batch: raw frame size");
  batch = msg::samples::sample_frames<msg::token_batch>();
  batch[4] += '\0';  // the last frame
  check_refused(batch, "token_batch: raw frame size");
}

TEST_CASE("frames over the size limit are refused") {
  SUBCASE("a raw frame over the default 64 MiB") {
    auto frames = msg::samples::sample_frames<msg::submit>();
    frames[2].assign(msg::codec_limits{}.max_frame_bytes + 4, '\0');
    check_refused(frames, "frame exceeds the size limit");
  }
  msg::codec_limits small;
  small.max_frame_bytes = 64;
  SUBCASE("an envelope over the limit") {
    auto env = msg::samples::sample_envelope();
    env.src.assign(100, 'n');
    check_refused(msg::encode(env, msg::cancel{}), "frame exceeds the size limit", small);
  }
  SUBCASE("a body over the limit") {
    check_refused(msg::encode(msg::envelope{}, msg::kv_nack{.reason = std::string(100, 'x')}),
                  "frame exceeds the size limit", small);
  }
  SUBCASE("decode_body alone refuses an oversized body or raw frame") {
    auto big_body = msg::encode(msg::envelope{}, msg::kv_nack{.reason = std::string(100, 'x')});
    auto body = msg::decode_body<msg::kv_nack>(big_body, small);
    REQUIRE_FALSE(body.ok());
    CHECK(body.error() ==
          "kv_nack body: frame of " + std::to_string(big_body[1].size()) + " bytes exceeds the limit");
    msg::kv_pull big;
    big.block_ids.resize(17);
    auto big_raw = msg::encode(msg::envelope{}, big);
    auto pull = msg::decode_body<msg::kv_pull>(big_raw, small);
    REQUIRE_FALSE(pull.ok());
    CHECK(pull.error() == "kv_pull: raw frame of 68 bytes exceeds the limit");
  }
}

TEST_CASE("msgpack containers and strings over the limits are refused") {
  using msg::type_id;
  const std::size_t items = msg::codec_limits{}.max_container_items;
  SUBCASE("an array with one item over the limit") {
    const auto body = body_with("sampling", [&](packer& p) {
      p.pack_map(1);
      p.pack("stop_token_ids").pack(std::vector<int32_t>(items + 1, 7));
    });
    check_refused(message(type_id::submit, body, {""}), "submit body: malformed msgpack: array size overflow");
    const auto at_limit = body_with("sampling", [&](packer& p) {
      p.pack_map(1);
      p.pack("stop_token_ids").pack(std::vector<int32_t>(items, 7));
    });
    CHECK(receive_error(message(type_id::submit, at_limit, {""})).empty());
  }
  SUBCASE("a map with one entry over the limit") {
    std::map<std::string, uint64_t> counters;
    for (std::size_t i = 0; i <= items; ++i) counters["c" + std::to_string(i)] = i;
    const auto body = body_with("counters", [&](packer& p) { p.pack(counters); });
    check_refused(message(type_id::stats_reply, body), "stats_reply body: malformed msgpack: map size overflow");
  }
  SUBCASE("a container header that claims more items than the frame holds") {
    check_refused(message(type_id::cancel, std::string("\xdf\xff\xff\xff\xff", 5)), "map size overflow");
    // within the limit, but the items are missing
    check_refused(message(type_id::cancel, map_with_value_bytes("request_id", std::string("\xdc\xff\xff\x01", 4))),
                  "cancel body: malformed msgpack: insufficient bytes");
  }
  msg::codec_limits small;
  small.max_string_bytes = 16;
  SUBCASE("a string over the limit") {
    check_refused(msg::encode(msg::envelope{}, msg::kv_nack{.reason = std::string(17, 'x')}),
                  "kv_nack body: malformed msgpack: str size overflow", small);
    CHECK(receive_error(msg::encode(msg::envelope{}, msg::kv_nack{.reason = std::string(16, 'x')}), small)
              .empty());
  }
  SUBCASE("bin and ext values over the limit") {
    const auto bin = body_with("reason", [](packer& p) { p.pack_bin(17).pack_bin_body("0123456789abcdefg", 17); });
    check_refused(message(type_id::kv_nack, bin), "bin size overflow", small);
    const auto ext = body_with("reason", [](packer& p) { p.pack_ext(17, 1).pack_ext_body("0123456789abcdefg", 17); });
    check_refused(message(type_id::kv_nack, ext), "ext size overflow", small);
  }
}

TEST_CASE("trailing bytes after the envelope or body are refused") {
  auto frames = msg::samples::sample_frames<msg::kv_moved>();
  auto env = frames;
  env[0] += '\0';
  check_refused(env, "envelope: trailing bytes after the msgpack value");
  auto body = frames;
  body[1] += pack_value(1);  // a second, complete msgpack value
  check_refused(body, "kv_moved body: trailing bytes after the msgpack value");
}

TEST_CASE("nesting deeper than the limit is refused, however deep") {
  const std::size_t depth = msg::codec_limits{}.max_depth;
  for (const std::size_t levels : {depth + 1, std::size_t{100000}}) {
    INFO(levels << " nested arrays");
    check_refused(message(msg::type_id::kv_nack, map_with_value_bytes("future", nested_arrays(levels))),
                  "kv_nack body: malformed msgpack: depth size overflow");
  }
  // within the limit, an unknown key holding nested data is skipped (forward compatibility)
  const auto shallow = map_with_value_bytes("future", nested_arrays(8));
  CHECK(receive_error(message(msg::type_id::kv_nack, shallow)).empty());
  // the envelope has the same limit
  const auto deep_envelope = pack_with([](packer& p) {
    p.pack_map(3);
    p.pack("version").pack(msg::protocol_version);
    p.pack("type").pack(static_cast<uint16_t>(msg::type_id::kv_nack));
    p.pack("future");
  }) + nested_arrays(depth + 1);
  check_refused({deep_envelope, pack_value(std::map<std::string, int>{})}, "envelope: malformed msgpack: depth");
}

TEST_CASE("an empty frame is refused as incomplete msgpack") {
  check_refused({"", pack_value(std::map<std::string, int>{})}, "envelope: malformed msgpack: insufficient bytes");
  check_refused(message(msg::type_id::cancel, ""), "cancel body: malformed msgpack: insufficient bytes");
}

// ================================================================ dispatch

namespace {
struct recorder {
  std::vector<std::string> calls;
  void operator()(const msg::envelope& env, msg::submit& m) {
    calls.push_back("submit " + std::to_string(m.request_id) + " from " + env.src);
  }
  void operator()(const msg::envelope&, msg::cancel& m) {
    calls.push_back("cancel " + std::to_string(m.request_id));
  }
};

msg::dispatch_outcome dispatch_frames(const msg::frames& frames, recorder& handler) {
  auto env = msg::decode_envelope(frames);
  REQUIRE_MESSAGE(env.ok(), env.error());
  return msg::dispatch(*env, frames, handler);
}
}  // namespace

TEST_CASE("dispatch calls the handler overload for the message's type") {
  recorder handler;
  msg::envelope env;
  env.src = "client-9/client";
  msg::submit submit;
  submit.request_id = 7;
  submit.prompt_tokens = {1, 2};
  auto outcome = dispatch_frames(msg::encode(env, submit), handler);
  CHECK(outcome.status == msg::dispatch_status::handled);
  outcome = dispatch_frames(msg::encode(env, msg::cancel{.request_id = 7}), handler);
  CHECK(outcome.status == msg::dispatch_status::handled);
  CHECK(handler.calls == std::vector<std::string>{"submit 7 from client-9/client", "cancel 7"});
}

TEST_CASE("dispatch reports unhandled, and calls nothing, when the handler does not take the type") {
  recorder handler;
  const auto outcome = dispatch_frames(msg::samples::sample_frames<msg::finish>(), handler);
  CHECK(outcome.status == msg::dispatch_status::unhandled);
  CHECK(outcome.error.empty());
  CHECK(handler.calls.empty());
  // an envelope built by hand with a type outside the catalogue is unhandled as well
  msg::envelope stranger;
  stranger.type = 9999;
  CHECK(msg::dispatch(stranger, msg::samples::sample_frames<msg::cancel>(), handler).status ==
        msg::dispatch_status::unhandled);
  CHECK(handler.calls.empty());
}

TEST_CASE("dispatch reports malformed, and calls nothing, when the body does not decode") {
  recorder handler;
  auto frames = msg::samples::sample_frames<msg::submit>();
  frames[2].resize(3);
  auto outcome = dispatch_frames(frames, handler);
  CHECK(outcome.status == msg::dispatch_status::malformed);
  CHECK(outcome.error == "submit: raw frame size is not a whole number of elements");

  // a cancel's envelope in front of a submit's body and raw frame
  frames = msg::samples::sample_frames<msg::submit>();
  frames[0] = msg::samples::sample_frames<msg::cancel>()[0];
  outcome = dispatch_frames(frames, handler);
  CHECK(outcome.status == msg::dispatch_status::malformed);
  CHECK(outcome.error == "cancel: expected 2 frames, got 3");

  outcome = dispatch_frames(
      message(msg::type_id::cancel, body_with("request_id", [](packer& p) { p.pack("x"); })), handler);
  CHECK(outcome.status == msg::dispatch_status::malformed);
  CHECK(outcome.error == "cancel body: field 'request_id' has the wrong type or is out of range");
  CHECK(handler.calls.empty());
}

// ================================================================ forward compatibility

TEST_CASE("a body with an unknown extra key decodes, keeping the known fields") {
  const auto body = pack_with([](packer& p) {
    p.pack_map(3);
    p.pack("request_id").pack(44);
    p.pack("priority_from_v2").pack(std::map<std::string, std::vector<int>>{{"x", {1, 2}}});
    p.pack("trace").pack_nil();
  });
  auto decoded = msg::decode_body<msg::cancel>(message(msg::type_id::cancel, body));
  REQUIRE_MESSAGE(decoded.ok(), decoded.error());
  CHECK(decoded->request_id == 44);

  // the envelope is a map as well
  const auto envelope = pack_with([](packer& p) {
    p.pack_map(3);
    p.pack("version").pack(msg::protocol_version);
    p.pack("type").pack(static_cast<uint16_t>(msg::type_id::cancel));
    p.pack("trace_id").pack("abc");
  });
  auto env = msg::decode_envelope({envelope, body});
  REQUIRE_MESSAGE(env.ok(), env.error());
  CHECK(env->src.empty());
  CHECK(env->deadline_ms == 0);
}

TEST_CASE("a body missing a key keeps that field's default") {
  const auto body = pack_with([](packer& p) {
    p.pack_map(2);
    p.pack("request_id").pack(9);
    p.pack("sampling");
    p.pack_map(1);
    p.pack("max_new_tokens").pack(5);
  });
  auto decoded = msg::decode_body<msg::submit>(message(msg::type_id::submit, body, {""}));
  REQUIRE_MESSAGE(decoded.ok(), decoded.error());
  msg::submit expected;
  expected.request_id = 9;
  expected.sampling.max_new_tokens = 5;
  CHECK(*decoded == expected);

  for_each_message([]<class M>(tag<M>) {
    INFO("message " << msg::to_string(M::id));
    const auto frames = message(M::id, pack_value(std::map<std::string, int>{}),
                                std::vector<std::string>(raw_count<M>()));
    auto empty = msg::decode_body<M>(frames);
    REQUIRE_MESSAGE(empty.ok(), empty.error());
    CHECK(*empty == M{});
  });
}

TEST_CASE("numbers decode from any msgpack width a peer in another language writes") {
  // Python's msgpack writes floats as float64 and whole numbers as the smallest integer.
  const auto body = pack_with([](packer& p) {
    p.pack_map(2);
    p.pack("request_id").pack(uint8_t{3});
    p.pack("sampling");
    p.pack_map(3);
    p.pack("temperature").pack(0.5);  // float64
    p.pack("top_p").pack(1);          // integer for a float field
    p.pack("top_k").pack(uint64_t{50});
  });
  auto decoded = msg::decode_body<msg::submit>(message(msg::type_id::submit, body, {""}));
  REQUIRE_MESSAGE(decoded.ok(), decoded.error());
  CHECK(decoded->request_id == 3);
  CHECK(decoded->sampling.temperature == 0.5f);
  CHECK(decoded->sampling.top_p == 1.0f);
  CHECK(decoded->sampling.top_k == 50);
}

TEST_CASE("an enum value from a newer peer decodes to its number, for the receiver to judge") {
  const auto body = pack_with([](packer& p) {
    p.pack_map(2);
    p.pack("request_id").pack(1);
    p.pack("reason").pack(9);
  });
  auto decoded = msg::decode_body<msg::finish>(message(msg::type_id::finish, body));
  REQUIRE_MESSAGE(decoded.ok(), decoded.error());
  CHECK(static_cast<int>(decoded->reason) == 9);
  CHECK(msg::to_string(decoded->reason) == "unknown");
  // but not one beyond the enum's underlying type
  const auto wide = body_with("reason", [](packer& p) { p.pack(256); });
  check_refused(message(msg::type_id::finish, wide), "field 'reason'");
}

namespace {

/// One struct decoded two ways: DUET_MSGPACK_MAP and msgpack-c's MSGPACK_DEFINE_MAP, the
/// reference for what a map means (unknown keys, missing fields, repeated keys, bad keys).
struct fields {
  uint32_t id = 7;
  std::string name = "unset";
  std::vector<int32_t> tokens;
  double weight = 0.5;
};
struct fields_ours : fields {
  DUET_MSGPACK_MAP(id, name, tokens, weight);
};
struct fields_reference : fields {
  MSGPACK_DEFINE_MAP(id, name, tokens, weight);
};

/// A map of `pairs` key/value objects, packed as written (keys may repeat or not be strings).
template <class Fill>
std::string packed_map(uint32_t pairs, Fill fill) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(pairs);
  fill(pk);
  return std::string(buffer.data(), buffer.size());
}

/// Decodes `bytes` both ways: both fail, or both give the same fields.
void decodes_as_reference(const std::string& bytes) {
  auto handle = msgpack::unpack(bytes.data(), bytes.size());
  fields_ours ours;
  fields_reference ref;
  bool ours_ok = true, ref_ok = true;
  try { handle.get().convert(ours); } catch (const std::exception&) { ours_ok = false; }
  try { handle.get().convert(ref); } catch (const std::exception&) { ref_ok = false; }
  REQUIRE(ours_ok == ref_ok);
  if (!ours_ok) return;
  CHECK(ours.id == ref.id);
  CHECK(ours.name == ref.name);
  CHECK(ours.tokens == ref.tokens);
  CHECK(ours.weight == ref.weight);
}

}  // namespace

TEST_CASE("DUET_MSGPACK_MAP decodes every map as MSGPACK_DEFINE_MAP does, and encodes the same bytes") {
  using packer = msgpack::packer<msgpack::sbuffer>;
  SUBCASE("encoding") {
    fields_ours ours;
    ours.tokens = {1, -2, 3};
    fields_reference ref;
    ref.tokens = {1, -2, 3};
    msgpack::sbuffer a, b;
    msgpack::pack(a, ours);
    msgpack::pack(b, ref);
    CHECK(std::string(a.data(), a.size()) == std::string(b.data(), b.size()));
  }
  SUBCASE("all fields, out of order") {
    decodes_as_reference(packed_map(4, [](packer& pk) {
      pk.pack("weight"), pk.pack(2.5), pk.pack("tokens"), pk.pack(std::vector<int32_t>{4, 5});
      pk.pack("name"), pk.pack("x"), pk.pack("id"), pk.pack(11);
    }));
  }
  SUBCASE("missing fields keep their defaults; unknown keys are skipped") {
    decodes_as_reference(packed_map(3, [](packer& pk) {
      pk.pack("name"), pk.pack("y"), pk.pack("an_unknown_key"), pk.pack(std::vector<int>{1}), pk.pack("i"), pk.pack(3);
    }));
  }
  SUBCASE("a repeated key: the first one counts") {
    decodes_as_reference(packed_map(3, [](packer& pk) {
      pk.pack("id"), pk.pack(1), pk.pack("id"), pk.pack(2), pk.pack("name"), pk.pack("z");
    }));
  }
  SUBCASE("a repeated key whose second value has the wrong type") {
    decodes_as_reference(packed_map(2, [](packer& pk) { pk.pack("id"), pk.pack(1), pk.pack("id"), pk.pack("text"); }));
  }
  SUBCASE("a key that is not a string is refused") {
    decodes_as_reference(packed_map(2, [](packer& pk) { pk.pack("id"), pk.pack(1), pk.pack(5), pk.pack(6); }));
  }
  SUBCASE("a field of the wrong type is refused") {
    decodes_as_reference(packed_map(1, [](packer& pk) { pk.pack("tokens"), pk.pack("not an array"); }));
  }
  SUBCASE("not a map at all") {
    msgpack::sbuffer buffer;
    msgpack::pack(buffer, std::vector<int>{1, 2});
    decodes_as_reference(std::string(buffer.data(), buffer.size()));
  }
  SUBCASE("an empty map, and a key that is a prefix of a field's name") {
    decodes_as_reference(packed_map(0, [](packer&) {}));
    decodes_as_reference(packed_map(2, [](packer& pk) { pk.pack("nam"), pk.pack("p"), pk.pack("names"), pk.pack("q"); }));
  }
}
