// libFuzzer target for the receive path of every node: decode_envelope, then dispatch to a
// handler that takes every message type. Built and run by scripts/fuzz.sh.
//
// Input format: up to 8 frames, each a 2-byte little-endian length and then that many bytes
// (fewer when the input ends first). A lone trailing byte is a frame of its own.
//
// Beyond "no crash, no leak, no undefined behaviour" the target checks three properties:
// every refusal carries a message; every envelope that decodes names a catalogue type, so
// dispatch never says "unhandled" to a handler taking all of them; and a decoded message
// encodes, decodes and encodes again to the same bytes.
//
// With DUET_FUZZ_WRITE_SEEDS=<dir> in the environment it first writes the seed corpus there:
// one sample of every message type (tests/message_samples.hpp) in the format above.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "messages/codec.hpp"
#include "messages/dispatch.hpp"
#include "tests/message_samples.hpp"

namespace msg = duet::msg;

namespace {

constexpr std::size_t max_fuzz_frames = 8;

msg::frames split_frames(const uint8_t* data, std::size_t size) {
  msg::frames out;
  std::size_t at = 0;
  while (at < size && out.size() < max_fuzz_frames) {
    if (size - at < 2) {
      out.emplace_back(reinterpret_cast<const char*>(data + at), size - at);
      break;
    }
    const std::size_t length = std::min<std::size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
    at += 2;
    out.emplace_back(reinterpret_cast<const char*>(data + at), length);
    at += length;
  }
  return out;
}

std::string join_frames(const msg::frames& frames) {
  std::string out;
  for (const auto& f : frames) {
    if (f.size() > 0xffff) std::abort();  // samples are small; a seed must be representable
    out += static_cast<char>(f.size() & 0xff);
    out += static_cast<char>(f.size() >> 8);
    out += f;
  }
  return out;
}

[[noreturn]] void property_failed(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_decode: %s: %s\n", what, detail.c_str());
  std::abort();
}

struct round_trip_check {
  template <class M>
  void operator()(const msg::envelope& env, M& message) const {
    const msg::frames once = msg::encode(env, message);
    auto env2 = msg::decode_envelope(once);
    if (!env2) property_failed("re-encoded envelope does not decode", env2.error());
    auto body2 = msg::decode_body<M>(once);
    if (!body2) property_failed("re-encoded body does not decode", body2.error());
    if (msg::encode(*env2, *body2) != once) {
      property_failed("encoding is not stable", std::string(msg::to_string(M::id)));
    }
  }
};

void receive(const msg::frames& frames, const msg::codec_limits& limits) {
  auto env = msg::decode_envelope(frames, limits);
  if (!env) {
    if (env.error().empty()) property_failed("refused without a message", "decode_envelope");
    return;
  }
  const auto outcome = msg::dispatch(*env, frames, round_trip_check{}, limits);
  switch (outcome.status) {
    case msg::dispatch_status::handled: break;
    case msg::dispatch_status::malformed:
      if (outcome.error.empty()) property_failed("refused without a message", "dispatch");
      break;
    case msg::dispatch_status::unhandled:
      property_failed("decode_envelope accepted a type dispatch does not know", std::to_string(env->type));
  }
}

void write_seeds(const std::string& dir) {
  int written = 0;
  msg::samples::for_each_message([&]<class M>(msg::samples::tag<M>) {
    const std::string path = dir + "/seed-" + std::string(msg::to_string(M::id));
    std::ofstream(path, std::ios::binary) << join_frames(msg::samples::sample_frames<M>());
    ++written;
  });
  // a default-valued message of the commonest kind, and a refused one
  std::ofstream(dir + "/seed-submit-defaults", std::ios::binary)
      << join_frames(msg::encode(msg::envelope{}, msg::submit{}));
  std::ofstream(dir + "/seed-too-few-frames", std::ios::binary)
      << join_frames({msg::samples::sample_frames<msg::cancel>()[0]});
  std::fprintf(stderr, "fuzz_decode: wrote %d seeds to %s\n", written + 2, dir.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("DUET_FUZZ_WRITE_SEEDS")) write_seeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const msg::frames frames = split_frames(data, size);
  receive(frames, msg::codec_limits{});
  // tight limits reach the overflow paths with small inputs
  msg::codec_limits tight;
  tight.max_frames = 4;
  tight.max_frame_bytes = 512;
  tight.max_container_items = 8;
  tight.max_string_bytes = 32;
  tight.max_depth = 4;
  receive(frames, tight);
  return 0;
}
