#include "sim/live_replay.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "runtime/clock.hpp"
#include "sim/http_replay.hpp"

namespace duet {

std::vector<request_record> replay_live(client& c, std::span<const trace_request> trace,
                                        const live_replay_options& o) {
  if (!(o.time_scale > 0)) throw std::invalid_argument("replay_live: time_scale must be above 0");
  const double scale = o.time_scale;
  const auto start = steady::now();
  auto elapsed_s = [&] { return std::chrono::duration<double>(steady::now() - start).count(); };
  std::vector<request_record> records(trace.size());
  std::vector<double> last_token(trace.size(), 0.0);
  std::vector<bool> open(trace.size(), false), done(trace.size(), false);
  size_t next = 0, finished = 0;
  const uint32_t vocab = std::max<uint32_t>(o.prompt_vocab, 2);
  auto finish = [&](size_t i, std::string outcome) {
    if (done[i]) return;
    done[i] = true;
    open[i] = false;
    records[i].finish_s = elapsed_s() / scale;
    records[i].outcome = std::move(outcome);
    ++finished;
    if (o.progress) o.progress(finished, trace.size());
  };
  while (finished < trace.size()) {
    // Send everything that is due; never wait for the cluster before sending.
    while (next < trace.size() && trace[next].arrival_s * scale <= elapsed_s()) {
      const auto& r = trace[next];
      msg::submit s;
      s.request_id = next + 1;
      s.prompt_tokens = replay_prompt(next, r.input_tokens, vocab);
      s.sampling.max_new_tokens = std::max<uint32_t>(r.output_tokens, 1);
      s.sampling.ignore_eos = true;
      auto& rec = records[next];
      rec.id = next + 1;
      rec.prompt_tokens = r.input_tokens;
      rec.arrival_s = elapsed_s() / scale;
      open[next] = true;
      if (!c.submit(s)) finish(next, "send_failed");
      ++next;
    }
    if (elapsed_s() > std::chrono::duration<double>(o.timeout).count()) {
      for (size_t i = 0; i < trace.size(); ++i) {
        if (open[i]) c.cancel(i + 1);
        if (!done[i]) finish(i, i < next ? "client_timeout" : "not_sent");
      }
      break;
    }
    double wait_s = 0.005;
    if (next < trace.size()) wait_s = std::min(wait_s, trace[next].arrival_s * scale - elapsed_s());
    const auto wait =
        std::chrono::milliseconds(static_cast<int64_t>(std::max(0.0, std::floor(wait_s * 1e3))));
    for (auto& e : c.poll(wait)) {
      if (e.request_id == 0 || e.request_id > trace.size()) continue;
      const size_t i = e.request_id - 1;
      if (done[i]) continue;
      auto& rec = records[i];
      switch (e.what) {
        case client_event::kind::admitted:
          break;
        case client_event::kind::rejected:
          finish(i, "rejected_" + std::string(msg::to_string(e.rejection.code)));
          break;
        case client_event::kind::tokens: {
          const double t = elapsed_s() / scale;
          for (std::size_t k = 0; k < e.tokens.size(); ++k) {
            if (!rec.first_token_s)
              rec.first_token_s = t;
            else
              rec.itl_s.push_back(t - last_token[i]);
            last_token[i] = t;
            ++rec.output_tokens;
          }
          break;
        }
        case client_event::kind::finished: {
          const auto reason = e.finish.reason;
          const bool ok =
              reason == msg::finish_reason::stop || reason == msg::finish_reason::length;
          // ignore_eos: anything but the asked length is a short answer, as over HTTP.
          const bool full = rec.output_tokens == std::max<uint32_t>(trace[i].output_tokens, 1);
          finish(i, !ok   ? std::string(msg::to_string(reason))
                    : full ? std::string(request_outcome_ok)
                           : "short_" + std::string(msg::to_string(reason)));
          break;
        }
      }
    }
  }
  return records;
}

}  // namespace duet
