// The HTTP front end's overhead against the native ZeroMQ endpoint: one burst of streaming
// requests through run_burst (a duet::client) and the same burst through the OpenAI API
// (SSE over loopback, keep-alive connections), on one in-process sim deployment. Both drivers
// run in this process on the same cores as the cluster, so the CPU figures include the
// client's side of each protocol. Results: docs/http.md ("Overhead").
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <caf/all.hpp>
#include <nlohmann/json.hpp>

#include "actors/node.hpp"
#include "runtime/client.hpp"
#include "runtime/clock.hpp"
#include "runtime/config.hpp"
#include "runtime/http_frontend.hpp"
#include "runtime/latency_stats.hpp"
#include "runtime/load_driver.hpp"

namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

struct bench_options {
  uint32_t streams = 1000;
  uint32_t requests = 4000;
  uint32_t prompt_tokens = 64;
  uint32_t max_tokens = 64;
  double time_scale = 0.0;
  uint32_t io_threads = 2;
  uint32_t rounds = 2;
  std::string json_path;
};

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

/// CPU time of the calling thread: the driver's own share of the process's CPU.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double now_s() { return std::chrono::duration<double>(duet::steady::now().time_since_epoch()).count(); }

duet::deployment_config bench_config(const bench_options& o) {
  auto config = duet::default_config();
  config.engine.time_scale = o.time_scale;
  config.router.queue_limit = std::max<uint32_t>(4096, o.streams * 2);
  for (auto& node : config.nodes) {
    node.endpoint = "inproc://duet-http-bench";
    for (auto& a : node.actors) {
      a.kv_blocks = 65536;
      if (a.role == duet::actor_role::prefill) a.max_batch = 256;
      if (a.role == duet::actor_role::decode) a.max_batch = 1024;
    }
  }
  duet::validate_config(config);
  return config;
}

/// The prompt run_burst sends for request `id` (runtime/load_driver.cpp), as JSON ids.
std::string request_body(const std::string& model, uint32_t id, const bench_options& o) {
  std::string prompt = "[";
  for (uint32_t i = 0; i < o.prompt_tokens; ++i) {
    if (i) prompt += ',';
    prompt += std::to_string((i * 7919 + id) % 30000);
  }
  prompt += ']';
  return "{\"model\":\"" + model + "\",\"prompt\":" + prompt + ",\"max_tokens\":" + std::to_string(o.max_tokens) +
         ",\"temperature\":0,\"ignore_eos\":true,\"stream\":true,\"stream_options\":{\"include_usage\":true}}";
}

/// One keep-alive connection that streams requests one after another until the burst's
/// budget is spent, timing every SSE event as it arrives.
class sse_connection : public std::enable_shared_from_this<sse_connection> {
 public:
  struct shared_state {
    std::string model;
    bench_options options;
    uint16_t port = 0;
    std::atomic<int64_t> budget{0};
    std::atomic<uint32_t> next_id{0};
    std::mutex mu;
    std::vector<duet::request_record> records;
  };

  sse_connection(net::io_context& ioc, shared_state& state) : socket_(ioc), state_(state) {}

