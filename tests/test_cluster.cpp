// End-to-end tests of a live cluster: actors in one process, and `duet node` processes
// talking over real ipc:// and tcp:// sockets on this host.
#include <doctest/doctest.h>

#include <random>
#include <optional>
#include <thread>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "tests/cluster_ready.hpp"
#include "actors/node.hpp"
#include "runtime/client.hpp"
#include "runtime/clock.hpp"
#include "runtime/config.hpp"
#include "runtime/load_driver.hpp"
#include "runtime/sim_engine.hpp"
#include "runtime/transport.hpp"
#include "tests/process_util.hpp"

using namespace duet;
using namespace std::chrono_literals;

namespace {

/// A two-node deployment: n1 = router + broker + prefill0, n2 = decode0 + decode1.
std::string two_node_toml(const std::string& ep1, const std::string& ep2, const std::string& model = "duet-sim",
                          uint32_t decode_blocks = 2048) {
  return R"([model]
name = ")" + model + R"("
preset = "r1-distill-llama-8b"
max_context = 4096
[engine]
kind = "sim"
gpu = "h200"
time_scale = 0.05
[router]
request_timeout_ms = 20000
[broker]
lease_ms = 1500
reclaim_interval_ms = 100
transfer_timeout_ms = 1000
[transport]
peer_timeout_ms = 2000
heartbeat_ms = 500
[[nodes]]
name = "n1"
endpoint = ")" + ep1 + R"("
[[nodes.actors]]
name = "router"
role = "router"
[[nodes.actors]]
name = "broker"
role = "broker"
[[nodes.actors]]
name = "prefill0"
role = "prefill"
kv_blocks = 1024
chunk_tokens = 512
[[nodes]]
name = "n2"
endpoint = ")" + ep2 + R"("
[[nodes.actors]]
name = "decode0"
role = "decode"
kv_blocks = )" + std::to_string(decode_blocks) + R"(
max_batch = 64
[[nodes.actors]]
name = "decode1"
role = "decode"
kv_blocks = )" + std::to_string(decode_blocks) + R"(
max_batch = 64
)";
}

std::string unique(const std::string& stem) {
  return stem + "-" + std::to_string(getpid()) + "-" + std::to_string(std::random_device{}() % 100000);
}

using testing::wait_ready;

/// True once every pool is full and the broker holds no handle (polled, bounded).
bool pools_return_to_full(client& c, const std::vector<std::string>& actors, std::chrono::milliseconds timeout,
                          std::string* detail = nullptr) {
  const auto until = steady::now() + timeout;
  std::string last;
  while (steady::now() < until) {
    auto replies = c.stats(actors, 500ms);
    bool full = replies.size() == actors.size();
    last.clear();
    for (auto& r : replies) {
      if (r.role == "broker") full = full && r.counters["live_handles"] == 0;
      else full = full && r.free_blocks == r.total_blocks;
      last += r.actor + " " + std::to_string(r.free_blocks) + "/" + std::to_string(r.total_blocks) +
              " handles=" + std::to_string(r.counters["live_handles"]) + "; ";
    }
    if (full) return true;
    std::this_thread::sleep_for(50ms);
  }
  if (detail) *detail = last;
  return false;
}

std::vector<int32_t> reference_continuation(const std::vector<int32_t>& prompt, uint32_t n, uint32_t vocab) {
  std::vector<int32_t> seq = prompt, out;
  for (uint32_t i = 0; i < n; ++i) {
    const int32_t t = sim_engine::next_token(seq.back(), static_cast<uint32_t>(seq.size()), vocab);
    seq.push_back(t);
    out.push_back(t);
  }
  return out;
}

const std::vector<std::string> two_node_pools = {"n1/prefill0", "n1/broker", "n2/decode0", "n2/decode1"};

}  // namespace

TEST_CASE("duet's actor systems run CAF's work-stealing workers without the moderate polling phase") {
  caf::actor_system_config cfg;
  CHECK(caf::get_or(cfg, "work-stealing.moderate-poll-attempts", size_t{500}) == 500u);
  duet::tune_actor_system(cfg);
  CHECK(caf::get_or(cfg, "work-stealing.moderate-poll-attempts", size_t{500}) == 0u);
}

