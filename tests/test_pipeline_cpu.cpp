// The CPU engine inside the disaggregated pipeline: a live cluster on SmolLM2-135M-Instruct,
// whose prefill and decode workers each run their own engine and KV pool, returns exactly the
// greedy tokens one engine produces running prefill then decode alone, in one process and across
// two `duet node` processes (the KV crossing the process boundary). docs/pipeline.md.
//
// The model comes from scripts/fetch-model.sh (models/, or $DUET_MODELS_DIR). When it is absent
// these tests fail, naming the script, unless DUET_SKIP_MODEL_TESTS=1.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tests/cluster_ready.hpp"
#include "actors/node.hpp"
#include "runtime/client.hpp"
#include "runtime/clock.hpp"
#include "runtime/config.hpp"
#include "runtime/engine.hpp"
#include "runtime/http_api.hpp"
#include "tests/process_util.hpp"

namespace fs = std::filesystem;
using namespace duet;
using namespace std::chrono_literals;

namespace {

fs::path model_path() {
  const char* env = std::getenv("DUET_MODELS_DIR");
  const fs::path dir = env != nullptr && *env != '\0' ? fs::path(env) : fs::path(DUET_SOURCE_DIR) / "models";
  return dir / "smollm2-135m-instruct-q4_1.gguf";
}

// True when the test should go on; fails (never passes silently) when the model is missing,
// unless skipping was asked for.
bool have_model() {
  if (fs::exists(model_path())) return true;
  const char* skip = std::getenv("DUET_SKIP_MODEL_TESTS");
  if (skip != nullptr && std::string_view(skip) == "1") {
    MESSAGE("DUET_SKIP_MODEL_TESTS=1 and " << model_path().string() << " is absent: skipped");
    return false;
  }
  FAIL("the SmolLM2 GGUF is missing at " << model_path().string()
                                         << ": run scripts/fetch-model.sh (it downloads and verifies it), or set "
                                            "DUET_SKIP_MODEL_TESTS=1 to skip the tests that need it");
  return false;
}

constexpr uint32_t max_new_tokens = 20;
constexpr uint32_t kv_blocks = 64;  // 1024 tokens per pool: 47 MiB of SmolLM2 KV

const std::vector<std::string> questions = {"What is the capital of France?", "Name a primary color.",
                                            "Say hello."};

/// The deployment's common part: SmolLM2 on the CPU engine, one thread per engine (two
/// engines share this machine's cores), short timeouts.
std::string common_toml() {
  return R"([model]
name = "smollm2-135m-instruct"
path = ")" + model_path().string() + R"("
max_context = 2048
[engine]
kind = "cpu"
threads = 1
[router]
request_timeout_ms = 60000
[broker]
lease_ms = 20000
transfer_timeout_ms = 20000
)";
}

std::string actor_toml(const std::string& name, const std::string& role) {
  std::string t = "[[nodes.actors]]\nname = \"" + name + "\"\nrole = \"" + role + "\"\n";
  if (role == "prefill" || role == "decode") {
    t += "kv_blocks = " + std::to_string(kv_blocks) + "\nmax_batch = 8\n";
    if (role == "prefill") t += "chunk_tokens = 512\n";
  }
  return t;
}

/// One node: router, broker, prefill0, decode0.
std::string one_node_toml(const std::string& endpoint, const std::string& transfer = "auto") {
  // [broker] is the last table of common_toml()
  return common_toml() + "transfer = \"" + transfer + "\"\n[[nodes]]\nname = \"local\"\nendpoint = \"" + endpoint + "\"\n" +
         actor_toml("router", "router") + actor_toml("broker", "broker") + actor_toml("prefill0", "prefill") +
         actor_toml("decode0", "decode");
}

/// Two nodes: p = router, broker, prefill0; d = decode0. `stream` forces the stream path;
/// `stream_prefill` also streams each prompt's blocks during its prefill.
std::string two_node_toml(const std::string& ep_p, const std::string& ep_d, bool stream, bool stream_prefill = false) {
  std::string t = common_toml();
  if (stream) t += "transfer = \"stream\"\n";  // [broker] is the last table of common_toml()
  if (stream_prefill) t += "stream_prefill = \"chunks\"\n";
  return t + "[[nodes]]\nname = \"p\"\nendpoint = \"" + ep_p + "\"\n" + actor_toml("router", "router") +
         actor_toml("broker", "broker") + actor_toml("prefill0", "prefill") + "[[nodes]]\nname = \"d\"\nendpoint = \"" +
         ep_d + "\"\n" + actor_toml("decode0", "decode");
}

