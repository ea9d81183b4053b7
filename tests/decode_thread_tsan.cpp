// decode_core with its steps on a step thread, under ThreadSanitizer (tests/step_thread_tsan.cmake):
// while each step computes, this thread adopts sequences (same-pool, import and stream paths),
// cancels some, and ticks. The engine keeps plain, unsynchronized state that its decode, its
// imports, its block writes and its releases all change, so any engine call that the core does
// not hold back for the step's end is a TSan report (exit code 66). Every sequence must also end
// with its tokens, and the pool must come back full.
#include <cstdio>
#include <cstring>
#include <map>
#include <semaphore>
#include <string>
#include <vector>

#include "messages/codec.hpp"
#include "runtime/decode_core.hpp"
#include "runtime/kv_stream.hpp"

namespace {

namespace msg = duet::msg;

class racy_engine final : public duet::engine {
 public:
  racy_engine() : pool_(std::size_t{256} * 64) {
    info_.engine = "cpu";
    info_.model = "tsan";
    info_.vocab_size = 100;
    info_.max_context = 4096;
    info_.block_tokens = 16;
    info_.block_bytes = 64;
    info_.layout_hash = 42;
  }
  [[nodiscard]] const duet::engine_info& info() const override { return info_; }
  [[nodiscard]] duet::step_output prefill(std::span<const duet::prefill_chunk>) override { return {}; }
  [[nodiscard]] duet::step_output decode(std::span<const duet::decode_slot> slots) override {
    duet::step_output out;
    for (const auto& s : slots) {
      ++calls_;  // plain state: a concurrent import, write or release races with this
      ++steps_of_[s.seq_id];
      for (uint32_t b : s.blocks) checksum_ += static_cast<uint8_t>(pool_[b * info_.block_bytes]);
      out.tokens.push_back(static_cast<int32_t>(s.history.size() % 50) + 1);
    }
    return out;
  }
  void release(uint64_t seq_id) override {
    ++calls_;
    steps_of_.erase(seq_id);
  }
  [[nodiscard]] msg::kv_path can_import() const override { return msg::kv_path::host_shm; }
  bool import_blocks(const msg::kv_pool_export&, std::span<const uint32_t> src, std::span<const uint32_t> dst,
                     std::string&) override {
    ++calls_;
    for (std::size_t i = 0; i < src.size(); ++i) pool_[dst[i] * info_.block_bytes] = static_cast<char>(src[i]);
    return true;
  }
  bool write_blocks(std::span<const uint32_t> blocks, std::span<const std::byte> in) override {
    ++calls_;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      std::memcpy(&pool_[blocks[i] * info_.block_bytes], in.data() + i * info_.block_bytes, info_.block_bytes);
    }
    return true;
  }

 private:
  duet::engine_info info_;
  std::vector<char> pool_;
  uint64_t calls_ = 0;
  uint64_t checksum_ = 0;
  std::map<uint64_t, uint64_t> steps_of_;
};

msg::kv_adopt adoption(uint64_t seq, std::size_t prompt_tokens) {
  msg::kv_adopt a;
  a.seq_id = seq;
  a.handle_id = 1000 + seq;
  a.layout_hash = 42;
  a.client = "n0/http";
  a.request_id = seq;
  a.first_token = 7;
  a.sampling.max_new_tokens = 6;
  a.sampling.ignore_eos = true;
  a.prompt.assign(prompt_tokens, 3);
  return a;
}

msg::kv_chunk whole_handle(uint64_t handle, uint32_t blocks, uint64_t block_bytes) {
  msg::kv_chunk c;
  c.handle_id = handle;
  c.count = c.total = blocks;
  c.layout_hash = 42;
  c.bytes.assign(blocks * block_bytes, 'k');
  c.checksum = duet::kv_checksum(std::as_bytes(std::span(c.bytes)));
  return c;
}

}  // namespace

int main() {
  racy_engine engine;
  std::binary_semaphore finished{0};
  duet::decode_settings settings;
  settings.router = "n0/router";
  settings.broker = "n0/broker";
  settings.kv_blocks = 256;
  settings.max_batch = 16;
  duet::decode_core core("n0/decode0", settings, engine);
  core.compute_in_background([&] { finished.release(); });

  uint64_t next = 1, adopted = 0, finishes = 0, tokens = 0;
  auto count = [&](const std::vector<duet::outgoing>& sent) {
    for (const auto& o : sent) {
      const auto env = msg::decode_envelope(o.frames);
      if (!env) continue;
      if (env->type == static_cast<uint16_t>(msg::type_id::finish)) ++finishes;
      if (env->type == static_cast<uint16_t>(msg::type_id::token_batch)) ++tokens;
    }
  };
  for (int round = 0; round < 300; ++round) {
    const int64_t now = 1000 + round * 10;
    if (!core.begin_step(now)) {
      // Nothing to decode: one sequence on the same-pool path, between steps.
      const auto a = adoption(next, 20);
      core.on_adopt(msg::envelope{}, a, now);
      msg::kv_moved m;
      m.handle_id = a.handle_id;
      core.on_moved(m, now);
      ++next;
      ++adopted;
    } else {
      // Meanwhile: three adoptions, one per path, and a cancel.
      for (int k = 0; k < 3; ++k, ++next, ++adopted) {
        const auto a = adoption(next, 20 + next % 30);
        core.on_adopt(msg::envelope{}, a, now);
        const uint32_t blocks = static_cast<uint32_t>((a.prompt.size() + 1 + 15) / 16);
        if (k == 0) {
          msg::kv_moved m;
          m.handle_id = a.handle_id;
          core.on_moved(m, now);
        } else if (k == 1) {
          msg::kv_moved m;
          m.handle_id = a.handle_id;
          m.path = msg::kv_path::host_shm;
          for (uint32_t b = 0; b < blocks; ++b) m.source_blocks.push_back(b);
          core.on_moved(m, now);
        } else {
          msg::envelope owner;
          owner.src = "n1/prefill0";
          core.on_chunk(owner, whole_handle(a.handle_id, blocks, engine.info().block_bytes), now);
        }
      }
      if (round % 7 == 3) core.on_cancel(msg::cancel_seq{next - 2, msg::finish_reason::cancelled});
      core.tick(now);
      count(core.out().take());
      finished.acquire();
      core.finish_step(now + 5);
    }
    count(core.out().take());
  }
  // Drain: steps until every sequence has ended.
  for (int i = 0; i < 100 && core.begin_step(5000); ++i) {
    finished.acquire();
    core.finish_step(5000);
    count(core.out().take());
  }
  count(core.out().take());
  const bool ok = finishes == adopted && tokens > 0 && core.pool().free_blocks() == core.pool().total_blocks();
  std::printf("%llu adopted, %llu finished, %llu token batches, pool %u/%u free: %s\n",
              static_cast<unsigned long long>(adopted), static_cast<unsigned long long>(finishes),
              static_cast<unsigned long long>(tokens), core.pool().free_blocks(), core.pool().total_blocks(),
              ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
