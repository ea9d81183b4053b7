#include "sim/http_replay.hpp"

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <charconv>
#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <thread>

#include "runtime/clock.hpp"

namespace duet {

namespace {

namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

std::string prompt_json(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(ids[i]);
  }
  return out + ']';
}

tcp::endpoint resolve(const http_target& target) {
  net::io_context ioc;
  tcp::resolver resolver(ioc);
  boost::system::error_code ec;
  const auto results = resolver.resolve(target.host, std::to_string(target.port), ec);
  if (ec || results.empty())
    throw std::runtime_error("cannot resolve " + target.host + ": " + ec.message());
  return results.begin()->endpoint();
}

/// The replay's shared state; everything runs on one io_context thread.
struct replay_state {
  replay_state(net::io_context& io, std::span<const trace_request> t) : ioc(io), trace(t) {}
  net::io_context& ioc;
  std::span<const trace_request> trace;
  tcp::endpoint endpoint;
  std::string host_header, target_path, model, auth, temperature;
  uint32_t vocab = 30000;
  steady::time_point start = steady::now();
  std::vector<request_record> records;
  std::vector<bool> done;
  size_t sent = 0, finished = 0;
  std::function<void(size_t, size_t, size_t)> progress;
  std::vector<std::function<void()>> closers;  // per sent request: closes its socket

  [[nodiscard]] double elapsed_s() const {
    return std::chrono::duration<double>(steady::now() - start).count();
  }
  void finish(size_t i, std::string outcome) {
    if (done[i]) return;
    done[i] = true;
    records[i].finish_s = elapsed_s();
    records[i].outcome = std::move(outcome);
    ++finished;
    if (progress) progress(sent, finished, trace.size());
    if (finished == trace.size()) ioc.stop();
  }
};

/// One streamed request on its own connection.
class http_request_session : public std::enable_shared_from_this<http_request_session> {
 public:
  http_request_session(replay_state& state, size_t index)
      : state_(state), index_(index), socket_(state.ioc) {}

  void start() {
    auto& rec = state_.records[index_];
    const auto& r = state_.trace[index_];
    rec.id = index_ + 1;
    rec.prompt_tokens = r.input_tokens;
    rec.arrival_s = state_.elapsed_s();
    expected_tokens_ = std::max<uint32_t>(r.output_tokens, 1);
    request_.method(http::verb::post);
    request_.target(state_.target_path);
    request_.version(11);
    request_.set(http::field::host, state_.host_header);
    request_.set(http::field::content_type, "application/json");
    request_.set(http::field::connection, "close");
    if (!state_.auth.empty()) request_.set(http::field::authorization, state_.auth);
    request_.body() = "{\"model\":" + nlohmann::json(state_.model).dump() + ",\"prompt\":" +
                      prompt_json(replay_prompt(index_, r.input_tokens, state_.vocab)) +
                      ",\"max_tokens\":" + std::to_string(expected_tokens_) +
                      ",\"temperature\":" + state_.temperature +
                      ",\"ignore_eos\":true,\"stream\":true,"
                      "\"stream_options\":{\"include_usage\":true}}";
    request_.prepare_payload();
    parser_.body_limit(boost::none);
    std::weak_ptr<http_request_session> weak = shared_from_this();
    state_.closers.push_back([weak] {
      if (auto self = weak.lock()) self->close();
    });
    socket_.async_connect(state_.endpoint, [self = shared_from_this()](boost::system::error_code ec) {
      if (ec) return self->end("connect_failed");
      self->socket_.set_option(tcp::no_delay(true));
      http::async_write(self->socket_, self->request_,
                        [self](boost::system::error_code wec, std::size_t) {
                          if (wec) return self->end("connect_failed");
                          self->read();
                        });
    });
  }

  void close() {
    boost::system::error_code ignored;
    socket_.close(ignored);
  }

 private:
  void read() {
    http::async_read_some(socket_, buffer_, parser_,
                          [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                            self->on_read(ec);
                          });
  }

  void on_read(boost::system::error_code ec) {
    const double t = state_.elapsed_s();
    if (parser_.is_header_done() && status_ == 0) status_ = parser_.get().result_int();
    scan_events(t);
    if (done_seen_ || parser_.is_done()) return end(outcome());
    if (ec) return end(done_seen_ ? outcome() : status_ == 200 ? "http_error" : outcome());
    read();
  }

  /// Consumes every complete SSE event ("data: ...", blank line) of the body read so far.
  void scan_events(double t) {
    if (status_ != 200) return;
    const std::string& body = parser_.get().body();
    for (;;) {
      const auto end = body.find("\n\n", scan_);
      if (end == std::string::npos) return;
      std::string_view event(body.data() + scan_, end - scan_);
      scan_ = end + 2;
      on_event(event, t);
    }
  }