std::string unique(const std::string& stem) {
  return stem + "-" + std::to_string(getpid()) + "-" + std::to_string(std::random_device{}() % 100000);
}

/// The prompts as the HTTP front end and `duet demo` build them: the model's chat template,
/// the GGUF's tokenizer.
std::vector<std::vector<int32_t>> chat_prompts(const deployment_config& config) {
  const auto codec = make_text_codec(config);
  const auto chat = make_chat_renderer(*codec);
  REQUIRE(dynamic_cast<const jinja_chat_renderer*>(chat.get()) != nullptr);  // the GGUF's own template
  std::vector<std::vector<int32_t>> out;
  for (const auto& q : questions) {
    const std::vector<chat_message> messages{{"user", q}};
    out.push_back(codec->encode(chat->render(messages, true), chat->add_special_tokens()));
  }
  return out;
}

/// What one engine alone produces: prefill of the whole prompt, then greedy decode steps
/// until an eos id or `max_new` tokens (the eos included, as the pipeline streams it).
std::vector<int32_t> single_engine_tokens(engine& e, uint64_t seq_id, const std::vector<int32_t>& prompt,
                                          uint32_t max_new) {
  const uint32_t block_tokens = e.info().block_tokens;
  std::vector<uint32_t> blocks((prompt.size() + max_new + block_tokens - 1) / block_tokens);
  for (uint32_t i = 0; i < blocks.size(); ++i) blocks[i] = i;
  REQUIRE(blocks.size() <= kv_blocks);
  msg::sampling_params greedy;
  greedy.temperature = 0.0f;
  greedy.max_new_tokens = max_new;
  prefill_chunk chunk;
  chunk.seq_id = seq_id;
  chunk.tokens = prompt;
  chunk.start = 0;
  chunk.blocks = blocks;
  chunk.last = true;
  chunk.sampling = &greedy;
  auto out = e.prefill(std::span<const prefill_chunk>(&chunk, 1));
  REQUIRE(out.tokens.size() == 1);
  std::vector<int32_t> history = prompt;
  std::vector<int32_t> generated{out.tokens[0]};
  history.push_back(out.tokens[0]);
  const auto& eos = e.info().eos_ids;
  auto is_eos = [&](int32_t t) { return std::find(eos.begin(), eos.end(), t) != eos.end(); };
  while (generated.size() < max_new && !is_eos(generated.back())) {
    decode_slot slot;
    slot.seq_id = seq_id;
    slot.history = history;
    slot.blocks = blocks;
    slot.sampling = &greedy;
    auto step = e.decode(std::span<const decode_slot>(&slot, 1));
    REQUIRE(step.tokens.size() == 1);
    generated.push_back(step.tokens[0]);
    history.push_back(step.tokens[0]);
  }
  e.release(seq_id);
  return generated;
}

std::vector<std::vector<int32_t>> reference_tokens(const deployment_config& config,
                                                   const std::vector<std::vector<int32_t>>& prompts) {
  actor_config actor;
  actor.role = actor_role::prefill;
  actor.kv_blocks = kv_blocks;
  auto e = make_engine(config, actor);
  std::vector<std::vector<int32_t>> out;
  for (std::size_t i = 0; i < prompts.size(); ++i) out.push_back(single_engine_tokens(*e, i + 1, prompts[i], max_new_tokens));
  return out;
}

using testing::wait_ready;

