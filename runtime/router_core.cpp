#include "runtime/router_core.hpp"

#include <algorithm>
#include <limits>

#include "runtime/clock.hpp"
#include "runtime/hop_stats.hpp"

namespace duet {

router_core::router_core(std::string self, router_settings settings, text_encoder encode)
    : settings_(std::move(settings)), encode_(std::move(encode)), out_(std::move(self)) {
  for (const auto& w : settings_.prefill_workers) workers_[w];
  for (const auto& w : settings_.decode_workers) workers_[w];
}

uint32_t router_core::outstanding(const std::string& worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : it->second.outstanding;
}

bool router_core::alive(const std::string& worker, int64_t now_ms) const {
  const auto& state = workers_.at(worker);
  return state.last_seen_ms > 0 && now_ms - state.last_seen_ms <= settings_.worker_timeout_ms;
}

std::string router_core::pick(const std::vector<std::string>& candidates, std::size_t& cursor, int64_t now_ms) {
  if (settings_.policy == "round_robin") {
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      const auto& w = candidates[(cursor + i) % candidates.size()];
      if (alive(w, now_ms)) {
        cursor = (cursor + i + 1) % candidates.size();
        return w;
      }
    }
    return {};
  }
  std::string best;
  uint32_t best_load = std::numeric_limits<uint32_t>::max();
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const auto& w = candidates[(cursor + i) % candidates.size()];  // rotate ties
    if (!alive(w, now_ms)) continue;
    if (workers_.at(w).outstanding < best_load) {
      best_load = workers_.at(w).outstanding;
      best = w;
    }
  }
  cursor = candidates.empty() ? 0 : (cursor + 1) % candidates.size();
  return best;
}

void router_core::reject(const std::string& client, uint64_t request_id, msg::error_code code, std::string message,
                         uint32_t retry_after_ms) {
  ++counters_[std::string("rejected_") + std::string(msg::to_string(code))];
  out_.send(client, msg::rejected{request_id, code, std::move(message), retry_after_ms});
}

void router_core::on_submit(const msg::envelope& env, const msg::submit& m, int64_t now_ms) {
  const std::string& client = env.src;
  if (by_client_.contains({client, m.request_id})) {
    return reject(client, m.request_id, msg::error_code::bad_request, "request id already in flight");
  }
  std::vector<int32_t> prompt = m.prompt_tokens;
  if (prompt.empty() && !m.prompt.empty()) {
    const auto t0 = steady::now();
    prompt = encode_(m.prompt);
    record_hop(counters_, "encode", std::chrono::duration_cast<std::chrono::microseconds>(steady::now() - t0).count());
  }
  if (prompt.empty()) return reject(client, m.request_id, msg::error_code::bad_request, "the prompt is empty");
  if (m.sampling.max_new_tokens == 0 || m.sampling.max_new_tokens > settings_.max_new_tokens_limit) {
    return reject(client, m.request_id, msg::error_code::bad_request,
                  "max_new_tokens must be between 1 and " + std::to_string(settings_.max_new_tokens_limit));
  }
  if (prompt.size() + 1 > settings_.max_context) {
    return reject(client, m.request_id, msg::error_code::prompt_too_long,
                  "prompt of " + std::to_string(prompt.size()) + " tokens exceeds the context of " +
                      std::to_string(settings_.max_context));
  }
  if (requests_.size() >= settings_.queue_limit) {
    return reject(client, m.request_id, msg::error_code::overloaded, "too many requests in flight", 1000);
  }
  const std::string prefill = pick(settings_.prefill_workers, prefill_cursor_, now_ms);
  const std::string decode = pick(settings_.decode_workers, decode_cursor_, now_ms);
  if (prefill.empty() || decode.empty()) {
    return reject(client, m.request_id, msg::error_code::unavailable,
                  prefill.empty() ? "no prefill worker is alive" : "no decode worker is alive", 1000);
  }
  request r;
  r.seq_id = next_seq_++;
  r.client = client;
  r.request_id = m.request_id;
  r.prompt = std::move(prompt);
  r.sampling = m.sampling;
  r.deadline_ms = env.deadline_ms > 0 ? env.deadline_ms : now_ms + settings_.request_timeout_ms;
  r.submitted_ms = now_ms;
  r.prefill = prefill;
  r.decode = decode;
  ++workers_[prefill].outstanding;
  ++workers_[decode].outstanding;
  out_.send(client, msg::admitted{m.request_id, static_cast<uint32_t>(r.prompt.size()),
                                  static_cast<uint32_t>(requests_.size())});
  // A request that may decode streams its KV to the decode worker during prefill, if asked.
  const bool stream_early = settings_.stream_prefill && r.sampling.max_new_tokens > 1;
  out_.send(prefill, msg::prefill_request{r.seq_id, r.prompt, r.sampling, stream_early ? decode : ""}, r.deadline_ms);
  by_client_[{client, m.request_id}] = r.seq_id;
  requests_.emplace(r.seq_id, std::move(r));
  ++counters_["admitted"];
}

