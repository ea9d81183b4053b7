// decode_frames: the C++ codec as a command-line filter, so that encoders in other languages
// (scripts/duet_client.py) can be checked against it.
//
//   decode_frames < stream        one JSON line per message: what the C++ receive path decoded
//   decode_frames --emit-replies REQUEST_ID CLIENT_ADDRESS > stream
//                                 writes what a cluster answers to a submit: admitted, two
//                                 token_batch steps (also carrying another request's token),
//                                 and finish (reason length)
//
// Stream format (both directions): a sequence of messages, each a 4-byte little-endian frame
// count followed by that many frames, each a 4-byte little-endian length and its bytes.
//
// Output per message, decoded:  {"ok":true,"envelope":{...},"type_name":"submit","frames":3,
//                                 "body":{...fields as the decoder understood them...},
//                                 "raw":[[...],...]}   (raw frames in raw() order)
//                     refused:  {"ok":false,"error":"..."}
// Exit status: 0 every message decoded, 1 some message was refused, 2 the stream is cut short
// or the arguments are wrong.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

#include "messages/codec.hpp"
#include "messages/dispatch.hpp"

namespace msg = duet::msg;
using json = nlohmann::json;

namespace {

bool read_u32(std::istream& in, uint32_t& value) {
  unsigned char bytes[4];
  if (!in.read(reinterpret_cast<char*>(bytes), 4)) return false;
  value = bytes[0] | (bytes[1] << 8) | (bytes[2] << 16) | (uint32_t{bytes[3]} << 24);
  return true;
}

void write_u32(std::ostream& out, uint32_t value) {
  const char bytes[4] = {static_cast<char>(value & 0xff), static_cast<char>((value >> 8) & 0xff),
                         static_cast<char>((value >> 16) & 0xff), static_cast<char>(value >> 24)};
  out.write(bytes, 4);
}

void write_message(std::ostream& out, const msg::frames& frames) {
  write_u32(out, static_cast<uint32_t>(frames.size()));
  for (const auto& f : frames) {
    write_u32(out, static_cast<uint32_t>(f.size()));
    out.write(f.data(), static_cast<std::streamsize>(f.size()));
  }
}

json to_json(const msgpack::object& o) {
  switch (o.type) {
    case msgpack::type::NIL: return nullptr;
    case msgpack::type::BOOLEAN: return o.via.boolean;
    case msgpack::type::POSITIVE_INTEGER: return o.via.u64;
    case msgpack::type::NEGATIVE_INTEGER: return o.via.i64;
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return o.via.f64;
    case msgpack::type::STR: return std::string(o.via.str.ptr, o.via.str.size);
    case msgpack::type::BIN: return std::string(o.via.bin.ptr, o.via.bin.size);
    case msgpack::type::ARRAY: {
      json out = json::array();
      for (uint32_t i = 0; i < o.via.array.size; ++i) out.push_back(to_json(o.via.array.ptr[i]));
      return out;
    }
    case msgpack::type::MAP: {
      json out = json::object();
      for (uint32_t i = 0; i < o.via.map.size; ++i) {
        out[o.via.map.ptr[i].key.as<std::string>()] = to_json(o.via.map.ptr[i].val);
      }
      return out;
    }
    case msgpack::type::EXT: return "<ext>";
  }
  return nullptr;
}

json unpack_json(const msg::frame& bytes) {
  const auto handle = msgpack::unpack(bytes.data(), bytes.size());
  return to_json(handle.get());
}

json describe(const msg::frames& frames) {
  auto env = msg::decode_envelope(frames);
  if (!env) return {{"ok", false}, {"error", env.error()}};
  json out;
  const auto outcome = msg::dispatch(*env, frames, [&](const msg::envelope& e, auto& message) {
    // What the decoder understood: the decoded struct encoded again (defaults filled in,
    // unknown keys gone).
    const auto again = msg::encode(e, message);
    out = {{"ok", true},
           {"envelope", unpack_json(again[0])},
           {"type_name", std::string(msg::to_string(static_cast<msg::type_id>(e.type)))},
           {"frames", frames.size()},
           {"body", unpack_json(again[1])},
           {"raw", json::array()}};
    std::apply([&](auto&... array) { (out["raw"].push_back(array), ...); }, message.raw());
  });
  if (outcome.status == msg::dispatch_status::malformed) return {{"ok", false}, {"error", outcome.error}};
  return out;
}

int decode_stream() {
  std::ios::sync_with_stdio(false);
  bool all_ok = true;
  uint32_t count = 0;
  while (read_u32(std::cin, count)) {
    if (count > 64) {
      std::cerr << "decode_frames: a message of " << count << " frames; is this the stream format?\n";
      return 2;
    }
    msg::frames frames(count);
    for (auto& f : frames) {
      uint32_t length = 0;
      if (!read_u32(std::cin, length)) {
        std::cerr << "decode_frames: the stream ends inside a message\n";
        return 2;
      }
      f.resize(length);
      if (length > 0 && !std::cin.read(f.data(), length)) {
        std::cerr << "decode_frames: the stream ends inside a frame\n";
        return 2;
      }
    }
    const json line = describe(frames);
    all_ok = all_ok && line.at("ok").get<bool>();
    std::cout << line.dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
  }
  if (std::cin.gcount() != 0) {
    std::cerr << "decode_frames: the stream ends inside a frame count\n";
    return 2;
  }
  return all_ok ? 0 : 1;
}

int emit_replies(uint64_t request_id, const std::string& client) {
  msg::envelope env;
  env.dst = client;
  env.correlation = request_id;
  env.src = "n0/router";
  write_message(std::cout, msg::encode(env, msg::admitted{.request_id = request_id, .prompt_tokens = 3, .queue_position = 0}));
  env.src = "n0/decode0";
  msg::token_batch first;
  first.request_ids = {request_id};
  first.tokens = {791};
  first.positions = {0};
  write_message(std::cout, msg::encode(env, first));
  msg::token_batch next;
  next.request_ids = {request_id + 1, request_id};
  next.tokens = {5, 4320};
  next.positions = {7, 1};
  write_message(std::cout, msg::encode(env, next));
  write_message(std::cout, msg::encode(env, msg::finish{.request_id = request_id,
                                                        .reason = msg::finish_reason::length,
                                                        .code = msg::error_code::none,
                                                        .message = "",
                                                        .prompt_tokens = 3,
                                                        .completion_tokens = 2}));
  std::cout.flush();
  return std::cout ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage =
      "usage: decode_frames < stream\n"
      "       decode_frames --emit-replies REQUEST_ID CLIENT_ADDRESS > stream\n";
  if (argc == 1) return decode_stream();
  if (argc == 4 && std::string(argv[1]) == "--emit-replies") {
    try {
      return emit_replies(std::stoull(argv[2]), argv[3]);
    } catch (const std::exception&) {
      std::cerr << "decode_frames: REQUEST_ID must be a whole number, got '" << argv[2] << "'\n" << usage;
      return 2;
    }
  }
  std::cerr << usage;
  return 2;
}
