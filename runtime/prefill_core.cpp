#include "runtime/prefill_core.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "runtime/clock.hpp"
#include "runtime/hop_stats.hpp"
#include "runtime/kv_pool_share.hpp"

namespace duet {

bool prefill_steps_in_background(const std::string& engine_kind) {
  const char* env = std::getenv("DUET_PREFILL_THREAD");
  return engine_kind != "sim" && !(env && std::string_view(env) == "0");
}

prefill_core::prefill_core(std::string self, prefill_settings settings, engine& engine)
    : settings_(std::move(settings)),
      engine_(engine),
      out_(std::move(self)),
      pool_(make_block_manager(engine, settings_.kv_blocks)),
      sender_(engine, out_, settings_.stream),
      step_log_(step_log::from_env(out_.self())) {}

void prefill_core::on_request(const msg::envelope& env, const msg::prefill_request& m, int64_t now_ms,
                              int64_t received_ms) {
  if (received_ms < 0 || received_ms > now_ms) received_ms = now_ms;
  msg::stage_failed refusal{m.seq_id, msg::finish_reason::error, msg::error_code::bad_request, {}};
  if (jobs_.contains(m.seq_id)) {
    ++counters_["duplicate_requests"];
    return;
  }
  if (m.tokens.empty()) {
    refusal.message = "empty prompt";
  } else if (m.tokens.size() >= engine_.info().max_context) {
    refusal.code = msg::error_code::prompt_too_long;
    refusal.message = "prompt of " + std::to_string(m.tokens.size()) + " tokens does not fit the context of " +
                      std::to_string(engine_.info().max_context);
  } else if (pool_.blocks_for(static_cast<uint32_t>(m.tokens.size())) > pool_.total_blocks()) {
    refusal.code = msg::error_code::prompt_too_long;
    refusal.message = "prompt needs more KV blocks than this prefill worker has";
  }
  if (!refusal.message.empty()) {
    ++counters_["refused"];
    out_.send(settings_.router, refusal);
    return;
  }
  job j;
  j.seq_id = m.seq_id;
  j.tokens = m.tokens;
  j.sampling = m.sampling;
  j.stream_to = m.stream_to;
  j.deadline_ms = env.deadline_ms;
  j.accepted_ms = received_ms;
  record_hop(counters_, "inbox", (now_ms - received_ms) * 1000);
  jobs_.emplace(m.seq_id, std::move(j));
  queue_.push_back(m.seq_id);
  ++counters_["accepted"];
}

step_record prefill_core::describe_step(std::span<const prefill_chunk> chunks, int64_t now_ms) {
  step_record r;
  r.role = "prefill";
  r.begin_ms = now_ms;
  r.sequences = static_cast<uint32_t>(chunks.size());
  prefill_mix_text mix;
  for (const auto& c : chunks) {
    r.tokens += c.tokens.size();
    r.context += c.start;
    mix.add(static_cast<uint32_t>(c.tokens.size()), c.start);
  }
  r.mix = mix.str();
  return r;
}

void prefill_core::compute_in_background(std::function<void()> notify) {
  notify_ = std::move(notify);
  if (!background_) background_ = std::make_unique<step_thread>();
}

void prefill_core::send_finished_blocks() {
  for (const auto& [seq_id, ready] : finished_blocks_) {
    auto it = jobs_.find(seq_id);
    if (it != jobs_.end()) sender_.pre_send(seq_id, it->second.stream_to, it->second.blocks, ready);
  }
  finished_blocks_.clear();
}

std::optional<std::chrono::nanoseconds> prefill_core::begin_step(int64_t now_ms) {
  auto step = plan_and_launch(now_ms);
  send_finished_blocks();  // while the step just launched computes
  return step;
}

std::optional<std::chrono::nanoseconds> prefill_core::plan_and_launch(int64_t now_ms) {
  if (!in_flight_.empty()) return std::nullopt;
  if (!unacked_.empty()) {
    if (now_ms < hold_until_ms_) return std::nullopt;  // the acks are a broker round trip away
    ++counters_["register_holds_expired"];
    unacked_.clear();
  }
  std::vector<prefill_chunk> chunks;
  uint32_t budget = settings_.chunk_tokens;
  for (uint64_t seq_id : queue_) {
    if (budget == 0 || chunks.size() >= settings_.max_batch) break;
    job& j = jobs_.at(seq_id);
    if (j.blocks.empty()) {
      const uint32_t need = pool_.blocks_for(static_cast<uint32_t>(j.tokens.size()));
      if (!pool_.can_allocate(need)) break;  // FCFS: later prompts wait behind this one
      j.blocks = pool_.allocate(need);
      j.state = prefill_state::running;
      j.started_ms = now_ms;
      record_hop(counters_, "queue", (now_ms - j.accepted_ms) * 1000);
    }
    const uint32_t remaining = static_cast<uint32_t>(j.tokens.size()) - j.done;
    const uint32_t take = std::min(remaining, budget);
    budget -= take;
    const bool last = take == remaining;
    chunks.push_back({j.seq_id, std::span<const int32_t>(j.tokens).subspan(j.done, take), j.done,
                      j.blocks, last, &j.sampling});
    in_flight_.push_back({j.seq_id, take, last});
  }
  if (chunks.empty()) return std::nullopt;
  step_began_ms_ = now_ms;
  counters_["steps"]++;
  if (step_log_) logged_step_ = describe_step(chunks, now_ms);
  auto step = [this, chunks = std::move(chunks)] {
    const auto began = steady::now();
    step_output out = engine_.prefill(chunks);
    out.engine_wall = steady::now() - began;
    return out;
  };
  if (background_) {
    // The chunks' spans stay valid: in-flight jobs are neither erased nor changed until
    // finish_step (on_cancel and tick skip them).
    background_->launch(std::move(step), notify_);
    in_flight_output_ = {};
    return std::chrono::nanoseconds{0};
  }
  in_flight_output_ = step();
  return in_flight_output_.modeled;
}

void prefill_core::finish_step(int64_t now_ms) {
  if (background_ && background_->busy()) in_flight_output_ = background_->take();
  for (uint64_t seq_id : deferred_releases_) engine_.release(seq_id);
  deferred_releases_.clear();
  record_hop(counters_, "step", (now_ms - step_began_ms_) * 1000);  // one per step, not per prompt
  if (step_log_) log_step(*step_log_, logged_step_, in_flight_output_, now_ms);
  std::size_t sampled = 0;
  for (const auto& p : in_flight_) {
    const msg::token_logprobs* logprobs = p.last ? in_flight_output_.logprobs_at(sampled) : nullptr;
    const int32_t token = p.last ? in_flight_output_.tokens.at(sampled++) : 0;
    auto it = jobs_.find(p.seq_id);
    if (it == jobs_.end()) continue;
    job& j = it->second;
    j.done += p.tokens;
    counters_["tokens"] += p.tokens;
    if (j.cancelled) {
      fail(j, j.cancel_reason, msg::error_code::none, "cancelled during prefill");
      continue;
    }
    if (!j.stream_to.empty()) {
      // Whole blocks are final once computed: they leave while the next chunk computes. In the
      // background, once that chunk is launched (reading them here would hold its launch).
      const auto ready = p.last ? static_cast<uint32_t>(j.blocks.size()) : j.done / engine_.info().block_tokens;
      if (ready > 0 && background_) {
        finished_blocks_.emplace_back(j.seq_id, ready);
      } else if (ready > 0) {
        sender_.pre_send(j.seq_id, j.stream_to, j.blocks, ready);
      }
    }
    if (!p.last) continue;
    std::erase(queue_, j.seq_id);
    j.computed_ms = now_ms;
    record_hop(counters_, "compute", (now_ms - j.started_ms) * 1000);
    j.first_token = token;
    if (logprobs != nullptr) j.first_logprobs = *logprobs;
    j.state = prefill_state::registering;
    j.wait_until_ms = now_ms + settings_.register_timeout_ms;
    msg::kv_register reg;
    reg.handle.handle_id = j.seq_id;
    reg.handle.owner = out_.self();
    reg.handle.token_count = static_cast<uint32_t>(j.tokens.size());
    reg.handle.layout_hash = engine_.info().layout_hash;
    reg.handle.bytes = j.blocks.size() * engine_.info().block_bytes;
    reg.handle.pool = engine_.export_pool();
    if (const uint64_t arena = pool_.shared_arena(); arena != 0) {
      // A worker of this process sharing the pool can take the blocks over (same_pool).
      reg.handle.pool.arena = arena;
      reg.handle.pool.pid = static_cast<int32_t>(::getpid());
      reg.handle.pool.host = host_boot_id();
    }
    reg.block_ids = j.blocks;
    pool_.lend(j.blocks, j.seq_id);  // a worker sharing the pool may take them over (same_pool)
    out_.send(settings_.broker, reg, j.deadline_ms);
    // Only an engine that computes on this thread (nothing modelled left to wait, no
    // background step) blocks the actor through its next step; the sim engine's steps are timers.
    if (settings_.register_hold_ms > 0 && in_flight_output_.modeled.count() == 0 && !background_) {
      unacked_.insert(j.seq_id);
      hold_until_ms_ = now_ms + settings_.register_hold_ms;
    }
  }
  in_flight_.clear();
  in_flight_output_ = {};
}

void prefill_core::on_registered(const msg::kv_registered& m, int64_t now_ms) {
  unacked_.erase(m.handle_id);
  auto it = jobs_.find(m.handle_id);
  if (it != jobs_.end() && it->second.state == prefill_state::handed_over) {
    // The broker extended the lease (a pull or a renew): reclaiming earlier would free
    // blocks the broker still lends out.
    it->second.wait_until_ms = std::max(it->second.wait_until_ms, m.lease_expiry_ms + settings_.lease_grace_ms);
    return;
  }
  if (it == jobs_.end() || it->second.state != prefill_state::registering) {
    ++counters_["stale_acks"];
    return;
  }
  job& j = it->second;
  j.state = prefill_state::handed_over;
  record_hop(counters_, "register", (now_ms - j.computed_ms) * 1000);
  j.wait_until_ms = m.lease_expiry_ms + settings_.lease_grace_ms;
  if (j.cancelled) {
    out_.send(settings_.broker, msg::kv_drop{j.seq_id, "cancelled during registration"});
    out_.send(settings_.router, msg::stage_failed{j.seq_id, j.cancel_reason, msg::error_code::none, "cancelled"});
    return;
  }
  msg::prefill_done done;
  done.seq_id = j.seq_id;
  done.handle_id = j.seq_id;
  done.first_token = j.first_token;
  done.prompt_tokens = static_cast<uint32_t>(j.tokens.size());
  done.layout_hash = engine_.info().layout_hash;
  if (j.first_logprobs) {
    done.has_first_logprobs = true;
    done.first_logprobs = *j.first_logprobs;
  }
  out_.send(settings_.router, done);
}

void prefill_core::on_release(const msg::kv_release& m) {
  auto it = jobs_.find(m.handle_id);
  if (it == jobs_.end() || it->second.state != prefill_state::handed_over) {
    ++counters_["stale_releases"];
    return;
  }
  ++counters_["released"];
  free_job(m.handle_id);
}

void prefill_core::on_kv_send(const std::string& from, const msg::kv_send& m) {
  if (from != settings_.broker) {
    ++counters_["sends_refused"];  // only the broker lends KV out
    return;
  }
  auto it = jobs_.find(m.handle_id);
  if (it == jobs_.end() || it->second.state != prefill_state::handed_over) {
    // Released or reclaimed already: the adopter hears it now, not at its timeout.
    ++counters_["sends_without_handle"];
    out_.send(m.to, msg::kv_moved_failure(m.handle_id, msg::kv_path::tcp, msg::error_code::not_found,
                                          "the KV owner no longer holds this handle"));
    return;
  }
  sender_.start(m.handle_id, m.to, it->second.blocks);
}

void prefill_core::on_chunk_ack(const std::string& from, const msg::kv_chunk_ack& m) { sender_.on_ack(from, m); }

void prefill_core::on_cancel(const msg::cancel_seq& m) {
  auto it = jobs_.find(m.seq_id);
  if (it == jobs_.end()) return;
  job& j = it->second;
  j.cancelled = true;
  j.cancel_reason = m.reason;
  const bool computing = std::any_of(in_flight_.begin(), in_flight_.end(),
                                     [&](const planned& p) { return p.seq_id == m.seq_id; });
  if (j.state <= prefill_state::running && !computing) {
    fail(j, m.reason, msg::error_code::none, "cancelled before prefill finished");
  } else if (j.state == prefill_state::handed_over) {
    // Registered already: the router drops the handle; our blocks return on kv_release.
  }
}

void prefill_core::tick(int64_t now_ms) {
  std::vector<uint64_t> expired;
  for (auto& [id, j] : jobs_) {
    const bool computing = std::any_of(in_flight_.begin(), in_flight_.end(),
                                       [&](const planned& p) { return p.seq_id == id; });
    if (computing) continue;
    if (j.state <= prefill_state::running && j.deadline_ms > 0 && now_ms >= j.deadline_ms) {
      expired.push_back(id);
    } else if (j.state >= prefill_state::registering && now_ms >= j.wait_until_ms) {
      expired.push_back(id);
    }
  }
  for (uint64_t id : expired) {
    job& j = jobs_.at(id);
    if (j.state == prefill_state::registering) {
      ++counters_["register_timeouts"];
      fail(j, msg::finish_reason::error, msg::error_code::unavailable, "KV broker did not acknowledge the handle");
    } else if (j.state == prefill_state::handed_over) {
      ++counters_["owner_reclaims"];  // the broker's lease is over and no release came
      free_job(id);
    } else {
      ++counters_["deadline_expired"];
      fail(j, msg::finish_reason::timeout, msg::error_code::timeout, "deadline passed before prefill finished");
    }
  }
}

void prefill_core::fail(job& j, msg::finish_reason reason, msg::error_code code, const std::string& message) {
  out_.send(settings_.router, msg::stage_failed{j.seq_id, reason, code, message});
  if (j.state == prefill_state::registering) {
    // The broker may still register it later; make sure the handle dies there too.
    out_.send(settings_.broker, msg::kv_drop{j.seq_id, message});
  }
  std::erase(queue_, j.seq_id);
  free_job(j.seq_id);
}

void prefill_core::free_job(uint64_t seq_id) {
  auto it = jobs_.find(seq_id);
  if (it == jobs_.end()) return;
  unacked_.erase(seq_id);
  sender_.stop(seq_id);  // never read blocks that went back to the pool
  if (it->second.state >= prefill_state::registering) {
    pool_.free_lent(it->second.blocks, seq_id);  // lent at registration; an adopter may own them now
  } else {
    pool_.free(it->second.blocks);
  }
  if (step_in_background()) {
    deferred_releases_.push_back(seq_id);  // the engine is computing on another thread
  } else {
    engine_.release(seq_id);
  }
  jobs_.erase(it);
}

std::map<std::string, uint64_t> prefill_core::counters() const {
  auto all = counters_;
  for (const auto& [name, value] : sender_.counters()) all[name] = value;
  if (pool_.moved_away() > 0) all["moved_blocks"] = pool_.moved_away();  // taken over by a same-pool adopter
  return all;
}

msg::load_report prefill_core::load() const {
  msg::load_report r;
  r.actor = out_.self();
  r.queued = static_cast<uint32_t>(queue_.size());
  r.running = static_cast<uint32_t>(jobs_.size() - queue_.size());
  r.free_blocks = pool_.free_blocks();
  r.total_blocks = pool_.total_blocks();
  return r;
}

}  // namespace duet
