#include "runtime/client.hpp"

#include <unistd.h>

#include <random>
#include <thread>

#include <zmq_addon.hpp>

#include "messages/dispatch.hpp"
#include "runtime/clock.hpp"
#include "runtime/config.hpp"
#include "runtime/transport.hpp"

namespace duet {

namespace {
std::string random_client_name() {
  std::random_device rd;
  return "client-" + std::to_string(::getpid()) + "-" + std::to_string(rd() % 1000000);
}
}  // namespace

client::client(const std::string& endpoint, std::string router, std::string name)
    : socket_(zmq_context(), zmq::socket_type::dealer), router_(std::move(router)) {
  if (name.empty()) name = random_client_name();
  address_ = name + "/client";
  socket_.set(zmq::sockopt::routing_id, name);
  socket_.set(zmq::sockopt::linger, 0);
  socket_.set(zmq::sockopt::sndhwm, 100000);
  socket_.set(zmq::sockopt::rcvhwm, 100000);
  socket_.connect(endpoint);
}

client::~client() = default;

template <class M>
bool client::send(const std::string& dst, const M& message, int64_t deadline_ms) {
  msg::envelope env;
  env.src = address_;
  env.dst = dst;
  env.deadline_ms = deadline_ms;
  const auto frames = msg::encode(env, message);
  std::vector<zmq::const_buffer> parts;
  for (const auto& f : frames) parts.emplace_back(f.data(), f.size());
  return zmq::send_multipart(socket_, parts, zmq::send_flags::dontwait).has_value();
}

bool client::submit(const msg::submit& request, int64_t deadline_ms) {
  return send(router_, request, deadline_ms);
}

bool client::cancel(uint64_t request_id) { return send(router_, msg::cancel{request_id}); }

std::vector<client_event> client::poll(std::chrono::milliseconds timeout) {
  std::vector<client_event> events;
  zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
  if (zmq::poll(&item, 1, timeout) <= 0) return events;
  for (int i = 0; i < 1024; ++i) {
    std::vector<zmq::message_t> parts;
    if (!zmq::recv_multipart(socket_, std::back_inserter(parts), zmq::recv_flags::dontwait)) break;
    msg::frames frames;
    for (auto& p : parts) frames.push_back(p.to_string());
    auto env = msg::decode_envelope(frames);
    if (!env) {
      ++malformed_;
      continue;
    }
    auto outcome = msg::dispatch(*env, frames, [&](const msg::envelope&, auto& m) {
      using M = std::decay_t<decltype(m)>;
      client_event e;
      if constexpr (std::is_same_v<M, msg::admitted>) {
        e.what = client_event::kind::admitted;
        e.request_id = m.request_id;
        events.push_back(std::move(e));
      } else if constexpr (std::is_same_v<M, msg::rejected>) {
        e.what = client_event::kind::rejected;
        e.request_id = m.request_id;
        e.rejection = m;
        events.push_back(std::move(e));
      } else if constexpr (std::is_same_v<M, msg::finish>) {
        e.what = client_event::kind::finished;
        e.request_id = m.request_id;
        e.finish = m;
        events.push_back(std::move(e));
      } else if constexpr (std::is_same_v<M, msg::token_batch>) {
        // One batch may carry several of our requests: split it per request.
        auto logprobs = msg::token_batch_logprobs(m);
        for (std::size_t k = 0; k < m.request_ids.size() && k < m.tokens.size(); ++k) {
          client_event t;
          t.what = client_event::kind::tokens;
          t.request_id = m.request_ids[k];
          t.tokens = {m.tokens[k]};
          t.positions = {k < m.positions.size() ? m.positions[k] : 0};
          if (logprobs[k]) t.logprobs.push_back(std::move(logprobs[k]));
          events.push_back(std::move(t));
        }
      } else if constexpr (std::is_same_v<M, msg::stats_reply>) {
        stats_replies_.push_back(m);
      }
    });
    if (outcome.status == msg::dispatch_status::malformed) ++malformed_;
  }
  return events;
}

generation client::generate(const msg::submit& request, std::chrono::milliseconds timeout) {
  generation g;
  g.request_id = request.request_id;
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + timeout;
  auto seconds_since_start = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  if (!submit(request)) {
    g.rejection = msg::rejected{request.request_id, msg::error_code::unavailable, "router unreachable", 0};
    return g;
  }
  while (std::chrono::steady_clock::now() < until) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    for (auto& e : poll(std::max(left, std::chrono::milliseconds(1)))) {
      if (e.request_id != request.request_id) continue;
      switch (e.what) {
        case client_event::kind::admitted: g.admitted = true; break;
        case client_event::kind::rejected: g.rejection = e.rejection; return g;
        case client_event::kind::tokens:
          for (std::size_t k = 0; k < e.tokens.size(); ++k) {
            if (g.tokens.empty()) g.ttft_s = seconds_since_start();
            g.tokens.push_back(e.tokens[k]);
            g.logprobs.push_back(k < e.logprobs.size() ? e.logprobs[k] : std::nullopt);
            g.token_times_s.push_back(seconds_since_start());
          }
          break;
        case client_event::kind::finished: g.finish = e.finish; return g;
      }
    }
  }
  cancel(request.request_id);
  g.finish = msg::finish{request.request_id, msg::finish_reason::timeout, msg::error_code::timeout,
                         "no final answer within the client's timeout", 0, static_cast<uint32_t>(g.tokens.size())};
  return g;
}

std::vector<msg::stats_reply> client::stats(const std::vector<std::string>& actors, std::chrono::milliseconds timeout) {
  stats_replies_.clear();
  for (const auto& a : actors) send(a, msg::stats_request{});
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (stats_replies_.size() < actors.size() && std::chrono::steady_clock::now() < until) {
    [[maybe_unused]] auto ignored = poll(std::chrono::milliseconds(10));
  }
  return std::exchange(stats_replies_, {});
}

router_location find_router(const deployment_config& config) {
  for (const auto& n : config.nodes) {
    for (const auto& a : n.actors) {
      if (a.role == actor_role::router) return {n.endpoint, n.name + "/" + a.name};
    }
  }
  throw config_error("the deployment has no router");
}

bool wait_ready(client& c, const std::string& router, std::chrono::milliseconds timeout) {
  const auto until = steady::now() + timeout;
  while (steady::now() < until) {
    auto replies = c.stats({router}, std::chrono::milliseconds(200));
    if (!replies.empty() && replies[0].counters["ready_prefill"] > 0 && replies[0].counters["ready_decode"] > 0)
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

}  // namespace duet
