// Prefill steps on a thread of their own (runtime/step_thread.hpp): the worker keeps taking
// messages while the engine computes, and the engine sees only read_blocks meanwhile.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <random>
#include <semaphore>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/model_shape.hpp"
#include "runtime/prefill_core.hpp"
#include "runtime/sim_engine.hpp"
#include "runtime/step_thread.hpp"
#include "tests/cluster_harness.hpp"

namespace msg = duet::msg;
using duet::testing::count_of;
using duet::testing::messages_of;
using namespace std::chrono_literals;

namespace {

const std::string router_addr = "n0/router";
const std::string broker_addr = "n0/broker";
const std::string prefill_addr = "n0/prefill0";
const std::string decode_addr = "n0/decode0";

duet::sim_engine tiny_engine() {
  return duet::sim_engine(*duet::find_model_shape("tiny"), *duet::find_gpu_spec("h200"), "tiny",
                          8192, 16, 1.0, 0.0);
}

std::vector<int32_t> prompt_of(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> out(n);
  for (auto& t : out) t = static_cast<int32_t>(rng() % 500) + 1;
  return out;
}

/// A sim engine whose prefill waits for the test's permit, and whose blocks hold their id's
/// bytes; it records what it was asked while a prefill was running.
class gated_engine final : public duet::engine {
 public:
  gated_engine() : inner_(tiny_engine()) {}
  [[nodiscard]] const duet::engine_info& info() const override { return inner_.info(); }
  [[nodiscard]] duet::step_output prefill(std::span<const duet::prefill_chunk> chunks) override {
    computing = true;
    entered.release();
    const bool permitted = permits.try_acquire_for(patience);
    auto out = inner_.prefill(chunks);
    computing = false;
    if (!permitted) throw std::runtime_error("gated_engine: no permit in time");
    return out;
  }
  [[nodiscard]] duet::step_output decode(std::span<const duet::decode_slot> slots) override {
    return inner_.decode(slots);
  }
  void release(uint64_t seq_id) override {
    std::lock_guard lock(mutex);
    if (computing) released_while_computing = true;
    released.push_back(seq_id);
  }
  bool read_blocks(std::span<const uint32_t> blocks, std::span<std::byte> out) const override {
    const uint64_t bytes = info().block_bytes;
    if (out.size() != blocks.size() * bytes) return false;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      std::memset(out.data() + i * bytes, static_cast<int>(blocks[i] & 0xff), bytes);
    }
    if (computing) reads_while_computing += static_cast<uint32_t>(blocks.size());
    return true;
  }

  std::binary_semaphore entered{0};
  std::counting_semaphore<16> permits{0};
  std::chrono::milliseconds patience = 10s;
  std::atomic<bool> computing = false;
  mutable std::atomic<uint32_t> reads_while_computing = 0;
  std::mutex mutex;
  std::vector<uint64_t> released;
  bool released_while_computing = false;

 private:
  duet::sim_engine inner_;
};

struct background_fixture {
  gated_engine engine;
  std::binary_semaphore finished{0};  // the step thread's notify
  std::thread::id notified_on;
  duet::prefill_core core;  // last: its step thread is joined before the members above go

  static duet::prefill_settings settings_for(const duet::engine& e) {
    duet::prefill_settings s;
    s.router = router_addr;
    s.broker = broker_addr;
    s.kv_blocks = 1024;
    s.chunk_tokens = 2048;
    s.register_hold_ms = 5;  // no effect in the background: acks are read during the next step
    s.stream = {.chunk_bytes = 32 * e.info().block_bytes, .window = 2};
    return s;
  }
  background_fixture() : core(prefill_addr, settings_for(engine), engine) {
    core.compute_in_background([this] {
      notified_on = std::this_thread::get_id();
      finished.release();
    });
  }
  void request(uint64_t seq, std::vector<int32_t> tokens, std::string stream_to = {}) {
    msg::envelope env;
    env.src = router_addr;
    core.on_request(env, msg::prefill_request{seq, std::move(tokens), {}, std::move(stream_to)}, 0);
  }
  /// Lets the running step end and applies it, as the actor does on step_done.
  void finish() {
    engine.permits.release();
    REQUIRE(finished.try_acquire_for(10s));
    core.finish_step(0);
  }
};

}  // namespace

TEST_SUITE_BEGIN("prefill");

