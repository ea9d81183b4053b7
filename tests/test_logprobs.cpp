// Log-probabilities end to end: what a client receives through a live cluster (prefill samples
// the first token, the router sends it, decode the rest) equals, bit for bit, what the CPU
// engine's own sampler reports in last_samples() for the same greedy prompt run alone.
#include <doctest/doctest.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "tests/cluster_ready.hpp"
#include "actors/node.hpp"
#include "runtime/client.hpp"
#include "runtime/clock.hpp"
#include "runtime/config.hpp"
#include "runtime/cpu_engine.hpp"
#include "runtime/engine.hpp"
#include "runtime/http_api.hpp"
#include "runtime/random_checkpoint.hpp"

namespace fs = std::filesystem;
using namespace duet;
using namespace std::chrono_literals;

namespace {

struct temp_dir {
  fs::path path;
  temp_dir() {
    path = fs::temp_directory_path() /
           ("duet-logprobs-" + std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}() % 100000));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

constexpr uint32_t max_new = 6;
constexpr uint32_t kv_blocks = 32;

/// A tiny random Llama (2 layers, hidden 64, the real vocabulary) with the Llama 3.1 tokenizer.
const fs::path& tiny_checkpoint() {
  static temp_dir dir;
  static bool written = false;
  if (!written) {
    random_checkpoint_params p;
    p.arch = "llama";
    p.size = "tiny";
    p.seed = 7;
    p.dtype = "bf16";
    p.tokenizer_dir = fs::path(DUET_SOURCE_DIR) / "tests/data/tokenizers/llama3_1";
    (void)write_random_checkpoint(dir.path, p);
    written = true;
  }
  return dir.path;
}

std::string one_node_toml(const std::string& endpoint, const std::string& first_token) {
  std::string t = R"([model]
name = "tiny-llama"
path = ")" + tiny_checkpoint().string() + R"("
max_context = 1024
[engine]
kind = "cpu"
threads = 1
[router]
request_timeout_ms = 60000
first_token = ")" + first_token + R"("
[[nodes]]
name = "local"
endpoint = ")" + endpoint + "\"\n";
  for (const auto& [name, role] : std::vector<std::pair<std::string, std::string>>{
           {"router", "router"}, {"broker", "broker"}, {"prefill0", "prefill"}, {"decode0", "decode"}}) {
    t += "[[nodes.actors]]\nname = \"" + name + "\"\nrole = \"" + role + "\"\n";
    if (role == "prefill" || role == "decode") t += "kv_blocks = " + std::to_string(kv_blocks) + "\n";
  }
  return t;
}

msg::sampling_params greedy_with_logprobs(uint32_t top) {
  msg::sampling_params s;
  s.temperature = 0.0f;
  s.max_new_tokens = max_new;
  s.ignore_eos = true;  // random weights may pick an eos at once
  s.logprobs = true;
  s.top_logprobs = top;
  return s;
}

/// The engine alone: prefill then greedy decode steps; each step's last_samples()[0].
std::vector<sample_result> engine_samples(const deployment_config& config, const std::vector<int32_t>& prompt,
                                          const msg::sampling_params& sampling) {
  actor_config actor;
  actor.role = actor_role::prefill;
  actor.kv_blocks = kv_blocks;
  auto e = make_engine(config, actor);
  auto* cpu = dynamic_cast<cpu_engine*>(e.get());
  REQUIRE(cpu != nullptr);
  const uint32_t bt = e->info().block_tokens;
  std::vector<uint32_t> blocks((prompt.size() + max_new + bt - 1) / bt);
  for (uint32_t i = 0; i < blocks.size(); ++i) blocks[i] = i;
  std::vector<sample_result> out;
  auto keep = [&](const step_output& step) {
    REQUIRE(step.tokens.size() == 1);
    REQUIRE(cpu->last_samples().size() == 1);
    const sample_result& s = cpu->last_samples()[0];
    CHECK(step.tokens[0] == s.token);
    // step_output carries the same values the sampler reported.
    const msg::token_logprobs* lp = step.logprobs_at(0);
    REQUIRE(lp != nullptr);
    CHECK(lp->logprob == s.logprob);
    REQUIRE(lp->top_ids.size() == s.top.size());
    for (std::size_t k = 0; k < s.top.size(); ++k) {
      CHECK(lp->top_ids[k] == s.top[k].token);
      CHECK(lp->top_logprobs[k] == s.top[k].logprob);
    }
    out.push_back(s);
  };
  prefill_chunk chunk{.seq_id = 1, .tokens = prompt, .start = 0, .blocks = blocks, .last = true, .sampling = &sampling};
  keep(e->prefill(std::span<const prefill_chunk>(&chunk, 1)));
  std::vector<int32_t> history = prompt;
  history.push_back(out.back().token);
  while (out.size() < max_new) {
    decode_slot slot{.seq_id = 1, .history = history, .blocks = blocks, .sampling = &sampling};
    keep(e->decode(std::span<const decode_slot>(&slot, 1)));
    history.push_back(out.back().token);
  }
  return out;
}

using testing::wait_ready;

}  // namespace

