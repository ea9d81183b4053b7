#include "runtime/http_frontend.hpp"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "runtime/client.hpp"
#include "runtime/clock.hpp"
#include "runtime/config.hpp"
#include "runtime/latency_stats.hpp"
#include "runtime/vocab_check.hpp"

namespace duet {

namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using json = nlohmann::json;

namespace {

// ------------------------------------------------------------------ metrics

/// 100 us .. ~52 s in doublings: ITL at time_scale 0 is sub-millisecond.
std::vector<double> latency_buckets() { return latency_histogram::exponential_buckets(0.0001, 2.0, 20); }

/// What the front end measures itself. Counters are atomics; histograms sit under a lock.
struct frontend_metrics {
  std::atomic<int64_t> http_in_flight{0};      // generation requests being served
  std::atomic<int64_t> upstream_in_flight{0};  // submitted to the router, no final answer yet
  std::atomic<int64_t> connections_open{0};
  std::atomic<uint64_t> connections_total{0};
  std::atomic<uint64_t> connections_refused{0};
  std::atomic<uint64_t> connection_timeouts{0};
  std::atomic<uint64_t> prompt_tokens{0};
  std::atomic<uint64_t> completion_tokens{0};

  std::mutex mu;
  std::map<std::pair<std::string, std::string>, uint64_t> requests;  // (endpoint, outcome)
  latency_histogram ttft{latency_buckets()};
  latency_histogram itl{latency_buckets()};
  latency_histogram e2e{latency_buckets()};

