// Decode steps on a thread of their own (decode_core::compute_in_background): the worker takes
// adoptions while the engine computes, so a sequence whose KV arrives during a step joins the
// next one; the engine is called from the worker's thread only for its const info meanwhile.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <semaphore>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/decode_core.hpp"
#include "runtime/kv_stream.hpp"
#include "runtime/model_shape.hpp"
#include "runtime/sim_engine.hpp"
#include "tests/cluster_harness.hpp"

namespace msg = duet::msg;
using duet::testing::messages_of;
using namespace std::chrono_literals;

namespace {

const std::string router_addr = "n0/router";
const std::string broker_addr = "n0/broker";
const std::string decode_addr = "n0/decode0";
const std::string client_addr = "n0/http";

/// A sim engine whose decode waits for the test's permit and whose pool is bytes in memory.
/// It records the engine calls that come from another thread while a step computes.
class gated_engine final : public duet::engine {
 public:
  gated_engine()
      : inner_(*duet::find_model_shape("tiny"), *duet::find_gpu_spec("h200"), "tiny", 8192, 16, 1.0, 0.0),
        pool_(std::size_t{64} * inner_.info().block_bytes) {}
  [[nodiscard]] const duet::engine_info& info() const override { return inner_.info(); }
  [[nodiscard]] duet::step_output prefill(std::span<const duet::prefill_chunk> chunks) override {
    return inner_.prefill(chunks);
  }
  [[nodiscard]] duet::step_output decode(std::span<const duet::decode_slot> slots) override {
    computing = true;
    {
      std::lock_guard lock(mutex);
      batches.emplace_back();
      for (const auto& s : slots) batches.back().push_back(s.seq_id);
    }
    entered.release();
    const bool permitted = permits.try_acquire_for(patience);
    auto out = inner_.decode(slots);
    computing = false;
    if (!permitted) throw std::runtime_error("gated_engine: no permit in time");
    return out;
  }
  void release(uint64_t seq_id) override {
    std::lock_guard lock(mutex);
    calls_while_computing += computing ? 1 : 0;
    released.push_back(seq_id);
  }
  [[nodiscard]] msg::kv_path can_import() const override { return msg::kv_path::host_shm; }
  bool import_blocks(const msg::kv_pool_export& /*from*/, std::span<const uint32_t> src,
                     std::span<const uint32_t> dst, std::string& /*error*/) override {
    std::lock_guard lock(mutex);
    calls_while_computing += computing ? 1 : 0;
    for (std::size_t i = 0; i < src.size(); ++i) fill_block(dst[i], static_cast<std::byte>(src[i]));
    ++imports;
    return true;
  }
  bool write_blocks(std::span<const uint32_t> blocks, std::span<const std::byte> in) override {
    std::lock_guard lock(mutex);
    calls_while_computing += computing ? 1 : 0;
    const uint64_t bytes = info().block_bytes;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      std::memcpy(pool_.data() + blocks[i] * bytes, in.data() + i * bytes, bytes);
    }
    ++writes;
    return true;
  }
  [[nodiscard]] std::byte first_byte(uint32_t block) const { return pool_.at(block * info().block_bytes); }

  std::binary_semaphore entered{0};
  std::counting_semaphore<16> permits{0};
  std::chrono::milliseconds patience = 10s;
  std::atomic<bool> computing = false;
  std::mutex mutex;
  std::vector<std::vector<uint64_t>> batches;  // every decode step's sequences
  std::vector<uint64_t> released;
  uint32_t imports = 0;
  uint32_t writes = 0;
  uint32_t calls_while_computing = 0;

 private:
  void fill_block(uint32_t block, std::byte value) {
    std::fill_n(pool_.begin() + block * info().block_bytes, info().block_bytes, value);
  }
  duet::sim_engine inner_;
  std::vector<std::byte> pool_;
};

struct decode_fixture {
  gated_engine engine;
  std::binary_semaphore finished{0};  // the step thread's notify
  std::thread::id notified_on;
  duet::decode_core core;  // last: its step thread is joined before the members above go