TEST_CASE("a request flows router, prefill, broker, decode and back to the client in one process") {
  auto config = default_config();
  config.engine.time_scale = 0.0;
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  node n(system, config, config.nodes.at(0).name);
  client c(config.nodes.at(0).endpoint, config.nodes.at(0).name + "/router");
  REQUIRE(wait_ready(c, config.nodes.at(0).name + "/router", 5s));

  msg::submit s;
  s.request_id = 7;
  s.prompt_tokens = {11, 22, 33, 44, 55};
  s.sampling.max_new_tokens = 12;
  const auto g = c.generate(s, 5s);
  REQUIRE(g.finish.has_value());
  CHECK(g.admitted);
  CHECK(g.finish->reason == msg::finish_reason::length);
  CHECK(g.finish->completion_tokens == 12);
  CHECK(g.finish->prompt_tokens == 5);
  // Splitting prefill and decode must not change a token.
  CHECK(g.tokens == reference_continuation(s.prompt_tokens, 12, 128256));
  CHECK(pools_return_to_full(c, {config.nodes[0].name + "/prefill0", config.nodes[0].name + "/decode0",
                                 config.nodes[0].name + "/broker"}, 3s));
}

TEST_CASE("bad requests are rejected with a readable reason and nothing is reserved") {
  auto config = default_config();
  config.engine.time_scale = 0.0;
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  node n(system, config, config.nodes.at(0).name);
  const std::string router = config.nodes.at(0).name + "/router";
  client c(config.nodes.at(0).endpoint, router);
  REQUIRE(wait_ready(c, router, 5s));

  msg::submit empty;
  empty.request_id = 1;
  auto g = c.generate(empty, 2s);
  REQUIRE(g.rejection.has_value());
  CHECK(g.rejection->code == msg::error_code::bad_request);

  msg::submit too_long;
  too_long.request_id = 2;
  too_long.prompt_tokens.assign(config.model.max_context + 10, 5);
  g = c.generate(too_long, 2s);
  REQUIRE(g.rejection.has_value());
  CHECK(g.rejection->code == msg::error_code::prompt_too_long);
  CHECK(g.rejection->message.find("exceeds the context") != std::string::npos);

  msg::submit no_tokens_wanted;
  no_tokens_wanted.request_id = 3;
  no_tokens_wanted.prompt = "hello";
  no_tokens_wanted.sampling.max_new_tokens = 0;
  g = c.generate(no_tokens_wanted, 2s);
  REQUIRE(g.rejection.has_value());
  CHECK(g.rejection->code == msg::error_code::bad_request);
}

TEST_CASE("a request cancelled during decode ends with reason cancelled and frees its blocks") {
  auto config = default_config();
  config.engine.time_scale = 1.0;  // real H200-like step times, so cancel lands mid-stream
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  node n(system, config, config.nodes.at(0).name);
  const std::string router = config.nodes.at(0).name + "/router";
  client c(config.nodes.at(0).endpoint, router);
  REQUIRE(wait_ready(c, router, 5s));
  msg::submit s;
  s.request_id = 9;
  s.prompt_tokens.assign(100, 3);
  s.sampling.max_new_tokens = 2000;
  REQUIRE(c.submit(s));
  std::optional<msg::finish> fin;
  uint32_t tokens = 0;
  bool cancelled = false;
  const auto until = steady::now() + 10s;
  while (!fin && steady::now() < until) {
    for (auto& e : c.poll(20ms)) {
      if (e.what == client_event::kind::tokens) tokens += static_cast<uint32_t>(e.tokens.size());
      if (e.what == client_event::kind::finished) fin = e.finish;
    }
    if (tokens >= 10 && !cancelled) cancelled = c.cancel(9);
  }
  REQUIRE(fin.has_value());
  CHECK(fin->reason == msg::finish_reason::cancelled);
  CHECK(tokens < 2000);
  CHECK(pools_return_to_full(c, {config.nodes[0].name + "/prefill0", config.nodes[0].name + "/decode0",
                                 config.nodes[0].name + "/broker"}, 3s));
}