  void start() {
    socket_.async_connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), state_.port),
                          [self = shared_from_this()](boost::system::error_code ec) {
                            if (ec) {
                              std::fprintf(stderr, "connect: %s\n", ec.message().c_str());
                              return;
                            }
                            self->socket_.set_option(tcp::no_delay(true));
                            self->next();
                          });
  }

 private:
  void next() {
    if (state_.budget.fetch_sub(1) <= 0) {
      boost::system::error_code ignored;
      socket_.close(ignored);
      return;
    }
    const uint32_t id = state_.next_id.fetch_add(1);
    const std::string body = request_body(state_.model, id, state_.options);
    request_ = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
               std::to_string(body.size()) + "\r\n\r\n" + body;
    record_ = duet::request_record{};
    record_.id = id;
    record_.prompt_tokens = state_.options.prompt_tokens;
    record_.arrival_s = now_s();
    events_.clear();
    acc_.clear();
    scan_ = 0;
    net::async_write(socket_, net::buffer(request_), [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
      if (ec) return self->fail("write: " + ec.message());
      self->read();
    });
  }

  void read() {
    socket_.async_read_some(net::buffer(buf_), [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
      if (ec) return self->fail("read: " + ec.message());
      self->on_bytes(n);
    });
  }

  void on_bytes(std::size_t n) {
    const double t = now_s();
    acc_.append(buf_.data(), n);
    // Every "data: " is one event; the header holds none. Scan only the new bytes.
    for (std::size_t p = acc_.find("data: ", scan_); p != std::string::npos; p = acc_.find("data: ", p + 6)) {
      events_.push_back(t);
      scan_ = p + 6;
    }
    scan_ = std::max(scan_, acc_.size() > 6 ? acc_.size() - 6 : 0);
    if (acc_.size() >= 12 && acc_.ends_with("\r\n0\r\n\r\n") && acc_.find("data: [DONE]") != std::string::npos) {
      return finish();
    }
    read();
  }

  void finish() {
    record_.finish_s = now_s();
    const bool ok = acc_.starts_with("HTTP/1.1 200");
    const auto usage = acc_.rfind("\"completion_tokens\":");
    uint32_t tokens = 0;
    if (usage != std::string::npos) {
      const char* p = acc_.data() + usage + 20;
      std::from_chars(p, acc_.data() + acc_.size(), tokens);
    }
    record_.output_tokens = tokens;
    record_.outcome = ok && tokens == state_.options.max_tokens ? "ok" : "http_error";
    // Token events: all but the final chunk, the usage chunk and [DONE].
    const std::size_t token_events = events_.size() >= 3 ? events_.size() - 3 : 0;
    if (token_events > 0) {
      record_.first_token_s = events_[0];
      for (std::size_t i = 1; i < token_events; ++i) record_.itl_s.push_back(events_[i] - events_[i - 1]);
    }
    {
      std::lock_guard lk(state_.mu);
      state_.records.push_back(record_);
    }
    next();
  }

  void fail(const std::string& why) {
    record_.finish_s = now_s();
    record_.outcome = "client_error";
    {
      std::lock_guard lk(state_.mu);
      state_.records.push_back(record_);
    }
    std::fprintf(stderr, "http_overhead: %s\n", why.c_str());
  }

  tcp::socket socket_;
  shared_state& state_;
  std::string request_;
  std::array<char, 16384> buf_{};
  std::string acc_;
  std::size_t scan_ = 0;
  std::vector<double> events_;
  duet::request_record record_;
};

struct run_result {
  std::string name;
  double wall_s = 0;
  double cpu_s = 0;
  double driver_cpu_s = 0;  // the load driver's thread (client side)
  uint64_t tokens = 0;
  uint32_t completed = 0;
  duet::latency_summary summary;
};

run_result run_native(duet::client& c, const bench_options& o, const std::string& name) {
  duet::burst_options b;
  b.requests = o.requests;
  b.concurrency = o.streams;
  b.prompt_tokens = o.prompt_tokens;
  b.max_new_tokens = o.max_tokens;
  b.timeout = std::chrono::minutes(5);
  const double cpu0 = cpu_seconds(), t0 = now_s(), d0 = thread_cpu_seconds();
  const auto records = duet::run_burst(c, b);
  run_result r;
  r.name = name;
  r.wall_s = now_s() - t0;
  r.cpu_s = cpu_seconds() - cpu0;
  r.driver_cpu_s = thread_cpu_seconds() - d0;
  r.summary = duet::summarize(records, {}, r.wall_s);
  r.completed = static_cast<uint32_t>(r.summary.completed);
  r.tokens = r.summary.output_tokens;
  return r;
}