  static duet::decode_settings settings() {
    duet::decode_settings s;
    s.router = router_addr;
    s.broker = broker_addr;
    s.kv_blocks = 64;
    s.max_batch = 8;
    return s;
  }
  decode_fixture() : core(decode_addr, settings(), engine) {
    core.compute_in_background([this] {
      notified_on = std::this_thread::get_id();
      finished.release();
    });
  }
  /// The router's adoption of a 40-token prompt (3 blocks of 16); returns the pulled blocks.
  std::vector<uint32_t> adopt(uint64_t seq) {
    msg::kv_adopt a;
    a.seq_id = seq;
    a.handle_id = 100 + seq;
    a.layout_hash = engine.info().layout_hash;
    a.client = client_addr;
    a.request_id = seq;
    a.first_token = 5;
    a.sampling.max_new_tokens = 8;
    a.prompt.assign(40, 3);
    msg::envelope env;
    env.src = router_addr;
    core.on_adopt(env, a, 0);
    auto sent = take();
    auto pulls = messages_of<msg::kv_pull>(sent);
    std::erase_if(pulls, [&](const auto& p) { return p.body.handle_id != 100 + seq; });
    REQUIRE(pulls.size() == 1);  // sent at once, whatever the engine is doing
    kept = std::move(sent);      // the checks below count other kinds
    return pulls[0].body.block_ids;
  }
  void moved(uint64_t seq, msg::kv_path path) {
    msg::kv_moved m;
    m.handle_id = 100 + seq;
    m.path = path;
    if (path == msg::kv_path::host_shm) m.source_blocks = {7, 8, 9};
    core.on_moved(m, 0);
  }
  /// The whole handle of `seq` (3 blocks) as one stream chunk, each block filled with `fill`.
  msg::kv_chunk chunk(uint64_t seq, char fill) const {
    msg::kv_chunk c;
    c.handle_id = 100 + seq;
    c.count = c.total = 3;
    c.layout_hash = engine.info().layout_hash;
    c.bytes.assign(3 * engine.info().block_bytes, fill);
    c.checksum = duet::kv_checksum(std::as_bytes(std::span(c.bytes)));
    return c;
  }
  /// Lets the running step end and applies it, as the actor does on step_done.
  void finish() {
    engine.permits.release();
    REQUIRE(finished.try_acquire_for(10s));
    core.finish_step(0);
  }
  /// What the core sent since the last take (adopt looks at the pulls and keeps the rest).
  std::vector<duet::outgoing> take() {
    auto now = core.out().take();
    kept.insert(kept.end(), std::make_move_iterator(now.begin()), std::make_move_iterator(now.end()));
    return std::exchange(kept, {});
  }
  std::vector<duet::outgoing> kept;
};

}  // namespace

TEST_SUITE_BEGIN("decode");