  void on_event(std::string_view event, double t) {
    for (std::string_view rest = event; !rest.empty();) {
      const auto nl = rest.find('\n');
      std::string_view line = rest.substr(0, nl);
      rest = nl == std::string_view::npos ? std::string_view{} : rest.substr(nl + 1);
      if (line.ends_with('\r')) line.remove_suffix(1);
      if (!line.starts_with("data:")) continue;
      line.remove_prefix(5);
      if (line.starts_with(' ')) line.remove_prefix(1);
      if (line == "[DONE]") {
        done_seen_ = true;
        continue;
      }
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object() || j.contains("error")) {
        error_event_ = true;
        continue;
      }
      if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
        if (auto c = u->find("completion_tokens"); c != u->end() && c->is_number_unsigned())
          completion_tokens_ = c->get<uint32_t>();
      }
      const auto choices = j.find("choices");
      if (choices == j.end() || !choices->is_array() || choices->empty()) continue;
      const auto& c = (*choices)[0];
      const auto text = c.find("text");
      const bool has_text = text != c.end() && text->is_string() && !text->get_ref<const std::string&>().empty();
      const auto finish = c.find("finish_reason");
      const bool final_chunk = finish != c.end() && !finish->is_null();
      if (final_chunk) finish_reason_ = finish->is_string() ? finish->get<std::string>() : "";
      if (final_chunk && !has_text) continue;
      on_token_event(t, has_text);
    }
  }

  void on_token_event(double t, bool has_text) {
    auto& rec = state_.records[index_];
    if (!rec.first_token_s)
      rec.first_token_s = t;
    else
      rec.itl_s.push_back(t - last_token_s_);
    if (has_text && !rec.first_text_s) rec.first_text_s = t;
    last_token_s_ = t;
  }

  [[nodiscard]] std::string outcome() const {
    if (status_ == 0) return "http_error";  // closed before any response header
    if (status_ == 429 || status_ == 503) return "rejected_" + std::to_string(status_);
    if (status_ != 200) return "http_" + std::to_string(status_);
    if (error_event_ || !done_seen_) return "http_error";
    if (completion_tokens_ && *completion_tokens_ != expected_tokens_) return "short_" + finish_reason_;
    return std::string(request_outcome_ok);
  }

  void end(const std::string& outcome) {
    auto& rec = state_.records[index_];
    rec.output_tokens = completion_tokens_.value_or(
        rec.first_token_s ? static_cast<uint32_t>(rec.itl_s.size() + 1) : 0);
    // Tokens the front end merged into one event (it fell a write behind) arrived together:
    // 0 gaps, as the ZeroMQ replay records a batch. An event past the last token carries
    // only text held back until the end (a character the last token left incomplete): no gap.
    if (rec.first_token_s && rec.output_tokens > 0) {
      while (rec.itl_s.size() + 1 < rec.output_tokens) rec.itl_s.push_back(0.0);
      while (rec.itl_s.size() + 1 > rec.output_tokens) rec.itl_s.pop_back();
    }
    close();
    state_.finish(index_, outcome);
  }

  replay_state& state_;
  size_t index_;
  tcp::socket socket_;
  http::request<http::string_body> request_;
  beast::flat_buffer buffer_;
  http::response_parser<http::string_body> parser_;
  unsigned status_ = 0;
  size_t scan_ = 0;
  bool done_seen_ = false, error_event_ = false;
  std::optional<uint32_t> completion_tokens_;
  std::string finish_reason_;
  uint32_t expected_tokens_ = 1;
  double last_token_s_ = 0;
};

/// Sends what is due, then sleeps until the next arrival.
void schedule(replay_state& s, net::steady_timer& timer) {
  while (s.sent < s.trace.size() && s.trace[s.sent].arrival_s <= s.elapsed_s()) {
    std::make_shared<http_request_session>(s, s.sent)->start();
    ++s.sent;
  }
  if (s.sent >= s.trace.size()) return;
  timer.expires_at(s.start + std::chrono::duration_cast<steady::duration>(
                                 std::chrono::duration<double>(s.trace[s.sent].arrival_s)));
  timer.async_wait([&s, &timer](boost::system::error_code ec) {
    if (!ec) schedule(s, timer);
  });
}

}  // namespace