/// `first_token`: router.first_token, who sends output token 0 and its log-probabilities.
void check_logprobs_reach_the_client(const std::string& first_token) {
  CAPTURE(first_token);
  static std::atomic<int> run{0};  // each subcase runs the case again: a fresh endpoint each time
  const auto config = parse_config(
      one_node_toml("inproc://duet-logprobs-" + std::to_string(::getpid()) + "-" + std::to_string(run++), first_token),
      "logprobs.toml");
  const std::vector<int32_t> prompt{128000, 9906, 1917, 11, 1268, 527, 499, 30};
  const auto with_top = greedy_with_logprobs(5);
  const auto expected = engine_samples(config, prompt, with_top);
  REQUIRE(expected.size() == max_new);
  for (const auto& s : expected) CHECK(s.top.size() == 5);

  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  node n(system, config, "local");
  client c(config.nodes[0].endpoint, "local/router");
  REQUIRE(wait_ready(c, "local/router", 30s));

  SUBCASE("with top alternatives") {
    msg::submit s;
    s.request_id = 1;
    s.prompt_tokens = prompt;
    s.sampling = with_top;
    const auto g = c.generate(s, 60s);
    REQUIRE(g.finish.has_value());
    CHECK(g.finish->reason == msg::finish_reason::length);
    REQUIRE(g.tokens.size() == expected.size());
    REQUIRE(g.logprobs.size() == expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      INFO("output token " << i << (i == 0 ? " (sampled by prefill, sent by the " + first_token + " side)" : " (decode)"));
      CHECK(g.tokens[i] == expected[i].token);
      REQUIRE(g.logprobs[i].has_value());
      CHECK(g.logprobs[i]->logprob == expected[i].logprob);
      REQUIRE(g.logprobs[i]->top_ids.size() == expected[i].top.size());
      for (std::size_t k = 0; k < expected[i].top.size(); ++k) {
        CHECK(g.logprobs[i]->top_ids[k] == expected[i].top[k].token);
        CHECK(g.logprobs[i]->top_logprobs[k] == expected[i].top[k].logprob);
      }
      CHECK(g.logprobs[i]->top_ids.front() == g.tokens[i]);  // greedy: the sampled token is the top one
    }

    // The HTTP front end renders those values as they are (OpenAI's chat shape).
    logprobs_writer w(api_kind::chat, std::make_shared<byte_text_codec>());
    for (std::size_t i = 0; i < g.tokens.size(); ++i) w.add(g.tokens[i], *g.logprobs[i]);
    const auto j = w.take();
    REQUIRE(j["content"].size() == expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      CHECK(j["content"][i]["logprob"].get<float>() == expected[i].logprob);
      CHECK(j["content"][i]["top_logprobs"].size() == 5);
      CHECK(j["content"][i]["top_logprobs"][0]["logprob"].get<float>() == expected[i].top[0].logprob);
    }
  }

  SUBCASE("logprobs without alternatives: the same logprob, an empty top list") {
    msg::submit s;
    s.request_id = 2;
    s.prompt_tokens = prompt;
    s.sampling = greedy_with_logprobs(0);
    const auto g = c.generate(s, 60s);
    REQUIRE(g.finish.has_value());
    REQUIRE(g.logprobs.size() == expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      CHECK(g.tokens[i] == expected[i].token);
      REQUIRE(g.logprobs[i].has_value());
      CHECK(g.logprobs[i]->logprob == expected[i].logprob);
      CHECK(g.logprobs[i]->top_ids.empty());
    }
  }

  SUBCASE("a request that does not ask gets none") {
    msg::submit s;
    s.request_id = 3;
    s.prompt_tokens = prompt;
    s.sampling = greedy_with_logprobs(0);
    s.sampling.logprobs = false;
    const auto g = c.generate(s, 60s);
    REQUIRE(g.finish.has_value());
    REQUIRE(g.tokens.size() == expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) CHECK(g.tokens[i] == expected[i].token);
    for (const auto& lp : g.logprobs) CHECK_FALSE(lp.has_value());
  }
  n.stop();
}

TEST_CASE("a client receives exactly the log-probabilities the CPU engine's sampler computed") {
  check_logprobs_reach_the_client("prefill");
}

TEST_CASE("with router.first_token = decode the first token's log-probabilities reach the client through the decode worker") {
  check_logprobs_reach_the_client("decode");
}