TEST_CASE(
    "a decode step in the background: a sequence whose KV arrives during the step joins the "
    "next one; imports, stream writes and releases wait for the step to end") {
  decode_fixture d;
  d.adopt(1);
  d.moved(1, msg::kv_path::none);
  CHECK(messages_of<msg::kv_confirm>(d.take()).size() == 1);

  // Step 1 computes sequence 1 on the step thread; the caller is free.
  REQUIRE(d.core.begin_step(0) == std::chrono::nanoseconds{0});
  CHECK(d.core.step_in_background());
  REQUIRE(d.engine.entered.try_acquire_for(10s));
  d.adopt(2);  // pulled now, not after the step
  d.moved(2, msg::kv_path::none);
  const auto shm_blocks = d.adopt(3);
  d.moved(3, msg::kv_path::host_shm);  // the copy from the owner's pool waits
  const auto stream_blocks = d.adopt(4);
  msg::envelope owner;
  owner.src = "n1/prefill0";
  d.core.on_chunk(owner, d.chunk(4, 'k'), 0);  // its write waits
  d.adopt(5);
  d.core.on_cancel(msg::cancel_seq{5, msg::finish_reason::cancelled});  // pulling: ends on kv_moved
  d.moved(5, msg::kv_path::none);  // ended now; the engine's release waits
  CHECK(d.engine.imports == 0);
  CHECK(d.engine.writes == 0);
  CHECK(d.engine.released.empty());
  auto during = d.take();
  CHECK(messages_of<msg::kv_confirm>(during).size() == 2);  // 2 and 5: 3 and 4 are not in yet
  REQUIRE(messages_of<msg::finish>(during).size() == 1);
  CHECK(messages_of<msg::finish>(during)[0].body.reason == msg::finish_reason::cancelled);

  d.finish();
  CHECK(d.notified_on != std::this_thread::get_id());
  CHECK(d.engine.calls_while_computing == 0);
  CHECK(d.engine.released == std::vector<uint64_t>{5});
  CHECK(d.engine.imports == 1);
  CHECK(d.engine.writes == 1);
  CHECK(d.engine.first_byte(shm_blocks[2]) == std::byte{9});  // source block 9 into the third
  CHECK(d.engine.first_byte(stream_blocks[0]) == std::byte{'k'});
  auto after = d.take();
  CHECK(messages_of<msg::token_batch>(after).size() == 1);  // sequence 1's token
  CHECK(messages_of<msg::kv_confirm>(after).size() == 2);   // 3 and 4, in place now
  CHECK(messages_of<msg::kv_chunk_ack>(after).size() == 1);

  // Step 2: every sequence whose KV came during step 1, with sequence 1.
  REQUIRE(d.core.begin_step(0));
  REQUIRE(d.engine.entered.try_acquire_for(10s));
  d.finish();
  REQUIRE(d.engine.batches.size() == 2);
  CHECK(d.engine.batches[0] == std::vector<uint64_t>{1});
  auto second = d.engine.batches[1];
  std::sort(second.begin(), second.end());
  CHECK(second == std::vector<uint64_t>{1, 2, 3, 4});
  CHECK_FALSE(d.core.step_in_background());
}

TEST_CASE("a running sequence cancelled during a background decode step ends when the step returns") {
  decode_fixture d;
  d.adopt(1);
  d.moved(1, msg::kv_path::none);
  (void)d.take();
  REQUIRE(d.core.begin_step(0));
  REQUIRE(d.engine.entered.try_acquire_for(10s));
  d.core.on_cancel(msg::cancel_seq{1, msg::finish_reason::cancelled});
  CHECK(messages_of<msg::finish>(d.take()).empty());  // its step still computes
  d.finish();
  auto sent = d.take();
  REQUIRE(messages_of<msg::finish>(sent).size() == 1);
  CHECK(messages_of<msg::finish>(sent)[0].body.reason == msg::finish_reason::cancelled);
  CHECK(d.engine.released == std::vector<uint64_t>{1});
  CHECK(d.engine.calls_while_computing == 0);
  CHECK(d.core.pool().free_blocks() == d.core.pool().total_blocks());
}

TEST_CASE("an engine error in a background decode step reaches the caller at finish_step") {
  decode_fixture d;
  d.engine.patience = 50ms;
  d.adopt(1);
  d.moved(1, msg::kv_path::none);
  REQUIRE(d.core.begin_step(0));
  REQUIRE(d.engine.entered.try_acquire_for(10s));
  // No permit: the engine gives up and throws on the step thread.
  REQUIRE(d.finished.try_acquire_for(10s));
  CHECK_THROWS_WITH_AS(d.core.finish_step(0), "gated_engine: no permit in time", std::runtime_error);
}

TEST_CASE("DUET_DECODE_THREAD=0 keeps decode steps on the actor's thread; the sim engine never leaves it") {
  CHECK(duet::decode_steps_in_background("cuda"));
  CHECK(duet::decode_steps_in_background("cpu"));
  CHECK_FALSE(duet::decode_steps_in_background("sim"));
  setenv("DUET_DECODE_THREAD", "0", 1);
  CHECK_FALSE(duet::decode_steps_in_background("cuda"));
  setenv("DUET_DECODE_THREAD", "1", 1);
  CHECK(duet::decode_steps_in_background("cuda"));
  unsetenv("DUET_DECODE_THREAD");
}

TEST_SUITE_END();