  void count(std::string_view endpoint, std::string_view outcome) {
    std::lock_guard lk(mu);
    ++requests[{std::string(endpoint), std::string(outcome)}];
  }
};

/// The actors' counters from the last poll.
struct cluster_view {
  mutable std::mutex mu;
  std::vector<msg::stats_reply> replies;
  std::vector<std::string> silent;  // actors that did not answer the last poll
  steady::time_point updated{};
  // From the router's last answer, which a poll it misses does not clear: a router busy past
  // one poll's wait (a burst's end) is slow, not gone. Stale after 3 s.
  steady::time_point router_seen{};
  uint64_t ready_prefill = 0;
  uint64_t ready_decode = 0;
  bool router_answered = false;  // ever
  uint64_t polls = 0;
};

/// Names the calling thread (top, perf and gdb show it).
void name_thread(const char* name) { pthread_setname_np(pthread_self(), name); }

std::string escape_label(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

/// The outcome label of an error response.
std::string_view outcome_of(const api_error& e) {
  if (e.code == "context_length_exceeded") return "context_length_exceeded";
  switch (e.status) {
    case 400: return "bad_request";
    case 401: return "unauthorized";
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 413: return "too_large";
    case 429: return "overloaded";
    case 503: return "unavailable";
    case 504: return "timeout";
    default: return "error";
  }
}

/// A cluster client named "<prefix>-<pid>-<random>"; a bad endpoint is a runtime_error.
std::unique_ptr<client> connect_client(const std::string& endpoint, const std::string& router, const std::string& prefix) {
  std::random_device rd;
  try {
    return std::make_unique<client>(endpoint, router,
                                    prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(rd() % 1000000));
  } catch (const zmq::error_t& e) {
    throw std::runtime_error("HTTP front end: cannot connect to the router at " + endpoint + ": " + e.what());
  }
}

// ------------------------------------------------------------------ bridge

/// Whoever waits for a request's events (a connection); called on its shard's strand.
class upstream_receiver {
 public:
  virtual ~upstream_receiver() = default;
  virtual void on_upstream(uint64_t id, std::vector<client_event>&& events, steady::time_point at) = 0;
};

/// One request's events of one bridge round, on the way to its receiver.
struct delivery {
  std::shared_ptr<upstream_receiver> to;
  uint64_t id = 0;
  std::vector<client_event> events;
  steady::time_point at;
};

/// Owns the cluster client on its own thread. Connections submit and cancel through a
/// queue. Each round's events are grouped per request and handed over per shard (one post
/// per shard per round, not one per request: a decode step reaches every stream at once).
/// Every request leaves the bridge: by its final answer from the cluster, or by the front
/// end's own timeout (a synthetic timeout finish, and a cancel).
class bridge {
 public:
  /// Called on the bridge thread with one shard's deliveries; it posts them to the shard.
  using deliver_fn = std::function<void(uint32_t shard, std::vector<delivery>&&)>;

  bridge(std::string endpoint, std::string router, std::chrono::milliseconds request_timeout,
         frontend_metrics& metrics, uint32_t shards, deliver_fn deliver)
      : endpoint_(std::move(endpoint)),
        router_(std::move(router)),
        request_timeout_(request_timeout),
        metrics_(metrics),
        deliver_(std::move(deliver)),
        batches_(std::max<uint32_t>(1, shards)) {}
  ~bridge() { stop(); }

  void start() {
    client_ = connect_client(endpoint_, router_, "duet-http");
    thread_ = std::thread([this] {
      name_thread("duet-http-zmq");
      run();
    });
  }

  void stop() {
    {
      std::lock_guard lk(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  [[nodiscard]] uint64_t next_id() { return next_id_.fetch_add(1); }

  void submit(msg::submit s, std::shared_ptr<upstream_receiver> to, uint32_t shard) {
    push(command{command::kind::submit, std::move(s), std::move(to), shard, 0});
  }
  void cancel(uint64_t id) { push(command{command::kind::cancel, {}, {}, 0, id}); }

 private:
  struct command {
    enum class kind : uint8_t { submit, cancel } what;
    msg::submit request;
    std::shared_ptr<upstream_receiver> to;
    uint32_t shard = 0;
    uint64_t id = 0;
  };
  struct entry {
    std::shared_ptr<upstream_receiver> to;
    uint32_t shard = 0;
    steady::time_point since;
    bool cancelled = false;
    steady::time_point cancelled_at{};
  };

  void push(command c) {
    {
      std::lock_guard lk(mu_);
      if (stop_) return;
      commands_.push_back(std::move(c));
    }
    cv_.notify_one();
  }

  void queue(uint32_t shard, const std::shared_ptr<upstream_receiver>& to, uint64_t id,
             std::vector<client_event>&& events, steady::time_point at) {
    batches_[shard % batches_.size()].push_back(delivery{to, id, std::move(events), at});
  }

  void hand_over() {
    for (uint32_t shard = 0; shard < batches_.size(); ++shard) {
      if (!batches_[shard].empty()) deliver_(shard, std::exchange(batches_[shard], {}));
    }
  }

  void erase(std::unordered_map<uint64_t, entry>& live, uint64_t id) {
    if (live.erase(id)) --metrics_.upstream_in_flight;
  }

  static client_event synthetic_finish(uint64_t id, msg::finish_reason reason, msg::error_code code,
                                       std::string message) {
    client_event e;
    e.what = client_event::kind::finished;
    e.request_id = id;
    e.finish.request_id = id;
    e.finish.reason = reason;
    e.finish.code = code;
    e.finish.message = std::move(message);
    return e;
  }

  void run() {
    client& c = *client_;  // this thread owns it from here on
    std::unordered_map<uint64_t, entry> live;
    std::vector<command> batch;
    auto last_sweep = steady::now();
    for (;;) {
      {
        std::unique_lock lk(mu_);
        if (live.empty() && commands_.empty() && !stop_) cv_.wait_for(lk, std::chrono::milliseconds(200));
        if (stop_) break;
        batch.swap(commands_);
      }
      auto now = steady::now();
      for (auto& cmd : batch) {
        if (cmd.what == command::kind::submit) {
          const uint64_t id = cmd.request.request_id;
          if (!c.submit(cmd.request)) {
            client_event e;
            e.what = client_event::kind::rejected;
            e.request_id = id;
            e.rejection = msg::rejected{id, msg::error_code::unavailable, "the router is unreachable", 1000};
            std::vector<client_event> one;
            one.push_back(std::move(e));
            queue(cmd.shard, cmd.to, id, std::move(one), now);
            continue;
          }
          live.emplace(id, entry{std::move(cmd.to), cmd.shard, now});
          ++metrics_.upstream_in_flight;
        } else if (auto it = live.find(cmd.id); it != live.end() && !it->second.cancelled) {
          c.cancel(cmd.id);
          it->second.cancelled = true;
          it->second.cancelled_at = now;
        }
      }
      batch.clear();
      if (!live.empty()) {
        auto events = c.poll(std::chrono::milliseconds(1));
        now = steady::now();
        // Group per request, keeping each request's order; one delivery per request per round.
        std::stable_sort(events.begin(), events.end(),
                         [](const client_event& a, const client_event& b) { return a.request_id < b.request_id; });
        for (std::size_t i = 0; i < events.size();) {
          std::size_t j = i;
          bool final = false;
          while (j < events.size() && events[j].request_id == events[i].request_id) {
            final = final || events[j].what == client_event::kind::finished ||
                    events[j].what == client_event::kind::rejected;
            ++j;
          }
          const uint64_t id = events[i].request_id;
          if (auto it = live.find(id); it != live.end()) {
            std::vector<client_event> mine(std::make_move_iterator(events.begin() + static_cast<std::ptrdiff_t>(i)),
                                           std::make_move_iterator(events.begin() + static_cast<std::ptrdiff_t>(j)));
            if (!it->second.cancelled) queue(it->second.shard, it->second.to, id, std::move(mine), now);
            if (final) erase(live, id);
          }
          i = j;
        }
      }
      if (now - last_sweep > std::chrono::milliseconds(500)) {
        last_sweep = now;
        std::vector<uint64_t> expired;
        for (auto& [id, e] : live) {
          if (e.cancelled ? now - e.cancelled_at > std::chrono::seconds(30) : now - e.since > request_timeout_) {
            expired.push_back(id);
          }
        }
        for (uint64_t id : expired) {
          auto& e = live.at(id);
          if (!e.cancelled) {
            c.cancel(id);
            std::vector<client_event> one;
            one.push_back(synthetic_finish(id, msg::finish_reason::timeout, msg::error_code::timeout,
                                           "no final answer from the cluster within the request timeout"));
            queue(e.shard, e.to, id, std::move(one), now);
          }
          erase(live, id);
        }
      }
      hand_over();
    }
    for (auto& [id, e] : live) c.cancel(id);
    metrics_.upstream_in_flight -= static_cast<int64_t>(live.size());
    live.clear();
  }

  std::string endpoint_;
  std::string router_;
  std::chrono::milliseconds request_timeout_;
  frontend_metrics& metrics_;
  deliver_fn deliver_;
  std::vector<std::vector<delivery>> batches_;  // per shard, this round
  std::unique_ptr<client> client_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<command> commands_;
  bool stop_ = false;
  std::thread thread_;
  std::atomic<uint64_t> next_id_{1};
};

// ------------------------------------------------------------------ stats polling

/// Polls the router and the pool actors every interval through a client of its own (a
/// blocking stats() round must never hold up the bridge's token traffic).
class stats_poller {
 public:
  stats_poller(std::string endpoint, std::string router, std::vector<std::string> actors,
               std::chrono::milliseconds interval, cluster_view& view)
      : endpoint_(std::move(endpoint)),
        router_(std::move(router)),
        actors_(std::move(actors)),
        interval_(interval),
        view_(view) {}
  ~stats_poller() { stop(); }

  void start() {
    client_ = connect_client(endpoint_, router_, "duet-http-stats");
    thread_ = std::thread([this] {
      name_thread("duet-http-stats");
      run();
    });
  }
  void stop() {
    {
      std::lock_guard lk(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    client& c = *client_;
    std::vector<std::string> all = actors_;
    all.insert(all.begin(), router_);
    const auto wait = std::max(std::chrono::milliseconds(50), interval_ * 4 / 5);
    for (;;) {
      auto replies = c.stats(all, wait);
      {
        std::lock_guard lk(view_.mu);
        view_.silent.clear();
        for (const auto& a : all) {
          auto r = std::find_if(replies.begin(), replies.end(), [&](const msg::stats_reply& x) { return x.actor == a; });
          if (r == replies.end()) view_.silent.push_back(a);
        }
        for (auto& r : replies) {
          if (r.actor == router_) {
            view_.router_answered = true;
            view_.router_seen = steady::now();
            view_.ready_prefill = r.counters["ready_prefill"];
            view_.ready_decode = r.counters["ready_decode"];
          }
        }
        view_.replies = std::move(replies);
        view_.updated = steady::now();
        ++view_.polls;
      }
      std::unique_lock lk(mu_);
      if (cv_.wait_for(lk, interval_, [&] { return stop_; })) return;
    }
  }

  std::string endpoint_;
  std::string router_;
  std::vector<std::string> actors_;
  std::chrono::milliseconds interval_;
  cluster_view& view_;
  std::unique_ptr<client> client_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

bool constant_time_equal(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

bool iequals_ascii(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

int64_t unix_seconds() { return static_cast<int64_t>(std::time(nullptr)); }

}  // namespace

// ------------------------------------------------------------------ the server

struct http_frontend::impl {
  http_frontend_settings settings;
  std::shared_ptr<const text_codec> codec;
  std::shared_ptr<const chat_template_renderer> chat;
  api_parse_options parse_options;
  int64_t started_unix = unix_seconds();
  std::shared_ptr<frontend_metrics> metrics = std::make_shared<frontend_metrics>();
  cluster_view view;
  std::unique_ptr<net::io_context> ioc;
  /// One strand per io thread; connections are dealt out round-robin. A connection's
  /// handlers and its request's events all run on its shard.
  std::vector<net::strand<net::io_context::executor_type>> shards;
  uint32_t next_shard = 0;
  std::unique_ptr<bridge> link;
  std::unique_ptr<stats_poller> poller;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::unique_ptr<net::steady_timer> accept_retry;
  std::vector<std::thread> threads;
  uint16_t bound_port = 0;
  bool started = false;
  bool stopped = false;

  [[nodiscard]] bool ready() const {
    std::lock_guard lk(view.mu);
    return ready_locked();
  }
  /// Same, with view.mu held.
  [[nodiscard]] bool ready_locked() const {
    return view.router_answered && view.ready_prefill > 0 && view.ready_decode > 0 &&
           steady::now() - view.router_seen < std::chrono::seconds(3);
  }

  void accept();
  [[nodiscard]] std::string metrics_text() const;
};

namespace {

using request_t = http::request<http::string_body>;
using response_t = http::response<http::string_body>;

/// One request being generated on a connection.
struct generation {
  uint64_t id = 0;
  api_request request;
  api_response_head head;
  std::string_view endpoint;
  steady::time_point start;
  steady::time_point last_token;
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  bool got_token = false;
  std::unique_ptr<text_decoder> decoder;
  stop_matcher stop{{}};
  std::optional<think_splitter> splitter;  // chat with reasoning split
  std::optional<content_event_writer> events;  // streaming: content-only chunks, pre-rendered
  std::optional<logprobs_writer> logprobs;     // the request asked for log-probabilities
  bool headers_sent = false;
  bool stopped = false;  // a stop string matched
  std::string content, reasoning;              // non-streaming: the whole text
  std::string delta_content, delta_reasoning;  // streaming: not yet sent
};

/// One HTTP connection. Every handler runs on the connection's strand (the bridge's
/// deliveries are posted there too), so its state needs no lock.
class session final : public upstream_receiver, public std::enable_shared_from_this<session> {
 public:
  session(tcp::socket&& socket, http_frontend::impl& owner, uint32_t shard)
      : stream_(std::move(socket)), owner_(owner), metrics_(owner.metrics), shard_(shard) {
    ++metrics_->connections_open;
    ++metrics_->connections_total;
  }
  ~session() { --metrics_->connections_open; }

  void start() { net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_request(); }); }

 private:
  const http_frontend_settings& cfg() const { return owner_.settings; }

  // ---------------------------------------------------------------- reading

  void read_request() {
    parser_.emplace();
    parser_->body_limit(cfg().max_body_bytes);
    parser_->header_limit(static_cast<std::uint32_t>(cfg().max_header_bytes));
    stream_.expires_after(first_request_ ? cfg().header_timeout : cfg().idle_timeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) return on_read_error(ec);
    first_request_ = false;
    const auto& req = parser_->get();
    if (auto length = parser_->content_length(); length && *length > cfg().max_body_bytes) {
      return reject_and_linger(413, "the request body of " + std::to_string(*length) + " bytes exceeds the limit of " +
                                        std::to_string(cfg().max_body_bytes) + " bytes");
    }
    if (beast::iequals(req[http::field::expect], "100-continue")) {
      static const std::string continue_line = "HTTP/1.1 100 Continue\r\n\r\n";
      stream_.expires_after(cfg().write_timeout);
      net::async_write(stream_, net::buffer(continue_line),
                       [self = shared_from_this()](beast::error_code wec, std::size_t) {
                         if (wec) return self->close();
                         self->read_body();
                       });
      return;
    }
    read_body();
  }

  void read_body() {
    stream_.expires_after(cfg().body_timeout);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_body(ec); });
  }

  void on_read_error(beast::error_code ec) {
    if (ec == beast::error::timeout) {
      ++metrics_->connection_timeouts;
      return close();
    }
    if (ec == http::error::body_limit) {
      return reject_and_linger(413, "the request body exceeds the limit of " + std::to_string(cfg().max_body_bytes) +
                                        " bytes");
    }
    if (ec == http::error::header_limit) {
      api_error e = bad_request("the request headers exceed " + std::to_string(cfg().max_header_bytes) + " bytes");
      e.status = 431;
      metrics_->count("other", "bad_request");
      return respond_error(e, /*close=*/true);
    }
    if (ec.category() == http::make_error_code(http::error::bad_target).category() && ec != http::error::end_of_stream &&
        ec != http::error::partial_message) {
      metrics_->count("other", "bad_request");
      return respond_error(bad_request("malformed HTTP request: " + ec.message()), /*close=*/true);
    }
    close();  // end of stream, reset, or a request cut short
  }

  void on_body(beast::error_code ec) {
    if (ec) return on_read_error(ec);
    stream_.expires_never();
    request_t req = parser_->release();
    keep_alive_ = req.keep_alive();
    version_ = req.version();
    handle(std::move(req));
  }

  // ---------------------------------------------------------------- routing

  void handle(request_t&& req) {
    const std::string_view target(req.target().data(), req.target().size());
    const std::string_view path = target.substr(0, target.find('?'));
    const auto method = req.method();
    auto allow = [&](http::verb v, const char* allowed, std::string_view endpoint) {
      if (method == v) return true;
      api_error e = bad_request("method " + std::string(req.method_string()) + " is not allowed on " + std::string(path));
      e.status = 405;
      metrics_->count(endpoint, "method_not_allowed");
      respond_error(e, false, allowed);
      return false;
    };
    if (path == "/health") {
      if (!allow(http::verb::get, "GET", "health")) return;
      const bool ok = owner_.ready();
      metrics_->count("health", ok ? "ok" : "unavailable");
      return respond_json(ok ? http::status::ok : http::status::service_unavailable,
                          json{{"status", ok ? "ok" : "unavailable"}});
    }
    if (path == "/metrics") {
      if (!allow(http::verb::get, "GET", "metrics")) return;
      metrics_->count("metrics", "ok");
      return respond(http::status::ok, owner_.metrics_text(), "text/plain; version=0.0.4; charset=utf-8");
    }
    const bool completions = path == "/v1/completions";
    const bool chat = path == "/v1/chat/completions";
    const bool models = path == "/v1/models" || path.starts_with("/v1/models/");
    if (!completions && !chat && !models) {
      api_error e;
      e.status = 404;
      e.message = "Not found: " + std::string(path);
      e.code = "not_found";
      metrics_->count("other", "not_found");
      return respond_error(e);
    }
    const std::string_view endpoint = completions ? "completions" : chat ? "chat_completions" : "models";
    if (!authorized(req)) {
      api_error e;
      e.status = 401;
      e.message = "Incorrect or missing API key: send 'Authorization: Bearer <key>'.";
      e.code = "invalid_api_key";
      metrics_->count(endpoint, "unauthorized");
      return respond_error(e);
    }
    if (models) {
      if (!allow(http::verb::get, "GET", endpoint)) return;
      const auto list = models_response(cfg().model_name, owner_.started_unix);
      if (path == "/v1/models") {
        metrics_->count(endpoint, "ok");
        return respond_json(http::status::ok, list);
      }
      const std::string_view name = path.substr(std::string_view("/v1/models/").size());
      if (name != cfg().model_name) {
        api_error e;
        e.status = 404;
        e.message = "The model '" + std::string(name) + "' does not exist.";
        e.param = "model";
        e.code = "model_not_found";
        metrics_->count(endpoint, "not_found");
        return respond_error(e);
      }
      metrics_->count(endpoint, "ok");
      return respond_json(http::status::ok, list["data"][0]);
    }
    if (!allow(http::verb::post, "POST", endpoint)) return;
    start_generation(chat ? api_kind::chat : api_kind::completion, endpoint, req.body());
  }

  bool authorized(const request_t& req) const {
    if (cfg().api_key.empty()) return true;
    const auto header = req[http::field::authorization];
    const std::string_view value(header.data(), header.size());
    constexpr std::string_view bearer = "Bearer ";
    if (value.size() < bearer.size() || !iequals_ascii(value.substr(0, bearer.size()), bearer)) return false;
    return constant_time_equal(value.substr(bearer.size()), cfg().api_key);
  }

  // ---------------------------------------------------------------- generation

  void fail_request(std::string_view endpoint, const api_error& e) {
    metrics_->count(endpoint, outcome_of(e));
    respond_error(e);
  }

  void start_generation(api_kind kind, std::string_view endpoint, const std::string& body) {
    auto parsed = parse_api_request(kind, body, owner_.parse_options);
    if (auto* e = std::get_if<api_error>(&parsed)) return fail_request(endpoint, *e);
    auto g = std::make_unique<generation>();
    g->request = std::move(std::get<api_request>(parsed));
    g->endpoint = endpoint;
    g->start = steady::now();
    if (!owner_.ready()) {
      return fail_request(endpoint, error_from_cluster(msg::error_code::unavailable,
                                                       "the cluster is not ready: no live prefill or decode worker",
                                                       1000));
    }
    msg::submit s;
    bool starts_in_think = false;
    try {
      if (kind == api_kind::completion) {
        s.prompt_tokens = g->request.prompt_is_tokens ? g->request.prompt_tokens
                                                      : owner_.codec->encode(g->request.prompt, true);
      } else {
        const std::string prompt = owner_.chat->render(g->request.messages, true);
        s.prompt_tokens = owner_.codec->encode(prompt, owner_.chat->add_special_tokens());
        starts_in_think = think_splitter::prompt_opens_think(prompt);
      }
    } catch (const std::invalid_argument& e) {
      return fail_request(endpoint, bad_request(e.what(), kind == api_kind::chat ? "messages" : "prompt"));
    }
    if (s.prompt_tokens.empty()) {
      return fail_request(endpoint, bad_request("the prompt is empty", kind == api_kind::chat ? "messages" : "prompt"));
    }
    const uint32_t default_max = kind == api_kind::chat ? cfg().chat_default_max_tokens : cfg().completion_default_max_tokens;
    auto max_new = resolve_max_tokens(g->request, s.prompt_tokens.size(), cfg().max_context, default_max,
                                      cfg().max_new_tokens_limit);
    if (auto* e = std::get_if<api_error>(&max_new)) return fail_request(endpoint, *e);
    s.sampling = g->request.sampling;
    s.sampling.max_new_tokens = std::get<uint32_t>(max_new);
    s.sampling.stop_strings.clear();  // matched here, on the detokenized text
    g->id = owner_.link->next_id();
    s.request_id = g->id;
    g->prompt_tokens = static_cast<uint32_t>(s.prompt_tokens.size());
    g->head = api_response_head{kind, make_response_id(kind), unix_seconds(), g->request.model};
    g->decoder = owner_.codec->decoder();
    if (g->request.logprobs) g->logprobs.emplace(kind, owner_.codec);
    g->stop = stop_matcher(g->request.stop);
    const auto reasoning = g->request.reasoning.value_or(cfg().reasoning);
    if (kind == api_kind::chat && reasoning == reasoning_format::split) g->splitter.emplace(starts_in_think);
    gen_ = std::move(g);
    ++metrics_->http_in_flight;
    owner_.link->submit(std::move(s), shared_from_this(), shard_);
    watch_disconnect();
  }

  void on_upstream(uint64_t id, std::vector<client_event>&& events, steady::time_point at) override {
    if (!gen_ || gen_->id != id) return;  // answered already (stop string, disconnect)
    bool got_tokens = false;
    for (auto& e : events) {
      if (!gen_ || gen_->id != id) return;
      switch (e.what) {
        case client_event::kind::admitted:
          if (gen_->request.stream && !gen_->headers_sent) send_stream_head();
          break;
        case client_event::kind::rejected:
          finish_error(error_from_cluster(e.rejection.code, e.rejection.message, e.rejection.retry_after_ms));
          return;
        case client_event::kind::tokens:
          if (gen_->request.stream && !gen_->headers_sent) send_stream_head();
          got_tokens = got_tokens || !e.tokens.empty();
          for (std::size_t k = 0; k < e.tokens.size(); ++k) {
            if (gen_->stopped) break;
            const int32_t token = e.tokens[k];
            observe_token(at);
            ++gen_->completion_tokens;
            if (gen_->logprobs && k < e.logprobs.size() && e.logprobs[k]) gen_->logprobs->add(token, *e.logprobs[k]);
            take_text(gen_->decoder->push(token));
          }
          if (gen_->stopped) {
            owner_.link->cancel(gen_->id);
            return complete("stop");
          }
          break;
        case client_event::kind::finished: {
          const auto& f = e.finish;
          if (f.reason == msg::finish_reason::stop || f.reason == msg::finish_reason::length) {
            take_text(gen_->decoder->flush());
            return complete(gen_->stopped ? "stop" : openai_finish_reason(f.reason));
          }
          msg::error_code code = f.code;
          if (code == msg::error_code::none) {
            code = f.reason == msg::finish_reason::timeout ? msg::error_code::timeout : msg::error_code::internal;
          }
          std::string message = f.message.empty() ? "the request ended: " + std::string(msg::to_string(f.reason))
                                                  : f.message;
          return finish_error(error_from_cluster(code, std::move(message)));
        }
      }
    }
    if (gen_ && gen_->request.stream) flush_delta(got_tokens);
  }

  void observe_token(steady::time_point at) {
    std::lock_guard lk(metrics_->mu);
    if (!gen_->got_token) {
      metrics_->ttft.observe(std::chrono::duration<double>(at - gen_->start).count());
      gen_->got_token = true;
    } else {
      metrics_->itl.observe(std::chrono::duration<double>(at - gen_->last_token).count());
    }
    gen_->last_token = at;
  }

  /// Newly decoded text: through the stop matcher, then the think splitter.
  void take_text(const std::string& text) {
    if (text.empty() || gen_->stopped) return;
    auto out = gen_->stop.feed(text);
    append_output(out.text);
    if (out.stopped) gen_->stopped = true;
  }

  void append_output(const std::string& text) {
    if (text.empty()) return;
    auto& g = *gen_;
    std::string content, reasoning;
    if (g.splitter) {
      auto parts = g.splitter->feed(text);
      content = std::move(parts.content);
      reasoning = std::move(parts.reasoning);
    } else {
      content = text;
    }
    if (g.request.stream) {
      g.delta_content += content;
      g.delta_reasoning += reasoning;
    } else {
      g.content += content;
      g.reasoning += reasoning;
    }
  }

  /// The end of generation: what the stop matcher and splitter held back goes out.
  void drain_held() {
    auto& g = *gen_;
    append_output(g.stop.flush());
    if (g.splitter) {
      auto parts = g.splitter->flush();
      if (g.request.stream) {
        g.delta_content += parts.content;
        g.delta_reasoning += parts.reasoning;
      } else {
        g.content += parts.content;
        g.reasoning += parts.reasoning;
      }
    }
  }

  void end_generation(std::string_view outcome) {
    auto& g = *gen_;
    metrics_->count(g.endpoint, outcome);
    {
      std::lock_guard lk(metrics_->mu);
      metrics_->e2e.observe(std::chrono::duration<double>(steady::now() - g.start).count());
    }
    metrics_->prompt_tokens += g.prompt_tokens;
    metrics_->completion_tokens += g.completion_tokens;
    --metrics_->http_in_flight;
  }

  void complete(std::string_view finish_reason) {
    drain_held();
    auto& g = *gen_;
    const api_usage usage{g.prompt_tokens, g.completion_tokens};
    end_generation("ok");
    if (!g.request.stream) {
      std::optional<std::string> reasoning;
      if (g.splitter && g.splitter->saw_reasoning()) reasoning = g.reasoning;
      auto body = full_response(g.head, g.content, reasoning, finish_reason, usage,
                                g.logprobs ? g.logprobs->take() : nlohmann::json(nullptr));
      gen_.reset();
      return respond_json(http::status::ok, body);
    }
    if (!g.headers_sent) send_stream_head();
    flush_delta();
    std::string tail = sse_event(stream_chunk(g.head, chunk_delta{}, finish_reason, g.request.include_usage));
    if (g.request.include_usage) tail += sse_event(usage_chunk(g.head, usage));
    tail += sse_done();
    send_stream(tail);
    end_stream();
  }

  void finish_error(const api_error& e) {
    auto& g = *gen_;
    end_generation(outcome_of(e));
    if (!g.request.stream || !g.headers_sent) {
      gen_.reset();
      return respond_error(e);
    }
    // Headers are out: the error travels as an event, then the stream ends.
    std::string tail = sse_event(e.to_json());
    tail += sse_done();
    send_stream(tail);
    end_stream();
  }

  // ---------------------------------------------------------------- disconnects

  /// While a request runs, a readable socket means the client closed it (or pipelined the
  /// next request, which stops the watch: a write then finds out).
  void watch_disconnect() {
    if (watching_) return;
    watching_ = true;
    stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this()](beast::error_code ec) {
      self->watching_ = false;
      if (ec || !self->gen_) return;
      char probe;
      const ssize_t n = ::recv(self->stream_.socket().native_handle(), &probe, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return self->client_gone();
      if (n < 0) self->watch_disconnect();
    });
  }

  void client_gone() {
    if (gen_) {
      owner_.link->cancel(gen_->id);
      end_generation("cancelled");
      gen_.reset();
    }
    close();
  }

  // ---------------------------------------------------------------- writing: streams

  void send_stream_head() {
    auto& g = *gen_;
    g.headers_sent = true;
    g.events.emplace(g.head, g.request.include_usage);
    chunked_ = version_ >= 11;
    std::string head = version_ >= 11 ? "HTTP/1.1 200 OK\r\n" : "HTTP/1.0 200 OK\r\n";
    head += "Server: duet\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n";
    head += "X-Request-Id: " + g.head.id + "\r\n";
    if (chunked_) {
      head += "Transfer-Encoding: chunked\r\n";
      head += keep_alive_ ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
    } else {
      head += "Connection: close\r\n";
      keep_alive_ = false;
    }
    head += "\r\n";
    pending_ += head;
    if (g.head.kind == api_kind::chat) {
      chunk_delta first;
      first.role = true;
      first.content = "";
      append_stream_data(sse_event(stream_chunk(g.head, first, "", g.request.include_usage)));
    }
    pump();
  }

  /// Sends the text taken since the last event as one event. `got_tokens`: this bridge round
  /// brought tokens, so an event goes out even when all their text is held back (part of a
  /// UTF-8 character, a special token, a possible stop string or think tag), with empty text,
  /// as vLLM does: a client sees each token when it comes, and its TTFT is the first token's,
  /// not the first complete character's (which can be a whole decode queue later).
  void flush_delta(bool got_tokens = false) {
    auto& g = *gen_;
    const bool with_logprobs = g.logprobs && !g.logprobs->empty();
    if (!g.headers_sent) return;
    if (g.delta_content.empty() && g.delta_reasoning.empty() && !with_logprobs) {
      if (got_tokens) send_stream(g.events->content_event(""));
      return;
    }
    if (g.delta_reasoning.empty() && !with_logprobs) {
      send_stream(g.events->content_event(g.delta_content));
      g.delta_content.clear();
      return;
    }
    chunk_delta d;
    if (!g.delta_content.empty()) d.content = std::move(g.delta_content);
    if (!g.delta_reasoning.empty()) d.reasoning = std::move(g.delta_reasoning);
    if (with_logprobs) {
      if (!d.content) d.content = std::string();
      d.logprobs = g.logprobs->take();
    }
    g.delta_content.clear();
    g.delta_reasoning.clear();
    send_stream(sse_event(stream_chunk(g.head, d, "", g.request.include_usage)));
  }

  void append_stream_data(std::string_view data) {
    if (chunked_) pending_ += http_chunk(data);
    else pending_ += data;
  }

  void send_stream(std::string_view data) {
    append_stream_data(data);
    pump();
  }

  /// The response is complete once what is queued has been written.
  void end_stream() {
    if (chunked_) pending_ += http_last_chunk();
    stream_done_ = true;
    gen_.reset();
    pump();
  }

  void pump() {
    if (writing_ || pending_.empty()) {
      if (!writing_ && stream_done_) {
        stream_done_ = false;
        after_response(!keep_alive_);
      }
      return;
    }
    writing_ = true;
    write_buf_.swap(pending_);
    pending_.clear();
    stream_.expires_after(cfg().write_timeout);
    net::async_write(stream_, net::buffer(write_buf_), [self = shared_from_this()](beast::error_code ec, std::size_t) {
      self->writing_ = false;
      self->write_buf_.clear();
      if (ec) return self->client_gone();
      self->stream_.expires_never();
      self->pump();
    });
  }

  // ---------------------------------------------------------------- writing: whole responses

  void respond(http::status status, std::string body, std::string_view content_type,
               const api_error* error = nullptr, bool close_after = false, std::string_view allow = {}) {
    auto res = std::make_shared<response_t>(status, version_ >= 10 ? version_ : 11);
    res->set(http::field::server, "duet");
    res->set(http::field::content_type, std::string(content_type));
    if (error && error->retry_after_s > 0) res->set(http::field::retry_after, std::to_string(error->retry_after_s));
    if (status == http::status::unauthorized) res->set(http::field::www_authenticate, "Bearer");
    if (!allow.empty()) res->set(http::field::allow, std::string(allow));
    res->keep_alive(keep_alive_ && !close_after);
    res->body() = std::move(body);
    res->prepare_payload();
    const bool close = res->need_eof();
    stream_.expires_after(cfg().write_timeout);
    http::async_write(stream_, *res, [self = shared_from_this(), res, close](beast::error_code ec, std::size_t) {
      if (ec) return self->close();
      self->after_response(close);
    });
  }

  void respond_json(http::status status, const json& body) {
    respond(status, dump_json(body), "application/json");
  }

  void respond_error(const api_error& e, bool close_after = false, std::string_view allow = {}) {
    respond(static_cast<http::status>(e.status), e.body(), "application/json", &e, close_after, allow);
  }

  void after_response(bool close_connection) {
    if (close_connection) return shutdown();
    read_request();
  }

  /// An error answered before the body was read (413): answer, then read and discard what
  /// the client still sends for a while, so it sees the answer instead of a reset.
  void reject_and_linger(int status, std::string message) {
    api_error e = bad_request(std::move(message));
    e.status = status;
    e.code = status == 413 ? "request_too_large" : "";
    metrics_->count("other", "too_large");
    keep_alive_ = false;
    auto res = std::make_shared<response_t>(static_cast<http::status>(status), 11);
    res->set(http::field::server, "duet");
    res->set(http::field::content_type, "application/json");
    res->keep_alive(false);
    res->body() = e.body();
    res->prepare_payload();
    stream_.expires_after(cfg().write_timeout);
    http::async_write(stream_, *res, [self = shared_from_this(), res](beast::error_code ec, std::size_t) {
      if (ec) return self->close();
      beast::error_code ignored;
      self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
      self->lingered_ = 0;
      self->stream_.expires_after(std::chrono::seconds(5));
      self->drain();
    });
  }

  void drain() {
    drain_buf_.resize(64 * 1024);
    stream_.async_read_some(net::buffer(drain_buf_), [self = shared_from_this()](beast::error_code ec, std::size_t n) {
      self->lingered_ += n;
      if (ec || self->lingered_ > (64u << 20)) return self->close();
      self->drain();
    });
  }

  void shutdown() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    close();
  }

  void close() {
    beast::error_code ignored;
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  http_frontend::impl& owner_;
  std::shared_ptr<frontend_metrics> metrics_;  // outlives the owner's teardown of sessions
  uint32_t shard_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  bool first_request_ = true;
  bool keep_alive_ = true;
  unsigned version_ = 11;
  std::unique_ptr<generation> gen_;
  bool watching_ = false;
  // streaming writes
  bool chunked_ = true;
  bool writing_ = false;
  bool stream_done_ = false;
  std::string pending_;
  std::string write_buf_;
  // lingering close
  std::string drain_buf_;
  std::size_t lingered_ = 0;
};

}  // namespace

void http_frontend::impl::accept() {
  const uint32_t shard = next_shard;
  acceptor->async_accept(shards[shard], [this, shard](beast::error_code ec, tcp::socket socket) {
    if (ec == net::error::operation_aborted || !acceptor->is_open()) return;
    if (ec) {
      // Out of descriptors (EMFILE) or similar: back off instead of spinning.
      accept_retry->expires_after(std::chrono::milliseconds(50));
      accept_retry->async_wait([this](beast::error_code tec) {
        if (!tec) accept();
      });
      return;
    }
    if (metrics->connections_open >= static_cast<int64_t>(settings.max_connections)) {
      ++metrics->connections_refused;
      beast::error_code ignored;
      socket.close(ignored);
    } else {
      beast::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      std::make_shared<session>(std::move(socket), *this, shard)->start();
      next_shard = (next_shard + 1) % static_cast<uint32_t>(shards.size());
    }
    accept();
  });
}

std::string http_frontend::impl::metrics_text() const {
  std::string out;
  auto line = [&](std::string_view name, std::string_view labels, double value) {
    out += name;
    if (!labels.empty()) {
      out += '{';
      out += labels;
      out += '}';
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, " %.17g\n", value);
    out += buf;
  };
  auto head = [&](std::string_view name, std::string_view type, std::string_view help) {
    out += "# HELP " + std::string(name) + " " + std::string(help) + "\n";
    out += "# TYPE " + std::string(name) + " " + std::string(type) + "\n";
  };
  auto& m = *metrics;  // the pointee is not const; its lock is taken below
  head("duet_http_requests_total", "counter", "HTTP requests by endpoint and outcome.");
  {
    std::lock_guard lk(m.mu);
    for (const auto& [key, n] : m.requests) {
      line("duet_http_requests_total",
           "endpoint=\"" + escape_label(key.first) + "\",outcome=\"" + escape_label(key.second) + "\"",
           static_cast<double>(n));
    }
  }
  head("duet_http_requests_in_flight", "gauge", "Completion requests being served by the front end.");
  line("duet_http_requests_in_flight", "", static_cast<double>(m.http_in_flight.load()));
  head("duet_http_upstream_in_flight", "gauge",
       "Requests submitted to the router without a final answer yet (cancelled ones until the cluster confirms).");
  line("duet_http_upstream_in_flight", "", static_cast<double>(m.upstream_in_flight.load()));
  head("duet_http_connections_open", "gauge", "Open HTTP connections.");
  line("duet_http_connections_open", "", static_cast<double>(m.connections_open.load()));
  head("duet_http_connections_total", "counter", "HTTP connections accepted.");
  line("duet_http_connections_total", "", static_cast<double>(m.connections_total.load()));
  head("duet_http_connections_refused_total", "counter", "Connections closed at once: over max_connections.");
  line("duet_http_connections_refused_total", "", static_cast<double>(m.connections_refused.load()));
  head("duet_http_connection_timeouts_total", "counter", "Connections closed for a header, body or idle timeout.");
  line("duet_http_connection_timeouts_total", "", static_cast<double>(m.connection_timeouts.load()));
  head("duet_http_prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
  line("duet_http_prompt_tokens_total", "", static_cast<double>(m.prompt_tokens.load()));
  head("duet_http_completion_tokens_total", "counter", "Completion tokens of finished requests.");
  line("duet_http_completion_tokens_total", "", static_cast<double>(m.completion_tokens.load()));
  {
    std::lock_guard lk(m.mu);
    out += m.ttft.to_prometheus("duet_http_ttft_seconds",
                                "Time to first token, from the request read to the token at the front end.");
    out += m.itl.to_prometheus("duet_http_itl_seconds", "Gaps between consecutive tokens of a request at the front end.");
    out += m.e2e.to_prometheus("duet_http_e2e_seconds", "Request read to final answer.");
  }
  std::lock_guard lk(view.mu);
  head("duet_cluster_ready", "gauge", "1 when the router reports a live prefill and decode worker (what /health says).");
  line("duet_cluster_ready", "", ready_locked() ? 1 : 0);
  head("duet_cluster_ready_workers", "gauge", "Workers the router reports alive, by role.");
  line("duet_cluster_ready_workers", "role=\"prefill\"", static_cast<double>(view.ready_prefill));
  line("duet_cluster_ready_workers", "role=\"decode\"", static_cast<double>(view.ready_decode));
  head("duet_stats_age_seconds", "gauge", "Seconds since the actors' counters were last polled.");
  line("duet_stats_age_seconds", "",
       view.polls == 0 ? -1 : std::chrono::duration<double>(steady::now() - view.updated).count());
  head("duet_actor_up", "gauge", "1 when the actor answered the last counter poll.");
  for (const auto& r : view.replies) line("duet_actor_up", "actor=\"" + escape_label(r.actor) + "\"", 1);
  for (const auto& a : view.silent) line("duet_actor_up", "actor=\"" + escape_label(a) + "\"", 0);
  head("duet_actor_counter", "untyped", "Each actor's counters, as `duet stats` prints them.");
  for (const auto& r : view.replies) {
    const std::string base = "actor=\"" + escape_label(r.actor) + "\",role=\"" + escape_label(r.role) + "\",counter=\"";
    for (const auto& [k, v] : r.counters) line("duet_actor_counter", base + escape_label(k) + "\"", static_cast<double>(v));
  }
  head("duet_kv_blocks_free", "gauge", "Free KV blocks per actor pool.");
  for (const auto& r : view.replies) {
    if (r.total_blocks == 0) continue;
    line("duet_kv_blocks_free", "actor=\"" + escape_label(r.actor) + "\"", r.free_blocks);
  }
  head("duet_kv_blocks_used", "gauge", "Used KV blocks per actor pool.");
  for (const auto& r : view.replies) {
    if (r.total_blocks == 0) continue;
    line("duet_kv_blocks_used", "actor=\"" + escape_label(r.actor) + "\"", r.total_blocks - r.free_blocks);
  }
  head("duet_kv_blocks_total", "gauge", "KV blocks per actor pool.");
  for (const auto& r : view.replies) {
    if (r.total_blocks == 0) continue;
    line("duet_kv_blocks_total", "actor=\"" + escape_label(r.actor) + "\"", r.total_blocks);
  }
  return out;
}

// ------------------------------------------------------------------ public API

http_frontend::http_frontend(http_frontend_settings settings, std::shared_ptr<const text_codec> codec,
                             std::shared_ptr<const chat_template_renderer> chat)
    : impl_(std::make_unique<impl>()) {
  if (!codec) throw std::invalid_argument("http_frontend: no text codec");
  impl_->settings = std::move(settings);
  impl_->codec = std::move(codec);
  impl_->chat = chat ? std::move(chat) : std::make_shared<plain_chat_template>();
  impl_->parse_options.model_name = impl_->settings.model_name;
  if (impl_->settings.io_threads == 0) impl_->settings.io_threads = 1;
}

http_frontend::~http_frontend() { stop(); }

void http_frontend::start() {
  auto& m = *impl_;
  if (m.started) return;
  raise_fd_limit();
  m.ioc = std::make_unique<net::io_context>(static_cast<int>(m.settings.io_threads));
  beast::error_code ec;
  const auto address = net::ip::make_address(m.settings.host, ec);
  if (ec) throw std::runtime_error("HTTP front end: bad address '" + m.settings.host + "': " + ec.message());
  const tcp::endpoint where(address, m.settings.port);
  m.acceptor = std::make_unique<tcp::acceptor>(net::make_strand(*m.ioc));
  auto check = [&](const char* what) {
    if (ec) {
      throw std::runtime_error("HTTP front end: cannot " + std::string(what) + " " + m.settings.host + ":" +
                               std::to_string(m.settings.port) + ": " + ec.message());
    }
  };
  m.acceptor->open(where.protocol(), ec);
  check("open");
  m.acceptor->set_option(net::socket_base::reuse_address(true), ec);
  check("configure");
  m.acceptor->bind(where, ec);
  check("bind");
  m.acceptor->listen(net::socket_base::max_listen_connections, ec);
  check("listen on");
  m.bound_port = m.acceptor->local_endpoint().port();
  m.accept_retry = std::make_unique<net::steady_timer>(m.acceptor->get_executor());
  for (uint32_t i = 0; i < m.settings.io_threads; ++i) m.shards.push_back(net::make_strand(*m.ioc));
  m.link = std::make_unique<bridge>(
      m.settings.router_endpoint, m.settings.router_address, m.settings.request_timeout, *m.metrics,
      m.settings.io_threads, [&m](uint32_t shard, std::vector<delivery>&& batch) {
        net::post(m.shards[shard], [batch = std::move(batch)]() mutable {
          for (auto& d : batch) d.to->on_upstream(d.id, std::move(d.events), d.at);
        });
      });
  m.poller = std::make_unique<stats_poller>(m.settings.router_endpoint, m.settings.router_address,
                                            m.settings.pool_actors, m.settings.stats_interval, m.view);
  m.link->start();
  m.poller->start();
  m.accept();
  for (uint32_t i = 0; i < m.settings.io_threads; ++i) {
    m.threads.emplace_back([ioc = m.ioc.get()] {
      name_thread("duet-http-io");
      ioc->run();
    });
  }
  m.started = true;
}

void http_frontend::stop() {
  auto& m = *impl_;
  if (!m.started || m.stopped) return;
  m.stopped = true;
  net::post(m.acceptor->get_executor(), [&m] {
    beast::error_code ignored;
    m.acceptor->close(ignored);
    m.accept_retry->cancel();
  });
  m.poller->stop();
  m.link->stop();  // cancels what is in flight; its sinks (and the sessions they hold) go
  m.link.reset();
  m.ioc->stop();
  for (auto& t : m.threads) t.join();
  m.threads.clear();
  m.acceptor.reset();
  m.accept_retry.reset();
  m.ioc.reset();  // destroys the sessions still waiting in handlers
}

uint16_t http_frontend::port() const { return impl_->bound_port; }
bool http_frontend::ready() const { return impl_->ready(); }
std::string http_frontend::metrics_text() const { return impl_->metrics_text(); }
const http_frontend_settings& http_frontend::settings() const { return impl_->settings; }

// ------------------------------------------------------------------ helpers

std::pair<std::string, uint16_t> parse_host_port(std::string_view text) {
  auto bad = [&](const std::string& why) {
    return std::invalid_argument("bad HTTP address '" + std::string(text) + "': " + why + " (expected HOST:PORT)");
  };
  std::string host;
  std::string_view port;
  if (text.starts_with('[')) {
    const auto close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') throw bad("unclosed '['");
    host = std::string(text.substr(1, close - 1));
    port = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string_view::npos) throw bad("no port");
    host = std::string(text.substr(0, colon));
    port = text.substr(colon + 1);
  }
  if (host.empty()) throw bad("no host");
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string_view::npos) {
    throw bad("the port must be a number from 0 to 65535");
  }
  const unsigned long p = std::stoul(std::string(port));
  if (p > 65535) throw bad("the port must be a number from 0 to 65535");
  if (host == "localhost") host = "127.0.0.1";
  return {host, static_cast<uint16_t>(p)};
}

std::string http_host_node(const deployment_config& config) {
  for (const auto& n : config.nodes) {
    for (const auto& a : n.actors) {
      if (a.role == actor_role::router) return n.name;
    }
  }
  return config.nodes.empty() ? std::string() : config.nodes.front().name;
}

http_frontend_settings http_settings_from_config(const deployment_config& config, std::string_view http) {
  http_frontend_settings s;
  std::tie(s.host, s.port) = parse_host_port(http);
  bool have_router = false;
  for (const auto& n : config.nodes) {
    for (const auto& a : n.actors) {
      const std::string address = n.name + "/" + a.name;
      if (a.role == actor_role::router && !have_router) {
        s.router_endpoint = n.endpoint;
        s.router_address = address;
        have_router = true;
      } else if (a.role != actor_role::router) {
        s.pool_actors.push_back(address);
      }
    }
  }
  if (!have_router) throw std::invalid_argument("the deployment has no router for the HTTP front end to talk to");
  s.model_name = config.model.name;
  s.max_context = config.model.max_context;
  s.max_new_tokens_limit = config.router.max_new_tokens_limit;
  // The router answers every admitted request by its deadline plus a grace period; the
  // front end waits longer still before it gives up on its own.
  s.request_timeout = std::chrono::milliseconds(config.router.request_timeout_ms) +
                      std::chrono::milliseconds(config.broker.transfer_timeout_ms) + std::chrono::seconds(10);
  return s;
}

uint64_t raise_fd_limit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit want = lim;
    want.rlim_cur = lim.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &want) == 0) lim = want;
  }
  return lim.rlim_cur;
}

std::unique_ptr<http_frontend> start_node_frontend(const deployment_config& config, const std::string& node_name,
                                                   const std::string& http_override, const std::string& api_key) {
  const node_config* node = config.find_node(node_name);
  if (!node) return nullptr;
  std::string http = node->http;
  if (!http_override.empty()) http = http_override;
  if (http.empty()) return nullptr;
  auto settings = http_settings_from_config(config, http);
  settings.api_key = api_key;
  if (settings.api_key.empty()) {
    if (const char* env = std::getenv("DUET_API_KEY")) settings.api_key = env;
  }
  auto codec = make_text_codec(config);
  // The model and this tokenizer must agree (runtime/vocab_check.hpp): an HF directory's
  // config.json and tokenizer.json, a GGUF's metadata and tokenizer.ggml.*. Whoever loads the
  // model (apps/duet.cpp) has printed the check's warnings; here only a mismatch matters.
  if (dynamic_cast<const tokenizer_text_codec*>(codec.get()) != nullptr) (void)check_model_vocab(config);
  auto chat = make_chat_renderer(*codec);
  auto fe = std::make_unique<http_frontend>(std::move(settings), std::move(codec), std::move(chat));
  fe->start();
  const auto fds = raise_fd_limit();
  std::fprintf(stderr, "duet node %s: OpenAI-compatible HTTP API on http://%s:%u/v1 (model %s%s; %llu fds)\n",
               node_name.c_str(), fe->settings().host.c_str(), fe->port(), config.model.name.c_str(),
               fe->settings().api_key.empty() ? "" : ", API key required", static_cast<unsigned long long>(fds));
  return fe;
}

}  // namespace duet