void router_core::on_cancel(const msg::envelope& env, const msg::cancel& m) {
  auto key = by_client_.find({env.src, m.request_id});
  if (key == by_client_.end()) return;  // finished already, or never admitted
  request& r = requests_.at(key->second);
  ++counters_["cancels"];
  if (r.cancel_sent) return;
  r.cancel_sent = true;
  out_.send(r.state == request_state::prefilling ? r.prefill : r.decode,
            msg::cancel_seq{r.seq_id, msg::finish_reason::cancelled});
}

void router_core::on_prefill_done(const msg::prefill_done& m, int64_t now_ms) {
  auto it = requests_.find(m.seq_id);
  if (it == requests_.end() || it->second.state != request_state::prefilling) {
    // We answered already (gave up or cancelled): nobody will adopt this KV.
    out_.send(settings_.broker, msg::kv_drop{m.handle_id, "request no longer in flight"});
    ++counters_["late_prefills"];
    return;
  }
  request& r = it->second;
  r.handle_id = m.handle_id;
  record_hop(counters_, "ttft", (now_ms - r.submitted_ms) * 1000);
  --workers_[r.prefill].outstanding;
  const auto& eos = settings_.eos_ids;
  const bool stopped = !r.sampling.ignore_eos &&
                       (std::find(eos.begin(), eos.end(), m.first_token) != eos.end() ||
                        std::find(r.sampling.stop_token_ids.begin(), r.sampling.stop_token_ids.end(),
                                  m.first_token) != r.sampling.stop_token_ids.end());
  const bool ends_here = r.cancel_sent || stopped || r.sampling.max_new_tokens <= 1;
  if (ends_here || !settings_.first_token_from_decode) {
    msg::token_batch first;
    msg::token_batch_push(first, r.request_id, m.first_token, 0, m.has_first_logprobs ? &m.first_logprobs : nullptr);
    out_.send(r.client, first);
    r.first_sent = true;
  }
  if (ends_here) {
    out_.send(settings_.broker, msg::kv_drop{m.handle_id, "no decode needed"});
    const auto reason = r.cancel_sent ? r.cancel_reason
                        : stopped     ? msg::finish_reason::stop
                                      : msg::finish_reason::length;
    --workers_[r.decode].outstanding;
    r.decode.clear();
    const std::string why = reason == msg::finish_reason::cancelled ? "cancelled"
                            : reason == msg::finish_reason::timeout ? "deadline passed before decode"
                                                                    : "";
    return answer_and_forget(r, reason,
                             reason == msg::finish_reason::timeout ? msg::error_code::timeout : msg::error_code::none,
                             why, 1);
  }
  r.state = request_state::decoding;
  msg::kv_adopt adopt;
  adopt.seq_id = r.seq_id;
  adopt.handle_id = m.handle_id;
  adopt.layout_hash = m.layout_hash;
  adopt.client = r.client;
  adopt.request_id = r.request_id;
  adopt.first_token = m.first_token;
  adopt.sampling = r.sampling;
  adopt.prompt = r.prompt;
  if (!r.first_sent) {
    adopt.send_first = true;
    adopt.has_first_logprobs = m.has_first_logprobs;
    if (m.has_first_logprobs) adopt.first_logprobs = m.first_logprobs;
  }
  out_.send(r.decode, adopt, r.deadline_ms);
}

