#pragma once
// The stream transfer path: KV block bytes as chunked, checksummed, flow-controlled
// messages over the control plane (ZeroMQ inproc, ipc or tcp, whichever links the nodes).
// It works between any two pools whose engines can read and write block bytes, so it is
// the path of last resort and the one every deployment has.
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "messages/catalogue.hpp"
#include "runtime/engine.hpp"
#include "runtime/outbox.hpp"

namespace duet {

struct kv_stream_settings {
  uint64_t chunk_bytes = uint64_t{4} << 20;  // rounded down to whole blocks, at least one
  uint32_t window = 4;                       // chunks in flight beyond the last ack
};

/// XXH3-64 of a chunk's bytes: catches corruption on the way at memory speed.
[[nodiscard]] uint64_t kv_checksum(std::span<const std::byte> bytes);

/// Microseconds on a steady clock: the stream counters add up where a transfer's time goes
/// (stream_read_us: the owner's block reads and checksums; stream_write_us: the adopter's).
[[nodiscard]] uint64_t kv_stream_clock_us();

/// Owner side: streams the blocks of each handle to its adopter, `window` chunks ahead of
/// the adopter's acks, so a slow receiver bounds the memory in flight.
class kv_stream_sender {
 public:
  kv_stream_sender(const engine& engine, outbox& out, kv_stream_settings settings);

  /// Starts streaming `blocks` of `handle_id` to `to` (the broker's kv_send); a repeated start
  /// is ignored. A stream begun by pre_send goes on from the adopter's last ack.
  void start(uint64_t handle_id, const std::string& to, std::vector<uint32_t> blocks);
  /// broker.stream_prefill: sends the first `ready` of `blocks` (the finished ones of a prompt
  /// still being prefilled) to the decode worker reserved for it, ahead of the broker's go.
  void pre_send(uint64_t handle_id, const std::string& to, const std::vector<uint32_t>& blocks, uint32_t ready);
  void on_ack(const std::string& from, const msg::kv_chunk_ack& m);
  /// The handle was released (or its blocks reclaimed): stop sending.
  void stop(uint64_t handle_id);

  [[nodiscard]] std::size_t active() const { return streams_.size(); }
  [[nodiscard]] uint32_t blocks_per_chunk() const { return blocks_per_chunk_; }
  [[nodiscard]] const std::map<std::string, uint64_t>& counters() const { return counters_; }

 private:
  struct stream {
    std::string to;
    std::vector<uint32_t> blocks;
    uint32_t sent = 0;   // blocks sent
    uint32_t acked = 0;  // blocks the adopter has written
    uint32_t ready = 0;  // blocks that may be sent (all, but while pre_send streams a prompt)
    bool pulled = true;  // the broker's kv_send came; a pre-sent stream waits for it to end
    uint32_t resent_from = 0;  // acked + 1 of the last resend (0: none): one per lost chunk
  };
  void pump(uint64_t handle_id, stream& s);

  const engine& engine_;
  outbox& out_;
  uint32_t blocks_per_chunk_;
  uint32_t window_;
  std::unordered_map<uint64_t, stream> streams_;
  std::map<std::string, uint64_t> counters_;
};

/// Adopter side of one handle: checks each chunk and writes it into the destination blocks.
class kv_stream_receiver {
 public:
  enum class status { partial, complete, failed, duplicate, gap };

  /// For a stream begun during prefill: a chunk after a lost one is a `gap`, not a failure;
  /// the adopter acks again what it has, and the owner resends from there.
  void allow_gaps() { allow_gaps_ = true; }

  /// `dest` are the adopter's blocks, in the order of the handle's blocks. A chunk already
  /// written (resent after a stream began during prefill went on) is `duplicate`: ack again.
  [[nodiscard]] status on_chunk(engine& engine, std::span<const uint32_t> dest, const msg::kv_chunk& m);
  [[nodiscard]] bool complete() const { return total_ > 0 && received_ == total_; }
  [[nodiscard]] uint32_t received() const { return received_; }
  [[nodiscard]] uint64_t bytes() const { return bytes_; }
  [[nodiscard]] const std::string& error() const { return error_; }

 private:
  status fail(std::string why);
  uint32_t received_ = 0;
  uint32_t total_ = 0;  // from the first chunk; every later one must agree
  bool allow_gaps_ = false;
  uint64_t bytes_ = 0;
  std::string error_;
};

}  // namespace duet