/// Every pool full and no live handle, polled (bounded); `detail` says what was seen last.
bool pools_return_to_full(client& c, const std::vector<std::string>& actors, std::string& detail) {
  const auto until = steady::now() + 5s;
  while (steady::now() < until) {
    auto replies = c.stats(actors, 500ms);
    bool full = replies.size() == actors.size();
    detail.clear();
    for (auto& r : replies) {
      if (r.role == "broker") full = full && r.counters["live_handles"] == 0;
      else full = full && r.free_blocks == r.total_blocks;
      detail += r.actor + " " + std::to_string(r.free_blocks) + "/" + std::to_string(r.total_blocks) +
                " handles=" + std::to_string(r.counters["live_handles"]) + "; ";
    }
    if (full) return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

/// Submits every prompt at once (greedy) and returns each request's tokens, in prompt order;
/// `gaps`, when given, gets each request's seconds from its first token to its second.
std::vector<std::vector<int32_t>> serve(client& c, const std::vector<std::vector<int32_t>>& prompts,
                                        std::vector<double>* gaps = nullptr) {
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, std::vector<steady::time_point>> token_times;
  std::map<uint64_t, msg::finish> finishes;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    msg::submit s;
    s.request_id = i + 1;
    s.prompt_tokens = prompts[i];
    s.sampling.temperature = 0.0f;
    s.sampling.max_new_tokens = max_new_tokens;
    REQUIRE(c.submit(s));
  }
  const auto until = steady::now() + 60s;
  while (finishes.size() < prompts.size() && steady::now() < until) {
    for (auto& e : c.poll(50ms)) {
      if (e.what == client_event::kind::rejected) FAIL("request " << e.request_id << " rejected: " << e.rejection.message);
      if (e.what == client_event::kind::tokens) {
        auto& t = tokens[e.request_id];
        t.insert(t.end(), e.tokens.begin(), e.tokens.end());
        token_times[e.request_id].insert(token_times[e.request_id].end(), e.tokens.size(), steady::now());
      }
      if (e.what == client_event::kind::finished) finishes[e.request_id] = e.finish;
    }
  }
  REQUIRE(finishes.size() == prompts.size());
  std::vector<std::vector<int32_t>> out;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto& f = finishes.at(i + 1);
    INFO("request " << i + 1 << ": " << f.message);
    CHECK((f.reason == msg::finish_reason::stop || f.reason == msg::finish_reason::length));
    CHECK(f.completion_tokens == tokens[i + 1].size());
    out.push_back(tokens[i + 1]);
    const auto& times = token_times[i + 1];
    if (gaps) gaps->push_back(times.size() >= 2 ? std::chrono::duration<double>(times[1] - times[0]).count() : -1);
  }
  return out;
}

uint64_t counter(const std::vector<msg::stats_reply>& replies, const std::string& actor, const std::string& name) {
  for (const auto& r : replies) {
    if (r.actor != actor) continue;
    auto it = r.counters.find(name);
    return it == r.counters.end() ? 0 : it->second;
  }
  return 0;
}

/// Decode counters path_* that moved KV bytes (not "none", not "same_pool"), by name.
std::map<std::string, uint64_t> byte_paths(const std::vector<msg::stats_reply>& replies, const std::string& actor) {
  std::map<std::string, uint64_t> out;
  for (const auto& r : replies) {
    if (r.actor != actor) continue;
    for (const auto& [k, v] : r.counters) {
      if (k.starts_with("path_") && k != "path_none" && k != "path_same_pool" && v > 0) out[k] = v;
    }
  }
  return out;
}

}  // namespace

