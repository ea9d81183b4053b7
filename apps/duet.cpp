// duet: one binary, subcommands. `duet --help` lists them.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdio>
#include <iostream>
#include <thread>

#include "actors/node.hpp"
#include "runtime/clock.hpp"
#include "runtime/client.hpp"
#include "runtime/config.hpp"
#include "runtime/http_frontend.hpp"
#include "runtime/load_driver.hpp"
#include "runtime/version.hpp"
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
  caf::actor_system_config cfg;
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

int run_up(const std::string& config_path, bool threads, const std::string& http, const std::string& api_key) {
  auto config = load_or_default(config_path);
  if (!threads && !all_inproc(config) && !config_path.empty()) return run_up_processes(config_path, config, http, api_key);
  caf::actor_system_config cfg;
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

struct router_location {
  std::string endpoint;
  std::string address;
};

router_location find_router(const duet::deployment_config& config) {
  for (const auto& n : config.nodes) {
    for (const auto& a : n.actors) {
      if (a.role == duet::actor_role::router) return {n.endpoint, n.name + "/" + a.name};
    }
  }
  throw duet::config_error("the deployment has no router");
}

/// Waits until the router reports live prefill and decode workers (bounded).
bool wait_ready(duet::client& c, const std::string& router, std::chrono::milliseconds timeout) {
  const auto until = duet::steady::now() + timeout;
  while (duet::steady::now() < until) {
    auto replies = c.stats({router}, std::chrono::milliseconds(200));
    if (!replies.empty() && replies[0].counters["ready_prefill"] > 0 && replies[0].counters["ready_decode"] > 0) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
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

int run_demo(const std::string& config_path, duet::burst_options options) {
  auto config = load_or_default(config_path);
  caf::actor_system_config cfg;
  caf::actor_system system{cfg};
  auto nodes = start_nodes(system, config);
  const auto router = find_router(config);
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

int run_client(const std::string& config_path, std::string endpoint, std::string router, const std::string& prompt,
               const std::string& tokens, uint32_t max_new, double temperature, uint32_t timeout_ms) {
  if (endpoint.empty() || router.empty()) {
    const auto loc = find_router(load_or_default(config_path));
    if (endpoint.empty()) endpoint = loc.endpoint;
    if (router.empty()) router = loc.address;
  }
  if (endpoint.starts_with("inproc://")) {
    std::fprintf(stderr, "duet client: %s is in-process only; give a deployment with ipc:// or tcp:// endpoints\n",
                 endpoint.c_str());
    return 2;
  }
  duet::client c(endpoint, router);
  duet::msg::submit s;
  s.request_id = 1;
  s.prompt = prompt;
  if (!tokens.empty()) s.prompt_tokens = parse_token_list(tokens);
  s.sampling.max_new_tokens = max_new;
  s.sampling.temperature = static_cast<float>(temperature);
  if (!c.submit(s)) {
    std::fprintf(stderr, "duet client: cannot reach %s\n", endpoint.c_str());
    return 1;
  }
  const auto until = duet::steady::now() + std::chrono::milliseconds(timeout_ms);
  while (duet::steady::now() < until) {
    for (auto& e : c.poll(std::chrono::milliseconds(50))) {
      switch (e.what) {
        case duet::client_event::kind::admitted: break;
        case duet::client_event::kind::rejected:
          std::fprintf(stderr, "rejected (%s): %s\n", std::string(duet::msg::to_string(e.rejection.code)).c_str(),
                       e.rejection.message.c_str());
          return 1;
        case duet::client_event::kind::tokens:
          for (int32_t t : e.tokens) std::printf("%d ", t);
          std::fflush(stdout);
          break;
        case duet::client_event::kind::finished:
          std::printf("\n[finish: %s%s%s, %u prompt + %u completion tokens]\n",
                      std::string(duet::msg::to_string(e.finish.reason)).c_str(), e.finish.message.empty() ? "" : ": ",
                      e.finish.message.c_str(), e.finish.prompt_tokens, e.finish.completion_tokens);
          return e.finish.reason == duet::msg::finish_reason::stop || e.finish.reason == duet::msg::finish_reason::length ? 0 : 1;
      }
    }
  }
  c.cancel(1);
  std::fprintf(stderr, "duet client: no answer within %u ms\n", timeout_ms);
  return 1;
}

int run_stats(const std::string& config_path, uint32_t timeout_ms) {
  auto config = load_or_default(config_path);
  const auto loc = find_router(config);
  duet::client c(loc.endpoint, loc.address);
  std::vector<std::string> actors = pool_actors(config);
  actors.push_back(loc.address);
  for (auto& r : c.stats(actors, std::chrono::milliseconds(timeout_ms))) {
    std::printf("%s (%s): blocks free %u / %u\n", r.actor.c_str(), r.role.c_str(), r.free_blocks, r.total_blocks);
    for (auto& [k, v] : r.counters) std::printf("    %-32s %llu\n", k.c_str(), (unsigned long long)v);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"duet: prefill/decode-disaggregated LLM serving"};
  app.set_version_flag("--version", std::string(duet::build_description()));
  app.require_subcommand(1);
  std::string config_path;

  auto* up = app.add_subcommand("up", "start every node of a deployment on this host (default: built-in sim deployment)");
  bool threads = false;
  std::string http, api_key;
  up->add_option("--config", config_path, "deployment TOML file");
  up->add_flag("--threads", threads, "run all nodes as threads of this process, even with ipc/tcp endpoints");
  up->add_option("--http", http, "serve the OpenAI-compatible HTTP API on HOST:PORT (the router's node)");
  up->add_option("--api-key", api_key, "require this Bearer key on /v1/* (default: env DUET_API_KEY)");

  auto* node_cmd = app.add_subcommand("node", "start one node of a deployment");
  std::string node_name;
  node_cmd->add_option("--config", config_path, "deployment TOML file")->required();
  node_cmd->add_option("--name", node_name, "node name in the config")->required();
  node_cmd->add_option("--http", http, "serve the OpenAI-compatible HTTP API on HOST:PORT (overrides the config)");
  node_cmd->add_option("--api-key", api_key, "require this Bearer key on /v1/* (default: env DUET_API_KEY)");

  auto* demo = app.add_subcommand("demo", "start the deployment in this process, serve a burst of requests, print latencies");
  duet::burst_options burst;
  burst.requests = 200;
  burst.concurrency = 200;
  burst.max_new_tokens = 128;
  demo->add_option("--config", config_path, "deployment TOML file (default: built-in sim deployment)");
  demo->add_option("--requests", burst.requests, "requests in the burst")->check(CLI::PositiveNumber);
  demo->add_option("--concurrency", burst.concurrency, "requests in flight at once")->check(CLI::PositiveNumber);
  demo->add_option("--prompt-tokens", burst.prompt_tokens, "prompt length")->check(CLI::PositiveNumber);
  demo->add_option("--max-new-tokens", burst.max_new_tokens, "tokens to generate")->check(CLI::PositiveNumber);

  auto* client_cmd = app.add_subcommand("client", "submit one request and stream its tokens");
  std::string endpoint, router, prompt, tokens;
  uint32_t max_new = 16, timeout_ms = 30000, stats_timeout_ms = 2000;
  double temperature = 0.0;
  client_cmd->add_option("--config", config_path, "deployment TOML file (finds the router)");
  client_cmd->add_option("--endpoint", endpoint, "router node endpoint, e.g. ipc:///tmp/duet-n1.sock");
  client_cmd->add_option("--router", router, "router address, e.g. n1/router");
  client_cmd->add_option("--prompt", prompt, "prompt text");
  client_cmd->add_option("--tokens", tokens, "prompt token ids, comma separated");
  client_cmd->add_option("--max-new-tokens", max_new, "tokens to generate")->check(CLI::PositiveNumber);
  client_cmd->add_option("--temperature", temperature, "sampling temperature (0 = greedy)");
  client_cmd->add_option("--timeout-ms", timeout_ms, "give up after this long");

  auto* stats_cmd = app.add_subcommand("stats", "print every actor's counters and KV pool");
  stats_cmd->add_option("--config", config_path, "deployment TOML file")->required();
  stats_cmd->add_option("--timeout-ms", stats_timeout_ms, "wait this long for replies");

  duet::sim_commands sim_cmds(app);  // `duet sim` and `duet plan` (sim/cli.hpp)

  CLI11_PARSE(app, argc, argv);
  install_signal_handlers();
  try {
    if (*up) return run_up(config_path, threads, http, api_key);
    if (*node_cmd) return run_node(config_path, node_name, http, api_key);
    if (*demo) return run_demo(config_path, burst);
    if (*client_cmd) return run_client(config_path, endpoint, router, prompt, tokens, max_new, temperature, timeout_ms);
    if (*stats_cmd) return run_stats(config_path, stats_timeout_ms);
    if (sim_cmds.selected()) return sim_cmds.run();
  } catch (const duet::config_error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet: %s\n", e.what());
    return 1;
  }
  return 0;
}