TEST_CASE("two node processes serve requests over ipc sockets with every pool back to full") {
  const std::string ep1 = "ipc:///tmp/" + unique("duet-t1") + ".sock";
  const std::string ep2 = "ipc:///tmp/" + unique("duet-t2") + ".sock";
  testing::temp_file file(unique("duet-ipc") + ".toml", two_node_toml(ep1, ep2));
  testing::child_process n1({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n1"});
  testing::child_process n2({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n2"});
  client c(ep1, "n1/router");
  REQUIRE(wait_ready(c, "n1/router", 10s));

  burst_options o;
  o.requests = 200;
  o.concurrency = 200;
  o.prompt_tokens = 300;
  o.max_new_tokens = 20;
  o.timeout = 30s;
  const auto records = run_burst(c, o);
  REQUIRE(records.size() == 200);
  for (const auto& r : records) {
    CHECK_MESSAGE(r.outcome == "ok", "request ", r.id, " ended ", r.outcome);
    CHECK(r.output_tokens == 20);
  }
  std::string detail;
  CHECK_MESSAGE(pools_return_to_full(c, two_node_pools, 3s, &detail), detail);
  // Both decode workers took part (least-loaded placement spreads the burst).
  auto stats = c.stats({"n2/decode0", "n2/decode1"}, 2s);
  REQUIRE(stats.size() == 2);
  CHECK(stats[0].counters["adopted"] > 0);
  CHECK(stats[1].counters["adopted"] > 0);
}

TEST_CASE("two node processes serve requests over tcp on loopback") {
  const int base = 20000 + static_cast<int>(getpid() % 20000);
  const std::string ep1 = "tcp://127.0.0.1:" + std::to_string(base);
  const std::string ep2 = "tcp://127.0.0.1:" + std::to_string(base + 1);
  testing::temp_file file(unique("duet-tcp") + ".toml", two_node_toml(ep1, ep2));
  testing::child_process n1({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n1"});
  testing::child_process n2({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n2"});
  client c(ep1, "n1/router");
  REQUIRE(wait_ready(c, "n1/router", 10s));
  msg::submit s;
  s.request_id = 1;
  s.prompt_tokens = {5, 6, 7, 8, 9, 10};
  s.sampling.max_new_tokens = 16;
  const auto g = c.generate(s, 10s);
  REQUIRE(g.finish.has_value());
  CHECK(g.finish->reason == msg::finish_reason::length);
  CHECK(g.tokens == reference_continuation(s.prompt_tokens, 16, 128256));
  CHECK(pools_return_to_full(c, two_node_pools, 3s));
}

TEST_CASE("1000 requests with random cancels and deadlines across two processes all end and leak no block") {
  const std::string ep1 = "ipc:///tmp/" + unique("duet-i1") + ".sock";
  const std::string ep2 = "ipc:///tmp/" + unique("duet-i2") + ".sock";
  // Small decode pools, so adoptions also wait for memory and some time out.
  testing::temp_file file(unique("duet-inv") + ".toml", two_node_toml(ep1, ep2, "duet-sim", 256));
  testing::child_process n1({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n1"});
  testing::child_process n2({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n2"});
  client c(ep1, "n1/router");
  REQUIRE(wait_ready(c, "n1/router", 10s));

  burst_options o;
  o.requests = 1000;
  o.concurrency = 1000;
  o.prompt_tokens = 128;
  o.max_new_tokens = 32;
  o.cancel_fraction = 0.15;
  o.cancel_within_ms = 300;
  o.short_deadline_fraction = 0.15;
  o.short_deadline_ms = 40;
  o.seed = 42;
  o.timeout = 60s;
  const auto records = run_burst(c, o);
  REQUIRE(records.size() == 1000);
  std::map<std::string, int> outcomes;
  for (const auto& r : records) ++outcomes[r.outcome];
  for (const auto& [k, v] : outcomes) MESSAGE(k, ": ", v);
  // Every request got a final answer from the cluster: none was lost or left hanging.
  CHECK(outcomes["client_timeout"] == 0);
  CHECK(outcomes["not_sent"] == 0);
  CHECK(outcomes["send_failed"] == 0);
  CHECK(outcomes["ok"] > 0);
  CHECK(outcomes["cancelled"] > 0);
  CHECK(outcomes["timeout"] > 0);
  std::string detail;
  CHECK_MESSAGE(pools_return_to_full(c, two_node_pools, 5s, &detail), detail);
}

TEST_CASE("garbage sent to a node's socket is counted and dropped while the node keeps serving") {
  const std::string ep1 = "ipc:///tmp/" + unique("duet-g1") + ".sock";
  const std::string ep2 = "ipc:///tmp/" + unique("duet-g2") + ".sock";
  testing::temp_file file(unique("duet-garbage") + ".toml", two_node_toml(ep1, ep2));
  testing::child_process n1({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n1"});
  testing::child_process n2({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n2"});
  client c(ep1, "n1/router");
  REQUIRE(wait_ready(c, "n1/router", 10s));

  zmq::socket_t attacker(zmq_context(), zmq::socket_type::dealer);
  attacker.set(zmq::sockopt::linger, 0);
  attacker.connect(ep1);
  std::mt19937 rng(7);
  auto random_bytes = [&](std::size_t n) {
    std::string s(n, '\0');
    for (auto& ch : s) ch = static_cast<char>(rng());
    return s;
  };
  const int garbage = 300;
  for (int i = 0; i < garbage; ++i) {
    std::vector<std::string> frames;
    const int parts = 1 + static_cast<int>(rng() % 5);
    for (int p = 0; p < parts; ++p) frames.push_back(random_bytes(rng() % 200));
    if (i % 3 == 0) {  // a valid envelope with a garbage body
      msg::envelope env;
      env.src = "x/client";
      env.dst = "n1/router";
      frames = msg::encode(env, msg::cancel{1});
      frames[1] = random_bytes(20);
    }
    std::vector<zmq::const_buffer> bufs;
    for (auto& f : frames) bufs.emplace_back(f.data(), f.size());
    REQUIRE(zmq::send_multipart(attacker, bufs));
  }
  std::this_thread::sleep_for(300ms);
  msg::submit s;
  s.request_id = 77;
  s.prompt_tokens = {1, 2, 3};
  s.sampling.max_new_tokens = 8;
  const auto g = c.generate(s, 10s);
  REQUIRE(g.finish.has_value());
  CHECK(g.finish->reason == msg::finish_reason::length);
  auto stats = c.stats({"n1/router"}, 2s);
  REQUIRE(stats.size() == 1);
  // Envelope-level garbage is counted by the transport; body-level garbage is answered
  // with an error message by the actor and counted as malformed there.
  CHECK(stats[0].counters["transport_malformed"] >= static_cast<uint64_t>(garbage * 2 / 3 - 5));
  CHECK(n1.running());
  CHECK(n2.running());
}

TEST_CASE("a node that restarts with another model is checked again by the node that kept running") {
  const std::string ep1 = "ipc:///tmp/" + unique("duet-r1") + ".sock";
  const std::string ep2 = "ipc:///tmp/" + unique("duet-r2") + ".sock";
  testing::temp_file a(unique("duet-restart-a") + ".toml", two_node_toml(ep1, ep2, "model-a"));
  testing::temp_file b(unique("duet-restart-b") + ".toml", two_node_toml(ep1, ep2, "model-b"));
  testing::child_process n1({testing::duet_binary(), "node", "--config", a.path.string(), "--name", "n1"});
  std::optional<testing::child_process> n2;
  n2.emplace(std::vector<std::string>{testing::duet_binary(), "node", "--config", a.path.string(), "--name", "n2"});
  client c(ep1, "n1/router");
  REQUIRE(wait_ready(c, "n1/router", 10s));
  msg::submit s;
  s.request_id = 1;
  s.prompt_tokens = {1, 2, 3};
  s.sampling.max_new_tokens = 4;
  REQUIRE(c.generate(s, 10s).finish.has_value());  // n1's DEALER to n2 is connected and in use
  // n2 comes back with another model: n1's DEALER reconnects to it without a word, and n2's
  // new DEALER to n1 says hello first, so n1 refuses n2 at once...
  n2.reset();
  n2.emplace(std::vector<std::string>{testing::duet_binary(), "node", "--config", b.path.string(), "--name", "n2"});
  std::this_thread::sleep_for(1500ms);  // three heartbeats of 500 ms
  auto n1_stats = c.stats({"n1/router"}, 2s);
  REQUIRE(n1_stats.size() == 1);
  CHECK(n1_stats[0].counters["transport_incompatible_hellos"] > 0);
  // ...and n2 must have had n1's hello again too (answered at once on its new pid, and
  // repeated every heartbeat), or it would take n1's messages unchecked.
  client direct(ep2, "n2/decode0");
  auto n2_stats = direct.stats({"n2/decode0"}, 2s);
  REQUIRE(n2_stats.size() == 1);
  CHECK(n2_stats[0].counters["transport_incompatible_hellos"] > 0);
}

TEST_CASE("nodes with different models refuse each other's messages") {
  const std::string ep1 = "ipc:///tmp/" + unique("duet-c1") + ".sock";
  const std::string ep2 = "ipc:///tmp/" + unique("duet-c2") + ".sock";
  testing::temp_file a(unique("duet-compat-a") + ".toml", two_node_toml(ep1, ep2, "model-a"));
  testing::temp_file b(unique("duet-compat-b") + ".toml", two_node_toml(ep1, ep2, "model-b"));
  testing::child_process n1({testing::duet_binary(), "node", "--config", a.path.string(), "--name", "n1"});
  testing::child_process n2({testing::duet_binary(), "node", "--config", b.path.string(), "--name", "n2"});
  client c(ep1, "n1/router");
  std::this_thread::sleep_for(1500ms);
  auto stats = c.stats({"n1/router"}, 2s);
  REQUIRE(stats.size() == 1);
  CHECK(stats[0].counters["transport_refused_incompatible"] > 0);
  CHECK(stats[0].counters["ready_decode"] == 0);  // n2's load reports were refused
  msg::submit s;
  s.request_id = 5;
  s.prompt_tokens = {1, 2, 3};
  const auto g = c.generate(s, 5s);
  REQUIRE(g.rejection.has_value());
  CHECK(g.rejection->code == msg::error_code::unavailable);
}

TEST_CASE("a killed decode node fails its requests fast, and a restarted one is used again") {
  const std::string ep1 = "ipc:///tmp/" + unique("duet-r1") + ".sock";
  const std::string ep2 = "ipc:///tmp/" + unique("duet-r2") + ".sock";
  testing::temp_file file(unique("duet-restart") + ".toml", two_node_toml(ep1, ep2));
  testing::child_process n1({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n1"});
  auto n2 = std::make_unique<testing::child_process>(
      std::vector<std::string>{testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n2"});
  client c(ep1, "n1/router");
  REQUIRE(wait_ready(c, "n1/router", 10s));

  msg::submit s;
  s.request_id = 1;
  s.prompt_tokens = {1, 2, 3, 4};
  s.sampling.max_new_tokens = 100000 / 100;  // long enough to be mid-stream when killed
  REQUIRE(c.submit(s));
  uint32_t tokens = 0;
  while (tokens < 5) {
    for (auto& e : c.poll(20ms)) tokens += static_cast<uint32_t>(e.tokens.size());
  }
  n2->kill9();
  // The router notices the silent worker (peer_timeout_ms = 2000) and answers the client.
  std::optional<msg::finish> fin;
  const auto until = steady::now() + 8s;
  while (!fin && steady::now() < until) {
    for (auto& e : c.poll(20ms)) {
      if (e.what == client_event::kind::finished) fin = e.finish;
    }
  }
  REQUIRE(fin.has_value());
  CHECK(fin->reason == msg::finish_reason::error);
  CHECK(fin->code == msg::error_code::unavailable);
  CHECK(fin->message.find("stopped answering") != std::string::npos);

  // ZeroMQ reconnects on its own; the new process's load reports make it eligible again.
  n2 = std::make_unique<testing::child_process>(
      std::vector<std::string>{testing::duet_binary(), "node", "--config", file.path.string(), "--name", "n2"});
  REQUIRE(wait_ready(c, "n1/router", 10s));
  s.request_id = 2;
  s.sampling.max_new_tokens = 8;
  const auto g = c.generate(s, 10s);
  REQUIRE(g.finish.has_value());
  CHECK(g.finish->reason == msg::finish_reason::length);
  CHECK(g.tokens == reference_continuation(s.prompt_tokens, 8, 128256));
  // The prefill side's blocks of the lost request came back through the broker's lease.
  CHECK(pools_return_to_full(c, {"n1/prefill0", "n1/broker"}, 5s));
}