/// One process: prefill0 and decode0 share one pool (transfer "auto": ownership of blocks moves)
/// or keep their own (transfer "copy": the decode engine copies from the shared-memory pool).
void serve_in_one_process(const std::string& transfer) {
  CAPTURE(transfer);
  const std::string toml = one_node_toml("inproc://" + unique("duet-pipe"), transfer);
  const auto config = parse_config(toml, "pipeline-one-node.toml");
  const auto prompts = chat_prompts(config);
  const auto expected = reference_tokens(config, prompts);
  for (const auto& e : expected) CHECK(e.size() >= 4);  // real answers, not an instant eos

  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  node n(system, config, "local");
  client c(config.nodes[0].endpoint, "local/router");
  REQUIRE(wait_ready(c, "local/router", 30s));
  const auto got = serve(c, prompts);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    INFO("prompt: " << questions[i]);
    CHECK(got[i] == expected[i]);
  }
  const auto stats = c.stats({"local/prefill0", "local/decode0", "local/broker"}, 2s);
  const auto paths = byte_paths(stats, "local/decode0");
  uint64_t copied = 0;
  for (const auto& [name, count] : paths) {
    MESSAGE("decode0 " << name << " = " << count);
    copied += count;
  }
  CHECK(counter(stats, "local/broker", "transfers_none") == 0);
  if (transfer == "auto") {
    // Every request's blocks changed owner, none of their bytes moved; each side's pool keeps
    // its size (the decode worker gave as many of its blocks in exchange).
    CHECK(copied == 0);
    CHECK(counter(stats, "local/broker", "transfers_same_pool") == prompts.size());
    CHECK(counter(stats, "local/decode0", "path_same_pool") == prompts.size());
    uint64_t prompt_blocks = 0;
    for (const auto& p : prompts) prompt_blocks += (p.size() + 15) / 16;
    CHECK(counter(stats, "local/decode0", "moved_blocks") == prompt_blocks);
    CHECK(counter(stats, "local/prefill0", "moved_blocks") == prompt_blocks);
    CHECK(counter(stats, "local/decode0", "imported_bytes") == 0);
  } else {
    // Separate pools: every request's KV moved, bytes and all, from prefill0's pool to decode0's.
    CHECK(copied == prompts.size());
    CHECK(counter(stats, "local/broker", "transfers_same_pool") == 0);
    CHECK(counter(stats, "local/decode0", "moved_blocks") == 0);
  }
  std::string detail;
  CHECK_MESSAGE(pools_return_to_full(c, {"local/prefill0", "local/decode0", "local/broker"}, detail), detail);
  n.stop();
}

TEST_CASE("a one-process cluster of CPU engines on SmolLM2 returns the tokens one engine alone produces, "
          "its KV handed over by ownership in one pool or copied between two") {
  if (!have_model()) return;
  serve_in_one_process("auto");
  serve_in_one_process("copy");
}

/// Two processes over ipc: the tokens equal one engine's, through the path `transfer` picks.
void serve_across_processes(bool stream) {
  CAPTURE(stream);
  const std::string ep_p = "ipc:///tmp/" + unique("duet-pipe-p") + ".sock";
  const std::string ep_d = "ipc:///tmp/" + unique("duet-pipe-d") + ".sock";
  testing::temp_file file(unique("duet-pipe") + ".toml", two_node_toml(ep_p, ep_d, stream));
  const auto config = load_config(file.path);
  const auto prompts = chat_prompts(config);
  const auto expected = reference_tokens(config, prompts);

  testing::child_process p({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "p"});
  testing::child_process d({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "d"});
  client c(ep_p, "p/router");
  REQUIRE(wait_ready(c, "p/router", 30s));
  const auto got = serve(c, prompts);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    INFO("prompt: " << questions[i]);
    CHECK(got[i] == expected[i]);
  }
  const auto stats = c.stats({"d/decode0", "p/broker"}, 2s);
  REQUIRE(stats.size() == 2);
  if (stream) {
    // The KV crossed the process boundary as kv_chunk messages.
    CHECK(counter(stats, "p/broker", "transfers_tcp") == prompts.size());
    CHECK(counter(stats, "d/decode0", "path_tcp") == prompts.size());
    CHECK(counter(stats, "d/decode0", "stream_bytes_received") > 0);
  } else {
    // One host: the decode process mapped the prefill process's shared-memory pool and copied.
    CHECK(counter(stats, "p/broker", "transfers_host_shm") == prompts.size());
    CHECK(counter(stats, "d/decode0", "path_host_shm") == prompts.size());
    CHECK(counter(stats, "d/decode0", "imported_bytes") > 0);
    CHECK(counter(stats, "d/decode0", "stream_bytes_received") == 0);
  }
  CHECK(counter(stats, "d/decode0", "transfer_failures") == 0);
  std::string detail;
  CHECK_MESSAGE(pools_return_to_full(c, {"p/prefill0", "d/decode0", "p/broker"}, detail), detail);
}

TEST_CASE("a prefill node and a decode node in two processes over ipc return the single-engine tokens") {
  if (!have_model()) return;
  serve_across_processes(true);   // the stream path
  serve_across_processes(false);  // shared memory between the processes
}