http_target parse_http_url(const std::string& url) {
  constexpr std::string_view scheme = "http://";
  if (!url.starts_with(scheme))
    throw std::invalid_argument("'" + url + "' is not an http:// URL (https is not supported)");
  std::string_view rest = std::string_view(url).substr(scheme.size());
  const auto slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  http_target t;
  if (slash != std::string_view::npos) {
    t.base_path = std::string(rest.substr(slash));
    while (t.base_path.ends_with('/')) t.base_path.pop_back();
    if (t.base_path.ends_with("/v1")) t.base_path.resize(t.base_path.size() - 3);
  }
  const auto colon = authority.rfind(':');
  if (colon != std::string_view::npos && authority.find(']', colon) == std::string_view::npos) {
    const std::string_view port = authority.substr(colon + 1);
    unsigned value = 0;
    const auto r = std::from_chars(port.data(), port.data() + port.size(), value);
    if (r.ec != std::errc{} || r.ptr != port.data() + port.size() || value == 0 || value > 65535)
      throw std::invalid_argument("'" + url + "': bad port");
    t.port = static_cast<uint16_t>(value);
    authority = authority.substr(0, colon);
  } else {
    t.port = 80;
  }
  if (authority.starts_with('[') && authority.ends_with(']'))
    authority = authority.substr(1, authority.size() - 2);
  if (authority.empty()) throw std::invalid_argument("'" + url + "': no host");
  t.host = std::string(authority);
  return t;
}

std::vector<int32_t> replay_prompt(size_t index, uint32_t length, uint32_t vocab) {
  vocab = std::max<uint32_t>(vocab, 2);
  std::vector<int32_t> ids(length);
  for (uint32_t j = 0; j < length; ++j)
    ids[j] = static_cast<int32_t>((uint64_t{j} * 7919 + uint64_t{index} * 104729 + 1) % vocab);
  return ids;
}

std::string wait_for_http_model(const http_target& target, const std::string& api_key,
                                std::chrono::milliseconds wait) {
  struct fatal_answer : std::runtime_error {  // the server answered: waiting will not help
    using std::runtime_error::runtime_error;
  };
  const auto get = [&](const std::string& path) {  // one GET on its own connection
    net::io_context ioc;
    beast::tcp_stream stream(ioc);
    stream.expires_after(std::chrono::seconds(5));
    stream.connect(resolve(target));
    http::request<http::empty_body> req{http::verb::get, target.base_path + path, 11};
    req.set(http::field::host, target.host);
    if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
    http::write(stream, req);
    beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(stream, buffer, res);
    return res;
  };
  const auto until = steady::now() + wait;
  std::string last_error = "no answer";
  for (;;) {
    try {
      const auto models = get("/v1/models");
      if (models.result_int() == 401) throw fatal_answer("GET /v1/models answered 401 (give --api-key)");
      if (models.result_int() == 200) {
        const auto j = nlohmann::json::parse(models.body(), nullptr, false);
        if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
            !j["data"][0].contains("id") || !j["data"][0]["id"].is_string())
          throw fatal_answer("GET /v1/models: no model in the answer");
        // The API answers before the workers are up: /health says when they are.
        const auto health = get("/health");
        if (health.result_int() == 200) return j["data"][0]["id"].get<std::string>();
        last_error = "GET /health answered " + std::to_string(health.result_int());
      } else {
        last_error = "GET /v1/models answered " + std::to_string(models.result_int());
      }
    } catch (const fatal_answer&) {
      throw;
    } catch (const std::exception& e) {  // not listening yet, reset, timed out: retry
      last_error = e.what();
    }
    if (steady::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  throw std::runtime_error("http://" + target.host + ":" + std::to_string(target.port) +
                           " did not answer within " + std::to_string(wait.count() / 1000) +
                           " s: " + last_error);
}

std::vector<request_record> replay_http(const http_target& target,
                                        std::span<const trace_request> trace,
                                        const http_replay_options& o) {
  if (trace.empty()) return {};
  net::io_context ioc(1);
  replay_state s(ioc, trace);
  s.endpoint = resolve(target);
  s.host_header = target.host + ":" + std::to_string(target.port);
  s.target_path = target.base_path + "/v1/completions";
  s.model = o.model;
  s.auth = o.api_key.empty() ? std::string() : "Bearer " + o.api_key;
  s.temperature = nlohmann::json(o.temperature).dump();
  s.vocab = o.prompt_vocab;
  s.records.resize(trace.size());
  s.done.assign(trace.size(), false);
  s.progress = o.progress;
  s.closers.reserve(trace.size());
  net::steady_timer arrivals(ioc), deadline(ioc);
  deadline.expires_after(o.timeout);
  deadline.async_wait([&](boost::system::error_code ec) {
    if (ec) return;
    for (size_t i = 0; i < trace.size(); ++i) {
      if (!s.done[i]) s.finish(i, i < s.sent ? "client_timeout" : "not_sent");
    }
    for (auto& close : s.closers) close();
    ioc.stop();
  });
  s.start = steady::now();
  schedule(s, arrivals);
  ioc.run();
  return std::move(s.records);
}

}  // namespace duet