TEST_CASE(
    "a step thread runs one step at a time, hands back its output or its exception, and says "
    "when") {
  duet::step_thread steps;
  std::binary_semaphore done{0};
  std::thread::id ran_on;
  steps.launch(
      [&] {
        ran_on = std::this_thread::get_id();
        duet::step_output out;
        out.tokens = {7, 9};
        return out;
      },
      [&] { done.release(); });
  CHECK(steps.busy());
  CHECK_THROWS_AS(steps.launch([] { return duet::step_output{}; }, {}), std::logic_error);
  REQUIRE(done.try_acquire_for(10s));
  CHECK(ran_on != std::this_thread::get_id());
  CHECK(steps.take().tokens == std::vector<int32_t>{7, 9});
  CHECK_FALSE(steps.busy());
  CHECK_THROWS_AS((void)steps.take(), std::logic_error);  // taken already

  steps.launch([]() -> duet::step_output { throw std::invalid_argument("bad chunk"); },
               [&] { done.release(); });
  REQUIRE(done.try_acquire_for(10s));
  CHECK_THROWS_WITH_AS((void)steps.take(), "bad chunk", std::invalid_argument);
}

TEST_CASE(
    "a prefill step in the background: prompts, cancels and KV-stream acks are taken while it "
    "computes") {
  background_fixture p;
  const auto prompt = prompt_of(5000, 1);
  p.request(1, prompt, decode_addr);
  p.request(2, prompt_of(300, 2));

  // Chunk 1 of prompt 1 computes on the step thread; the caller is free.
  REQUIRE(p.core.begin_step(0) == std::chrono::nanoseconds{0});
  CHECK(p.core.step_in_background());
  REQUIRE(p.engine.entered.try_acquire_for(10s));
  p.request(3, prompt_of(200, 3));  // taken now, not after the step
  CHECK(p.core.load().queued == 3);
  p.core.on_cancel(msg::cancel_seq{2, msg::finish_reason::cancelled});  // waiting: fails at once
  auto failed = messages_of<msg::stage_failed>(p.core.out().take());
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].body.seq_id == 2);
  p.finish();
  CHECK(p.notified_on != std::this_thread::get_id());
  CHECK_FALSE(p.engine.released_while_computing);  // prompt 2's release waited for the step
  CHECK(p.engine.released == std::vector<uint64_t>{2});

  // Chunk 1's 128 blocks are final: once chunk 2 is launched, the stream sends a window of
  // them (2 chunks of 32), read while chunk 2 computes.
  CHECK(count_of<msg::kv_chunk>(p.core.out().take()) == 0);
  REQUIRE(p.core.begin_step(0));
  REQUIRE(p.engine.entered.try_acquire_for(10s));
  auto chunks = messages_of<msg::kv_chunk>(p.core.out().take());
  REQUIRE(chunks.size() == 2);
  CHECK(chunks[0].dst == decode_addr);
  CHECK(chunks[0].body.first == 0);

  // The adopter's acks come in during the step and the next chunks are read and sent. (The
  // first window's reads may precede the step thread's start: not counted.)
  const uint32_t reads_before = p.engine.reads_while_computing;
  p.core.on_chunk_ack(decode_addr, msg::kv_chunk_ack{1, 64, false});
  auto during = messages_of<msg::kv_chunk>(p.core.out().take());
  REQUIRE(during.size() == 2);
  CHECK(during[0].body.first == 64);
  CHECK(during[1].body.first == 96);
  CHECK(p.engine.reads_while_computing - reads_before == 64);
  const uint64_t block_bytes = p.engine.info().block_bytes;
  REQUIRE(during[0].body.bytes.size() == 32 * block_bytes);
  p.finish();

  // Chunk 3 ends the prompt: it registers once, with every block.
  REQUIRE(p.core.begin_step(0));
  p.finish();
  auto reg = messages_of<msg::kv_register>(p.core.out().take());
  REQUIRE(reg.size() == 2);  // prompt 3 finished in the same step
  CHECK(reg[0].body.handle.handle_id == 1);
  CHECK(reg[0].body.block_ids.size() == 313);
  // The bytes read during the step are the prompt's own blocks, 64 to 95, in order.
  for (uint32_t i = 0; i < 32; ++i) {
    CHECK(static_cast<uint8_t>(during[0].body.bytes[i * block_bytes]) ==
          (reg[0].body.block_ids[64 + i] & 0xff));
  }
  CHECK(reg[1].body.handle.handle_id == 3);
  CHECK(p.core.counters().at("tokens") == 5000 + 200);  // prompt 3 shared the last step
  CHECK(p.core.counters().at("steps") == 3);
  CHECK_FALSE(p.core.step_in_background());
}

TEST_CASE("an engine error in a background step reaches the caller at finish_step") {
  background_fixture p;
  p.engine.patience = 50ms;
  p.request(1, prompt_of(100, 1));
  REQUIRE(p.core.begin_step(0));
  REQUIRE(p.engine.entered.try_acquire_for(10s));
  // No permit: the engine gives up and throws on the step thread.
  REQUIRE(p.finished.try_acquire_for(10s));
  CHECK_THROWS_WITH_AS(p.core.finish_step(0), "gated_engine: no permit in time",
                       std::runtime_error);
}

TEST_SUITE_END();