run_result run_http(uint16_t port, const std::string& model, const bench_options& o, const std::string& name) {
  net::io_context ioc(1);
  sse_connection::shared_state state;
  state.model = model;
  state.options = o;
  state.port = port;
  state.budget = o.requests;
  const double cpu0 = cpu_seconds(), t0 = now_s(), d0 = thread_cpu_seconds();
  for (uint32_t i = 0; i < o.streams; ++i) std::make_shared<sse_connection>(ioc, state)->start();
  ioc.run();
  run_result r;
  r.name = name;
  r.wall_s = now_s() - t0;
  r.cpu_s = cpu_seconds() - cpu0;
  r.driver_cpu_s = thread_cpu_seconds() - d0;
  r.summary = duet::summarize(state.records, {}, r.wall_s);
  r.completed = static_cast<uint32_t>(r.summary.completed);
  r.tokens = r.summary.output_tokens;
  return r;
}

nlohmann::json to_json(const run_result& r) {
  return {{"name", r.name},
          {"wall_s", r.wall_s},
          {"cpu_s", r.cpu_s},
          {"driver_cpu_s", r.driver_cpu_s},
          {"server_cpu_s", r.cpu_s - r.driver_cpu_s},
          {"tokens", r.tokens},
          {"completed", r.completed},
          {"summary", duet::to_json(r.summary)}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"HTTP front end overhead vs the native ZeroMQ endpoint (sim engine, loopback)"};
  bench_options o;
  app.add_option("--streams", o.streams, "concurrent streams (connections / requests in flight)");
  app.add_option("--requests", o.requests, "requests per run");
  app.add_option("--prompt-tokens", o.prompt_tokens, "prompt length");
  app.add_option("--max-tokens", o.max_tokens, "tokens generated per request");
  app.add_option("--time-scale", o.time_scale, "sim engine time scale (0 = no modelled waiting)");
  app.add_option("--io-threads", o.io_threads, "HTTP server threads");
  app.add_option("--rounds", o.rounds, "measured rounds of each (the best is reported)");
  app.add_option("--json", o.json_path, "also write the figures here");
  CLI11_PARSE(app, argc, argv);

  duet::raise_fd_limit();
  const auto config = bench_config(o);
  caf::actor_system_config cfg;
  caf::actor_system system{cfg};
  std::vector<std::unique_ptr<duet::node>> nodes;
  for (const auto& n : config.nodes) nodes.push_back(std::make_unique<duet::node>(system, config, n.name));
  auto settings = duet::http_settings_from_config(config, "127.0.0.1:0");
  settings.io_threads = o.io_threads;
  duet::http_frontend frontend(settings, duet::make_text_codec(config));
  frontend.start();
  const auto until = duet::steady::now() + std::chrono::seconds(10);
  while (!frontend.ready() && duet::steady::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (!frontend.ready()) {
    std::fprintf(stderr, "http_overhead: the cluster did not become ready\n");
    return 1;
  }
  duet::client c(settings.router_endpoint, settings.router_address);

  std::printf("http_overhead: %u requests, %u concurrent streams, %u prompt + %u generated tokens, sim time_scale %g, "
              "%u HTTP threads, %u cores\n",
              o.requests, o.streams, o.prompt_tokens, o.max_tokens, o.time_scale, o.io_threads,
              std::thread::hardware_concurrency());
  {
    bench_options warm = o;
    warm.requests = std::min(o.requests, o.streams);
    (void)run_native(c, warm, "warmup");
    (void)run_http(frontend.port(), config.model.name, warm, "warmup");
  }
  run_result native, http;
  for (uint32_t round = 0; round < std::max<uint32_t>(1, o.rounds); ++round) {
    auto n = run_native(c, o, "native zmq");
    auto h = run_http(frontend.port(), config.model.name, o, "http sse");
    std::printf("  round %u: native %.3f s (%.3f cpu-s, driver %.3f), http %.3f s (%.3f cpu-s, driver %.3f)\n",
                round + 1, n.wall_s, n.cpu_s, n.driver_cpu_s, h.wall_s, h.cpu_s, h.driver_cpu_s);
    if (round == 0 || n.wall_s < native.wall_s) native = std::move(n);
    if (round == 0 || h.wall_s < http.wall_s) http = std::move(h);
  }
  const std::pair<std::string, duet::latency_summary> runs[] = {{native.name, native.summary},
                                                                {http.name, http.summary}};
  std::printf("%s", duet::format_comparison_table(runs).c_str());
  const double reqs = o.requests, tokens = std::max<double>(1, static_cast<double>(http.tokens));
  const double wall_extra = http.wall_s / native.wall_s - 1;
  const double per_request_us = (http.wall_s - native.wall_s) / reqs * 1e6;
  const double per_token_us = (http.wall_s - native.wall_s) / tokens * 1e6;
  const double cpu_per_request_us = (http.cpu_s - native.cpu_s) / reqs * 1e6;
  const double cpu_per_token_us = (http.cpu_s - native.cpu_s) / tokens * 1e6;
  // The server's side alone: the process's CPU less the load driver's thread.
  const double server_native = native.cpu_s - native.driver_cpu_s, server_http = http.cpu_s - http.driver_cpu_s;
  const double server_per_request_us = (server_http - server_native) / reqs * 1e6;
  const double server_per_token_us = (server_http - server_native) / tokens * 1e6;
  std::printf("completed: native %u / %u, http %u / %u\n", native.completed, o.requests, http.completed, o.requests);
  std::printf("wall time: native %.3f s, http %.3f s: %+.1f%%\n", native.wall_s, http.wall_s, wall_extra * 100);
  std::printf("extra wall time per request %.1f us, per streamed token %.2f us\n", per_request_us, per_token_us);
  std::printf("cpu: native %.3f s, http %.3f s: extra %.1f us per request, %.2f us per streamed token (%+.1f%%)\n",
              native.cpu_s, http.cpu_s, cpu_per_request_us, cpu_per_token_us, (http.cpu_s / native.cpu_s - 1) * 100);
  std::printf("server cpu (less the driver thread): native %.3f s, http %.3f s: extra %.1f us per request, %.2f us per "
              "streamed token (%+.1f%%)\n",
              server_native, server_http, server_per_request_us, server_per_token_us,
              (server_http / server_native - 1) * 100);
  std::printf("ttft p50: native %.2f ms, http %.2f ms; tpot p50: native %.3f ms, http %.3f ms\n",
              native.summary.ttft_s.p50 * 1e3, http.summary.ttft_s.p50 * 1e3, native.summary.tpot_s.p50 * 1e3,
              http.summary.tpot_s.p50 * 1e3);
  if (!o.json_path.empty()) {
    nlohmann::json j{{"options",
                      {{"streams", o.streams},
                       {"requests", o.requests},
                       {"prompt_tokens", o.prompt_tokens},
                       {"max_tokens", o.max_tokens},
                       {"time_scale", o.time_scale},
                       {"io_threads", o.io_threads}}},
                     {"native", to_json(native)},
                     {"http", to_json(http)},
                     {"wall_extra_fraction", wall_extra},
                     {"extra_wall_us_per_request", per_request_us},
                     {"extra_wall_us_per_token", per_token_us},
                     {"extra_cpu_us_per_request", cpu_per_request_us},
                     {"extra_cpu_us_per_token", cpu_per_token_us},
                     {"extra_server_cpu_us_per_request", server_per_request_us},
                     {"extra_server_cpu_us_per_token", server_per_token_us}};
    std::ofstream(o.json_path) << j.dump(2) << '\n';
  }
  frontend.stop();
  for (auto& n : nodes) n->stop();
  const bool ok = native.completed == o.requests && http.completed == o.requests;
  return ok ? 0 : 1;
}