void router_core::on_stage_failed(const std::string& from, const msg::stage_failed& m) {
  auto it = requests_.find(m.seq_id);
  if (it == requests_.end() || it->second.state != request_state::prefilling || it->second.prefill != from) {
    ++counters_["stale_failures"];
    return;
  }
  request& r = it->second;
  --workers_[r.prefill].outstanding;
  --workers_[r.decode].outstanding;
  r.prefill.clear();
  r.decode.clear();
  answer_and_forget(r, m.reason, m.code, m.message, 0);
}

void router_core::on_request_done(const msg::request_done& m) {
  auto it = requests_.find(m.seq_id);
  if (it == requests_.end() || it->second.state != request_state::decoding) return;
  --workers_[it->second.decode].outstanding;
  ++counters_[std::string("finished_") + std::string(msg::to_string(m.reason))];
  forget(m.seq_id);
}

void router_core::on_load(const std::string& from, const msg::load_report& m, int64_t now_ms) {
  auto it = workers_.find(from);
  if (it == workers_.end()) return;  // not a worker of this deployment
  it->second.last_seen_ms = now_ms;
  it->second.last = m;
}

void router_core::tick(int64_t now_ms) {
  std::vector<uint64_t> give_up;
  std::vector<uint64_t> orphaned;  // their worker stopped reporting: it died or is cut off
  for (auto& [id, r] : requests_) {
    const std::string& holder = r.state == request_state::prefilling ? r.prefill : r.decode;
    if (workers_.at(holder).last_seen_ms > 0 && !alive(holder, now_ms)) {
      orphaned.push_back(id);
      continue;
    }
    if (now_ms < r.deadline_ms) continue;
    if (!r.cancel_sent) {
      r.cancel_sent = true;
      r.cancel_reason = msg::finish_reason::timeout;
      out_.send(r.state == request_state::prefilling ? r.prefill : r.decode,
                msg::cancel_seq{r.seq_id, msg::finish_reason::timeout});
    }
    if (now_ms >= r.deadline_ms + settings_.give_up_grace_ms) give_up.push_back(id);
  }
  for (uint64_t id : give_up) {
    request& r = requests_.at(id);
    ++counters_["given_up"];
    if (r.handle_id != 0) out_.send(settings_.broker, msg::kv_drop{r.handle_id, "request given up"});
    if (r.state == request_state::prefilling) --workers_[r.prefill].outstanding;
    if (!r.decode.empty()) --workers_[r.decode].outstanding;
    answer_and_forget(r, msg::finish_reason::timeout, msg::error_code::timeout,
                      "workers did not answer before the deadline",
                      r.first_sent ? 1 : 0);  // the tokens this router knows went out
  }
  for (uint64_t id : orphaned) {
    request& r = requests_.at(id);
    const std::string holder = r.state == request_state::prefilling ? r.prefill : r.decode;
    ++counters_["orphaned"];
    if (r.handle_id != 0) out_.send(settings_.broker, msg::kv_drop{r.handle_id, "worker lost"});
    if (r.state == request_state::prefilling) --workers_[r.prefill].outstanding;
    if (!r.decode.empty()) --workers_[r.decode].outstanding;
    answer_and_forget(r, msg::finish_reason::error, msg::error_code::unavailable,
                      "worker " + holder + " stopped answering",
                      r.first_sent ? 1 : 0);  // the tokens this router knows went out
  }
  ready_prefill_ = 0;
  ready_decode_ = 0;
  for (const auto& w : settings_.prefill_workers) ready_prefill_ += alive(w, now_ms);
  for (const auto& w : settings_.decode_workers) ready_decode_ += alive(w, now_ms);
}

void router_core::answer_and_forget(request& r, msg::finish_reason reason, msg::error_code code,
                                    const std::string& message, uint32_t completion_tokens) {
  msg::finish f;
  f.request_id = r.request_id;
  f.reason = reason;
  f.code = code;
  f.message = message;
  f.prompt_tokens = static_cast<uint32_t>(r.prompt.size());
  f.completion_tokens = completion_tokens;
  out_.send(r.client, f);
  ++counters_[std::string("finished_") + std::string(msg::to_string(reason))];
  forget(r.seq_id);
}

void router_core::forget(uint64_t seq_id) {
  auto it = requests_.find(seq_id);
  if (it == requests_.end()) return;
  by_client_.erase({it->second.client, it->second.request_id});
  requests_.erase(it);
}

}  // namespace duet