TEST_CASE("a prompt's first token leaves before the next prompt's chunk computes on the actor's thread") {
  if (!have_model()) return;
  // One prompt a step: A (32 tokens) alone, then B (992) in two 512-token chunks. A's first
  // token must not wait for B's first chunk, which the CPU engine computes on the prefill
  // actor's thread (it once did: the step began before the handler's messages were sent).
  // A 512-token step takes about 3 s on one core, as long as the router waits for a worker's
  // load report (transport.peer_timeout_ms): the reports come from an actor of their own, so
  // the busy worker is not taken for dead (it once was: "worker local/prefill0 stopped
  // answering").
  std::string toml = one_node_toml("inproc://" + unique("duet-pipe-order"));
  const std::string batch = "max_batch = 8\nchunk_tokens = 512";
  REQUIRE(toml.find(batch) != std::string::npos);
  toml.replace(toml.find(batch), batch.size(), "max_batch = 1\nchunk_tokens = 512");
  const auto config = parse_config(toml, "pipeline-order.toml");
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  node n(system, config, "local");
  client c(config.nodes[0].endpoint, "local/router");
  REQUIRE(wait_ready(c, "local/router", 30s));
  const std::pair<uint64_t, uint32_t> prompts[] = {{1, 32}, {2, 992}};
  const auto t0 = steady::now();
  for (const auto& [id, length] : prompts) {
    msg::submit s;
    s.request_id = id;
    for (uint32_t i = 0; i < length; ++i) s.prompt_tokens.push_back(static_cast<int32_t>(100 + i % 5000));
    s.sampling.temperature = 0.0f;
    s.sampling.max_new_tokens = 1;  // the first token ends each request
    REQUIRE(c.submit(s));
  }
  std::map<uint64_t, double> first_token_s;
  std::map<uint64_t, msg::finish> finishes;
  const auto until = t0 + 60s;
  while (finishes.size() < 2 && steady::now() < until) {
    for (auto& e : c.poll(10ms)) {
      if (e.what == client_event::kind::tokens && !first_token_s.contains(e.request_id))
        first_token_s[e.request_id] = std::chrono::duration<double>(steady::now() - t0).count();
      if (e.what == client_event::kind::finished) finishes[e.request_id] = e.finish;
    }
  }
  REQUIRE(finishes.size() == 2);
  for (const auto& [id, f] : finishes) {
    INFO("request " << id << ": " << f.message);
    CHECK(f.reason == msg::finish_reason::length);
  }
  REQUIRE(first_token_s.size() == 2);
  const auto stats = c.stats({"local/prefill0"}, 2s);
  REQUIRE(counter(stats, "local/prefill0", "steps") == 3);
  MESSAGE("first token of A " << first_token_s[1] << " s, of B " << first_token_s[2] << " s");
  // A's token comes after its own short step (~1/33 of the prefill work), not after B's first
  // chunk as well (~half of it).
  CHECK(first_token_s[1] < 0.25 * first_token_s[2]);
  n.stop();
}

TEST_CASE("a worker whose engine step runs past the stall limit is taken for stuck and its request answered") {
  if (!have_model()) return;
  // A short peer timeout, so a step of a second or more (any machine, 512 tokens on one core)
  // outlasts stall limit + timeout.
  const auto config = parse_config(one_node_toml("inproc://" + unique("duet-pipe-stall")) +
                                       "[transport]\npeer_timeout_ms = 1000\nheartbeat_ms = 200\n",
                                   "pipeline-stall.toml");
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  actor_timing timing;
  timing.step_stall = 300ms;  // a 512-token step on one core takes seconds
  node n(system, config, "local", timing);
  client c(config.nodes[0].endpoint, "local/router");
  REQUIRE(wait_ready(c, "local/router", 30s));
  msg::submit s;
  s.request_id = 1;
  for (uint32_t i = 0; i < 992; ++i) s.prompt_tokens.push_back(static_cast<int32_t>(100 + i));
  s.sampling.max_new_tokens = 4;
  REQUIRE(c.submit(s));
  std::optional<msg::finish> finish;
  const auto until = steady::now() + 60s;
  while (!finish && steady::now() < until) {
    for (auto& e : c.poll(10ms)) {
      if (e.what == client_event::kind::finished) finish = e.finish;
    }
  }
  REQUIRE(finish.has_value());
  CHECK(finish->reason == msg::finish_reason::error);
  CHECK(finish->message.find("local/prefill0 stopped answering") != std::string::npos);
  n.stop();
}

