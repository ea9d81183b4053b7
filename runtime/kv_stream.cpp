#include "runtime/kv_stream.hpp"

#include <algorithm>
#include <chrono>

#include <xxhash.h>

namespace duet {

uint64_t kv_checksum(std::span<const std::byte> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

uint64_t kv_stream_clock_us() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

kv_stream_sender::kv_stream_sender(const engine& engine, outbox& out, kv_stream_settings settings)
    : engine_(engine),
      out_(out),
      blocks_per_chunk_(static_cast<uint32_t>(
          std::max<uint64_t>(1, settings.chunk_bytes / std::max<uint64_t>(engine.info().block_bytes, 1)))),
      window_(std::max<uint32_t>(settings.window, 1)) {}

void kv_stream_sender::start(uint64_t handle_id, const std::string& to, std::vector<uint32_t> blocks) {
  if (auto it = streams_.find(handle_id); it != streams_.end()) {
    stream& s = it->second;
    if (s.pulled) {
      ++counters_["stream_duplicate_starts"];
      return;
    }
    // Begun during prefill: go on from the adopter's last ack (chunks in flight beyond it are
    // sent again; the receiver acks those as duplicates).
    ++counters_["streams_started"];
    ++counters_["stream_prefill_pulls"];
    s.pulled = true;
    if (s.to != to) {  // another adopter than the reserved one: from the start
      s.to = to;
      s.acked = 0;
    }
    s.blocks = std::move(blocks);
    s.ready = static_cast<uint32_t>(s.blocks.size());
    s.sent = s.acked;
    if (s.acked == s.blocks.size()) {
      ++counters_["streams_finished"];
      streams_.erase(it);  // all of it arrived during prefill
      return;
    }
    pump(handle_id, s);
    return;
  }
  ++counters_["streams_started"];
  auto& s = streams_[handle_id];
  s.to = to;
  s.blocks = std::move(blocks);
  s.ready = static_cast<uint32_t>(s.blocks.size());
  pump(handle_id, s);
}

void kv_stream_sender::pre_send(uint64_t handle_id, const std::string& to, const std::vector<uint32_t>& blocks,
                                uint32_t ready) {
  auto [it, fresh] = streams_.try_emplace(handle_id);
  stream& s = it->second;
  if (fresh) {
    ++counters_["stream_prefill_streams"];
    s.to = to;
    s.blocks = blocks;
    s.pulled = false;
  }
  if (s.pulled) return;  // the broker's go came first: everything is ready already
  s.ready = std::max(s.ready, std::min<uint32_t>(ready, static_cast<uint32_t>(s.blocks.size())));
  pump(handle_id, s);
}

void kv_stream_sender::on_ack(const std::string& from, const msg::kv_chunk_ack& m) {
  auto it = streams_.find(m.handle_id);
  if (it == streams_.end() || it->second.to != from) {
    ++counters_["stream_stale_acks"];
    return;
  }
  stream& s = it->second;
  s.acked = std::clamp(m.received, s.acked, s.sent);
  if (m.resend && s.sent > s.acked && s.resent_from != s.acked + 1) {
    // The adopter of a stream begun during prefill saw a gap: send again from its last ack,
    // once per lost chunk (the chunks after the gap each ask).
    s.resent_from = s.acked + 1;
    s.sent = s.acked;
    ++counters_["stream_resends"];
  }
  if (s.acked == s.blocks.size()) {
    if (!s.pulled) return;  // sent during prefill: the broker's kv_send ends it
    ++counters_["streams_finished"];
    streams_.erase(it);  // the blocks stay ours until the broker's kv_release
    return;
  }
  pump(m.handle_id, s);
}

void kv_stream_sender::stop(uint64_t handle_id) {
  if (streams_.erase(handle_id) > 0) ++counters_["streams_stopped"];
}

void kv_stream_sender::pump(uint64_t handle_id, stream& s) {
  const uint64_t block_bytes = engine_.info().block_bytes;
  const auto total = static_cast<uint32_t>(s.blocks.size());
  while (s.sent < s.ready && s.sent - s.acked < window_ * blocks_per_chunk_) {
    // During prefill only whole chunks go (the receiver's chunks must line up with a resend
    // from an ack), and the rest once every block is ready.
    const uint32_t count = std::min(blocks_per_chunk_, total - s.sent);
    if (s.sent + count > s.ready) break;
    msg::kv_chunk chunk;
    chunk.handle_id = handle_id;
    chunk.first = s.sent;
    chunk.count = count;
    chunk.total = total;
    chunk.layout_hash = engine_.info().layout_hash;
    chunk.bytes.resize(chunk.count * block_bytes);
    const uint64_t started_us = kv_stream_clock_us();
    if (!engine_.read_blocks(std::span(s.blocks).subspan(chunk.first, chunk.count),
                             std::as_writable_bytes(std::span(chunk.bytes)))) {
      // The adopter must not wait for the timeout: tell it now; it nacks, the broker releases.
      ++counters_["stream_read_failures"];
      out_.send(s.to, msg::kv_moved_failure(handle_id, msg::kv_path::tcp, msg::error_code::internal,
                                            "the KV owner could not read its blocks"));
      streams_.erase(handle_id);
      return;
    }
    chunk.checksum = kv_checksum(std::as_bytes(std::span(chunk.bytes)));
    counters_["stream_read_us"] += kv_stream_clock_us() - started_us;
    s.sent += chunk.count;
    counters_["stream_bytes_sent"] += chunk.bytes.size();
    ++counters_["stream_chunks_sent"];
    out_.send(s.to, std::move(chunk));  // its bytes become the message's raw frame, uncopied
  }
}

kv_stream_receiver::status kv_stream_receiver::fail(std::string why) {
  error_ = std::move(why);
  return status::failed;
}

kv_stream_receiver::status kv_stream_receiver::on_chunk(engine& engine, std::span<const uint32_t> dest,
                                                        const msg::kv_chunk& m) {
  if (!error_.empty()) return status::failed;
  if (received_ > 0 && m.total == total_ && m.count > 0 && uint64_t{m.first} + m.count <= received_) {
    return status::duplicate;
  }
  const auto& info = engine.info();
  if (m.layout_hash != info.layout_hash) return fail("KV chunk has another layout (model, dtype or block size)");
  if (m.first > received_ && allow_gaps_) return status::gap;
  if (m.first != received_) {
    return fail("KV chunk out of order: blocks from " + std::to_string(m.first) + " arrived, " +
                std::to_string(received_) + " expected (a chunk was lost)");
  }
  if (m.total > dest.size() || m.count == 0 || uint64_t{m.first} + m.count > m.total) {
    return fail("KV chunk does not fit the destination: blocks " + std::to_string(m.first) + "+" +
                std::to_string(m.count) + " of " + std::to_string(m.total) + ", " + std::to_string(dest.size()) +
                " reserved");
  }
  if (received_ > 0 && m.total != total_) return fail("KV chunks disagree on the handle's block count");
  if (m.bytes.size() != uint64_t{m.count} * info.block_bytes) return fail("KV chunk size is not count x block bytes");
  const auto bytes = std::as_bytes(std::span(m.bytes));
  if (kv_checksum(bytes) != m.checksum) return fail("KV chunk checksum mismatch (corrupted on the way)");
  if (!engine.write_blocks(dest.subspan(m.first, m.count), bytes)) return fail("KV chunk could not be written");
  total_ = m.total;
  received_ += m.count;
  bytes_ += m.bytes.size();
  return received_ == m.total ? status::complete : status::partial;
}

}  // namespace duet
