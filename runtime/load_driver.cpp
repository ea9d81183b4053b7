#include "runtime/load_driver.hpp"

#include <map>
#include <random>

#include "runtime/clock.hpp"

namespace duet {

namespace {
struct in_flight {
  request_record record;
  std::optional<double> last_token_s;
  std::optional<double> cancel_at_s;
};
}  // namespace

std::vector<request_record> run_burst(client& c, const burst_options& o) {
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const auto start = steady::now();
  auto now_s = [&] { return std::chrono::duration<double>(steady::now() - start).count(); };
  std::map<uint64_t, in_flight> live;
  std::vector<request_record> done;
  uint32_t next = 0;
  auto finish = [&](uint64_t id, std::string outcome, uint32_t output_tokens) {
    auto it = live.find(id);
    if (it == live.end()) return;
    auto& r = it->second.record;
    r.finish_s = now_s();
    r.outcome = std::move(outcome);
    if (output_tokens > 0) r.output_tokens = output_tokens;
    done.push_back(std::move(r));
    live.erase(it);
    if (o.progress) o.progress(static_cast<uint32_t>(done.size()), o.requests);
  };
  while (done.size() < o.requests) {
    while (next < o.requests && live.size() < o.concurrency) {
      msg::submit s;
      s.request_id = next + 1;
      s.prompt_tokens.resize(o.prompt_tokens);
      for (uint32_t i = 0; i < o.prompt_tokens; ++i) s.prompt_tokens[i] = static_cast<int32_t>((i * 7919 + next) % 30000);
      s.sampling.max_new_tokens = o.max_new_tokens;
      s.sampling.ignore_eos = true;
      int64_t deadline = 0;
      if (unit(rng) < o.short_deadline_fraction) deadline = unix_ms() + o.short_deadline_ms;
      in_flight f;
      f.record.id = s.request_id;
      f.record.arrival_s = now_s();
      f.record.prompt_tokens = o.prompt_tokens;
      if (unit(rng) < o.cancel_fraction) f.cancel_at_s = f.record.arrival_s + unit(rng) * o.cancel_within_ms / 1000.0;
      live.emplace(s.request_id, std::move(f));
      ++next;
      if (!c.submit(s, deadline)) finish(s.request_id, "send_failed", 0);
    }
    if (steady::now() - start > o.timeout) {
      for (auto& [id, f] : live) c.cancel(id);
      std::vector<uint64_t> ids;
      for (auto& [id, f] : live) ids.push_back(id);
      for (uint64_t id : ids) finish(id, "client_timeout", 0);
      for (; next < o.requests; ++next) {
        request_record r;
        r.id = next + 1;
        r.outcome = "not_sent";
        done.push_back(r);
      }
      break;
    }
    for (auto& [id, f] : live) {
      if (f.cancel_at_s && now_s() >= *f.cancel_at_s) {
        c.cancel(id);
        f.cancel_at_s.reset();
      }
    }
    for (auto& e : c.poll(std::chrono::milliseconds(5))) {
      auto it = live.find(e.request_id);
      if (it == live.end()) continue;
      auto& f = it->second;
      switch (e.what) {
        case client_event::kind::admitted: break;
        case client_event::kind::rejected:
          finish(e.request_id, "rejected_" + std::string(msg::to_string(e.rejection.code)), 0);
          break;
        case client_event::kind::tokens: {
          const double t = now_s();
          for (std::size_t k = 0; k < e.tokens.size(); ++k) {
            if (!f.record.first_token_s) f.record.first_token_s = t;
            else f.record.itl_s.push_back(t - *f.last_token_s);
            f.last_token_s = t;
            ++f.record.output_tokens;
          }
          break;
        }
        case client_event::kind::finished: {
          const auto reason = e.finish.reason;
          const bool ok = reason == msg::finish_reason::stop || reason == msg::finish_reason::length;
          finish(e.request_id, ok ? std::string(request_outcome_ok) : std::string(msg::to_string(reason)), 0);
          break;
        }
      }
    }
  }
  return done;
}

}  // namespace duet