/// A prompt of about `tokens` tokens through the chat template: a long passage to summarize.
std::vector<int32_t> long_prompt(const deployment_config& config, std::size_t tokens) {
  const auto codec = make_text_codec(config);
  const auto chat = make_chat_renderer(*codec);
  std::string text = "Summarize this passage in one sentence:";
  std::vector<int32_t> out;
  for (int i = 0; out.size() < tokens; ++i) {
    text += " The river " + std::to_string(i) + " runs past the old mill, and the miller counts the sacks.";
    const std::vector<chat_message> messages{{"user", text}};
    out = codec->encode(chat->render(messages, true), chat->add_special_tokens());
  }
  return out;
}

/// Two processes over the stream path, `stream_prefill` on or off: the prompts' tokens against
/// `expected`, the counters, the pools; returns each request's first-to-second-token seconds.
std::vector<double> serve_streaming(const std::vector<std::vector<int32_t>>& prompts,
                                    const std::vector<std::vector<int32_t>>& expected, bool stream_prefill) {
  CAPTURE(stream_prefill);
  const std::string ep_p = "ipc:///tmp/" + unique("duet-pipe-sp") + ".sock";
  const std::string ep_d = "ipc:///tmp/" + unique("duet-pipe-sd") + ".sock";
  testing::temp_file file(unique("duet-pipe-stream-prefill") + ".toml", two_node_toml(ep_p, ep_d, true, stream_prefill));
  testing::child_process p({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "p"});
  testing::child_process d({testing::duet_binary(), "node", "--config", file.path.string(), "--name", "d"});
  client c(ep_p, "p/router");
  REQUIRE(wait_ready(c, "p/router", 30s));
  std::vector<double> gaps;
  const auto got = serve(c, prompts, &gaps);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    INFO("prompt " << i << " of " << prompts[i].size() << " tokens");
    CHECK(got[i] == expected[i]);
  }
  const auto stats = c.stats({"d/decode0", "p/prefill0", "p/broker"}, 2s);
  REQUIRE(stats.size() == 3);
  // With stream_prefill every prompt's blocks left before the broker's kv_send; the long
  // one's first chunk's while its second computed. They travel on the stream's connection and
  // the kv_adopt on the router's, so a one-chunk prompt's adoption may reach the decode worker
  // first (it then pulls as without streaming: seen under CPU load); the long prompt's blocks
  // are there hundreds of milliseconds before its adoption.
  const uint64_t streamed = stream_prefill ? prompts.size() : 0;
  CHECK(counter(stats, "p/prefill0", "stream_prefill_streams") == streamed);
  const uint64_t early = counter(stats, "d/decode0", "early_adoptions");
  CHECK(early <= streamed);
  CHECK((early >= 1) == stream_prefill);
  CHECK((counter(stats, "d/decode0", "early_bytes_received") > 0) == stream_prefill);
  CHECK(counter(stats, "d/decode0", "path_tcp") == prompts.size());
  CHECK(counter(stats, "d/decode0", "transfer_failures") == 0);
  CHECK(counter(stats, "d/decode0", "early_expired") == 0);
  std::string detail;
  CHECK_MESSAGE(pools_return_to_full(c, {"p/prefill0", "d/decode0", "p/broker"}, detail), detail);
  return gaps;
}

TEST_CASE("with stream_prefill a long prompt's KV streams to the decode process during its prefill, "
          "tokens unchanged") {
  if (!have_model()) return;
  const auto config = parse_config(two_node_toml("ipc:///tmp/x.sock", "ipc:///tmp/y.sock", true, true), "sp.toml");
  auto prompts = chat_prompts(config);
  prompts.push_back(long_prompt(config, 880));  // two 512-token chunks
  REQUIRE(prompts.back().size() > 512);
  const auto expected = reference_tokens(config, prompts);
  const auto after = serve_streaming(prompts, expected, false);
  const auto during = serve_streaming(prompts, expected, true);
  MESSAGE("long prompt (" << prompts.back().size() << " tokens), first to second token: " << after.back() * 1e3
                          << " ms with the KV streamed after prefill, " << during.back() * 1e3 << " ms during it");
}
