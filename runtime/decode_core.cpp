#include "runtime/decode_core.hpp"

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include <unistd.h>

#include "runtime/clock.hpp"
#include "runtime/hop_stats.hpp"
#include "runtime/kv_pool_share.hpp"

namespace duet {

bool decode_steps_in_background(const std::string& engine_kind) {
  const char* env = std::getenv("DUET_DECODE_THREAD");
  return engine_kind != "sim" && !(env && std::string_view(env) == "0");
}

decode_core::decode_core(std::string self, decode_settings settings, engine& engine)
    : settings_(std::move(settings)),
      engine_(engine),
      out_(std::move(self)),
      pool_(make_block_manager(engine, settings_.kv_blocks)),
      step_log_(step_log::from_env(out_.self())) {}

std::optional<kv_allocation> kv_allocation_from_string(std::string_view text) {
  if (text == "on_demand") return kv_allocation::on_demand;
  if (text == "reserve") return kv_allocation::reserve;
  return std::nullopt;
}

std::string decode_batch_counter(std::size_t batch) {
  std::size_t bound = 16;
  if (batch <= 256) {
    bound = std::max<std::size_t>(16, (batch + 15) / 16 * 16);
  } else {
    bound = 512;
    while (bound < batch) bound *= 2;
  }
  return std::string(decode_batch_counter_prefix) + std::to_string(bound);
}

uint32_t decode_core::reserved_tokens(const sequence& s) const {
  // The last generated token is never fed back, so prompt + max_new - 1 positions hold KV.
  const uint64_t want = uint64_t{s.prompt_len} + std::max<uint32_t>(s.sampling.max_new_tokens, 1) - 1;
  return static_cast<uint32_t>(std::min<uint64_t>(want, engine_.info().max_context));
}

uint32_t decode_core::adoption_blocks(const sequence& s) const {
  if (settings_.allocation == kv_allocation::reserve) return pool_.blocks_for(reserved_tokens(s));
  // The prompt's KV plus the position the first decode step writes (the first token's).
  return pool_.blocks_for(static_cast<uint32_t>(s.tokens.size()));
}

bool decode_core::can_admit(uint32_t need) const {
  if (!pool_.can_allocate(need)) return false;
  // Reserve: the sequence holds all it will ever need, so any free block may go to it.
  if (settings_.allocation == kv_allocation::reserve) return true;
  // On demand: keep a margin so running sequences grow into free blocks instead of
  // preempting each other right after an admission. An empty pool admits what fits: a
  // sequence alone always fits (on_adopt refuses the others), so nothing waits forever.
  const uint32_t watermark = std::max<uint32_t>(1, pool_.total_blocks() / 100);
  return pool_.free_blocks() - need >= watermark || pool_.used_blocks() == 0;
}

bool decode_core::computing(uint64_t seq_id) const {
  return std::find(in_flight_.begin(), in_flight_.end(), seq_id) != in_flight_.end();
}

void decode_core::on_adopt(const msg::envelope& env, const msg::kv_adopt& m, int64_t now_ms) {
  if (seqs_.contains(m.seq_id)) {
    ++counters_["duplicate_adopts"];
    return;
  }
  sequence s;
  s.seq_id = m.seq_id;
  s.handle_id = m.handle_id;
  s.layout_hash = m.layout_hash;
  s.client = m.client;
  s.request_id = m.request_id;
  s.sampling = m.sampling;
  s.tokens = m.prompt;
  s.prompt_len = static_cast<uint32_t>(m.prompt.size());
  s.tokens.push_back(m.first_token);
  s.generated = 1;
  s.first_unsent = m.send_first;
  if (m.send_first && m.has_first_logprobs) s.first_logprobs = m.first_logprobs;
  s.arrival = next_arrival_++;
  s.deadline_ms = env.deadline_ms;
  s.wait_until_ms = now_ms + settings_.transfer_timeout_ms;
  // The broker's lease started at registration, possibly long ago: an adoption that must
  // wait for memory renews it at the next tick, not a renewal period from now.
  s.next_renew_ms = now_ms;
  if (m.layout_hash != engine_.info().layout_hash) {
    ++counters_["incompatible_adopts"];
    out_.send(settings_.broker, msg::kv_nack{m.handle_id, "KV layout differs from this decode worker's"});
    seqs_.emplace(m.seq_id, std::move(s));
    end(seqs_.at(m.seq_id), msg::finish_reason::error, msg::error_code::incompatible,
        "prefill and decode workers disagree on the KV layout");
    return;
  }
  if (pool_.blocks_for(reserved_tokens(s)) > pool_.total_blocks()) {
    out_.send(settings_.broker, msg::kv_nack{m.handle_id, "sequence larger than the decode pool"});
    seqs_.emplace(m.seq_id, std::move(s));
    end(seqs_.at(m.seq_id), msg::finish_reason::error, msg::error_code::prompt_too_long,
        "prompt plus max_tokens needs more KV blocks than a decode worker has");
    return;
  }
  seqs_.emplace(m.seq_id, std::move(s));
  waiting_.push_back(m.seq_id);
  ++counters_["adopted"];
  try_admit_waiting(now_ms);
}

bool decode_core::try_resume_preempted() {
  while (!preempted_.empty()) {
    sequence& s = seqs_.at(preempted_.front());
    const uint32_t need = pool_.blocks_for(static_cast<uint32_t>(s.tokens.size()));
    if (!can_admit(need)) return false;
    s.blocks = pool_.allocate(need);
    // Nothing to rebuild when only the next input token exists (an empty prompt).
    s.state = s.tokens.size() > 1 ? decode_state::recomputing : decode_state::running;
    s.recomputed = 0;
    preempted_.pop_front();
    running_.push_back(s.seq_id);  // admitted again: the youngest, as vLLM
  }
  return true;
}

void decode_core::try_admit_waiting(int64_t now_ms) {
  // A preempted sequence already streamed tokens to its client: it goes first.
  if (!try_resume_preempted()) return;
  while (!waiting_.empty()) {
    sequence& s = seqs_.at(waiting_.front());
    const uint32_t need = adoption_blocks(s);
    auto early = early_.find(s.handle_id);
    const auto have = early == early_.end() ? 0u : static_cast<uint32_t>(early->second.blocks.size());
    const uint32_t more = need > have ? need - have : 0;
    if (more > 0 && !can_admit(more)) return;
    if (early != early_.end()) {
      // Streamed ahead during prefill: its blocks come first, in the handle's order.
      s.blocks = std::move(early->second.blocks);
      s.receiver = std::move(early->second.receiver);
      early_.erase(early);
      ++counters_["early_adoptions"];
    }
    const auto extra = pool_.allocate(more);
    s.blocks.insert(s.blocks.end(), extra.begin(), extra.end());
    s.state = decode_state::pulling;
    s.wait_until_ms = now_ms + settings_.transfer_timeout_ms;
    s.next_renew_ms = now_ms + settings_.renew_every_ms;  // the pull itself extends the lease
    waiting_.pop_front();
    msg::kv_pull pull;
    pull.handle_id = s.handle_id;
    pull.layout_hash = s.layout_hash;
    pull.host = host_boot_id();
    pull.can_import = engine_.can_import();
    pull.pid = static_cast<int32_t>(::getpid());
    pull.arena = pool_.shared_arena();
    pull.block_ids = s.blocks;
    s.pulled = std::chrono::steady_clock::now();
    out_.send(settings_.broker, pull, s.deadline_ms);
    if (s.receiver.complete()) {
      // All of it came during prefill: confirm after the pull (one outbox, in order).
      ++counters_["early_complete"];
      kv_arrived(s, msg::kv_path::tcp);
    }
  }
}

decode_core::sequence* decode_core::find_by_handle(uint64_t handle_id) {
  auto it = std::find_if(seqs_.begin(), seqs_.end(),
                         [&](const auto& kv) { return kv.second.handle_id == handle_id; });
  return it == seqs_.end() ? nullptr : &it->second;
}

void decode_core::on_moved(const msg::kv_moved& m, int64_t now_ms) {
  const bool imports = m.path == msg::kv_path::host_shm || m.path == msg::kv_path::cuda_ipc;
  if (imports && engine_busy()) {
    deferred_.emplace_back(msg::envelope{}, m);  // the copy from the owner's pool waits for the step
    return;
  }
  sequence* s = find_by_handle(m.handle_id);
  if (!s || s->state != decode_state::pulling) {
    ++counters_["stale_moves"];
    return;
  }
  if (m.code != msg::error_code::none) {
    ++counters_["transfer_failures"];
    // The broker may still hold the handle (an owner-side failure): release it now.
    out_.send(settings_.broker, msg::kv_nack{m.handle_id, "transfer failed: " + m.message});
    end(*s, msg::finish_reason::error, m.code, "KV transfer failed: " + m.message);
    return;
  }
  if (m.path == msg::kv_path::same_pool && !m.source_blocks.empty()) {
    // One pool with the owner: its blocks become ours, ours (as many) become its.
    const std::string error = pool_.take_lent(m.handle_id, m.source_blocks, s->blocks);
    if (!error.empty()) {
      ++counters_["transfer_failures"];
      out_.send(settings_.broker, msg::kv_nack{m.handle_id, "ownership move failed: " + error});
      end(*s, msg::finish_reason::error, msg::error_code::unavailable, "KV transfer failed: " + error);
      return;
    }
    counters_["moved_blocks"] += m.source_blocks.size();
  } else if (m.path == msg::kv_path::host_shm || m.path == msg::kv_path::cuda_ipc) {
    // The broker lent us the owner's pool: copy the blocks from it ourselves.
    std::string error;
    if (m.source_blocks.size() > s->blocks.size() ||
        !engine_.import_blocks(m.source, m.source_blocks, s->blocks, error)) {
      if (error.empty()) error = "the handle holds more blocks than were reserved";
      ++counters_["transfer_failures"];
      out_.send(settings_.broker, msg::kv_nack{m.handle_id, "import failed: " + error});
      end(*s, msg::finish_reason::error, msg::error_code::unavailable, "KV transfer failed: " + error);
      return;
    }
    counters_["imported_bytes"] += m.bytes;
  }
  kv_arrived(*s, m.path);
}

void decode_core::on_early_chunk(const msg::envelope& env, const msg::kv_chunk& m, int64_t now_ms) {
  auto it = early_.find(m.handle_id);
  if (it == early_.end()) {
    if (m.first != 0 || m.total == 0) {
      ++counters_["stale_chunks"];
      return;
    }
    if (!can_admit(m.total)) {
      ++counters_["early_no_memory"];  // unacked: the stream starts over from block 0 after the pull
      return;
    }
    it = early_.try_emplace(m.handle_id).first;
    it->second.from = env.src;
    it->second.blocks = pool_.allocate(m.total);
    it->second.receiver.allow_gaps();  // the broker's kv_send resends from our last ack
  }
  early_kv& e = it->second;
  if (env.src != e.from) {
    ++counters_["stale_chunks"];
    return;
  }
  const uint64_t started_us = kv_stream_clock_us();
  const auto status = e.receiver.on_chunk(engine_, e.blocks, m);
  counters_["stream_write_us"] += kv_stream_clock_us() - started_us;
  if (status == kv_stream_receiver::status::gap) {
    ++counters_["stream_gaps"];  // a chunk before it was lost: ack what we have, the owner resends
    out_.send(env.src, msg::kv_chunk_ack{m.handle_id, e.receiver.received(), true});
    return;
  }
  if (status == kv_stream_receiver::status::failed) {
    ++counters_["early_failures"];  // the pull's stream starts over and fails there, readably
    pool_.free(e.blocks);
    early_.erase(it);
    return;
  }
  if (status != kv_stream_receiver::status::duplicate) {
    counters_["early_bytes_received"] += m.bytes.size();
    counters_["stream_bytes_received"] += m.bytes.size();
  }
  e.wait_until_ms = now_ms + settings_.transfer_timeout_ms;
  out_.send(env.src, msg::kv_chunk_ack{m.handle_id, e.receiver.received()});
}

void decode_core::on_chunk(const msg::envelope& env, msg::kv_chunk m, int64_t now_ms) {
  if (engine_busy()) {
    deferred_.emplace_back(env, std::move(m));  // written into the pool after the step
    return;
  }
  sequence* s = find_by_handle(m.handle_id);
  if (!s && settings_.accept_early) return on_early_chunk(env, m, now_ms);
  if (!s || s->state != decode_state::pulling) {
    ++counters_["stale_chunks"];
    return;
  }
  const uint64_t started_us = kv_stream_clock_us();
  const auto status = s->receiver.on_chunk(engine_, s->blocks, m);
  counters_["stream_write_us"] += kv_stream_clock_us() - started_us;
  if (status == kv_stream_receiver::status::duplicate) {
    out_.send(env.src, msg::kv_chunk_ack{m.handle_id, s->receiver.received()});
    return;
  }
  if (status == kv_stream_receiver::status::gap) {
    // Begun during prefill: a chunk was lost. Acking what we have makes the owner resend from
    // there; should that be lost too, the transfer timeout ends the wait.
    ++counters_["stream_gaps"];
    out_.send(env.src, msg::kv_chunk_ack{m.handle_id, s->receiver.received(), true});
    return;
  }
  if (status == kv_stream_receiver::status::failed) {
    ++counters_["transfer_failures"];
    out_.send(settings_.broker, msg::kv_nack{m.handle_id, s->receiver.error()});
    end(*s, msg::finish_reason::error, msg::error_code::unavailable, "KV transfer failed: " + s->receiver.error());
    return;
  }
  counters_["stream_bytes_received"] += m.bytes.size();
  s->wait_until_ms = now_ms + settings_.transfer_timeout_ms;  // progress: the wait is per chunk
  out_.send(env.src, msg::kv_chunk_ack{m.handle_id, s->receiver.received()});
  if (status == kv_stream_receiver::status::complete) kv_arrived(*s, msg::kv_path::tcp);
}

void decode_core::kv_arrived(sequence& s, msg::kv_path path) {
  out_.send(settings_.broker, msg::kv_confirm{s.handle_id});
  const std::string name(msg::to_string(path));
  counters_["path_" + name]++;
  if (path != msg::kv_path::none) {
    // From the pull to the KV in place: the broker's round trip plus the copy, if any. (Not
    // for the sim engine's accounting, whose runs stay a function of their inputs.)
    counters_["handover_us_" + name] += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - s.pulled).count());
  }
  if (s.cancelled) {
    end(s, s.cancel_reason, msg::error_code::none, "cancelled");
    return;
  }
  s.state = decode_state::running;
  running_.push_back(s.seq_id);
}

void decode_core::on_cancel(const msg::cancel_seq& m) {
  auto it = seqs_.find(m.seq_id);
  if (it == seqs_.end()) return;
  sequence& s = it->second;
  s.cancelled = true;
  s.cancel_reason = m.reason;
  if (s.state == decode_state::waiting_memory) {
    out_.send(settings_.broker, msg::kv_nack{s.handle_id, "cancelled"});
    end(s, m.reason, msg::error_code::none, "cancelled");
  } else if (s.state >= decode_state::preempted && !computing(m.seq_id)) {
    end(s, m.reason, msg::error_code::none, "cancelled");
  }
  // pulling: ended when kv_moved arrives (confirm first, so the source frees its blocks);
  // computing: ended in finish_step.
}

void decode_core::preempt(sequence& s) {
  // Not engine_.release(): that would drop per-sequence engine state (a seeded sampler's),
  // and the sequence goes on; only its KV is given up and rebuilt on resumption.
  pool_.free(s.blocks);
  s.blocks.clear();
  s.state = decode_state::preempted;
  s.recomputed = 0;
  std::erase(running_, s.seq_id);
  const auto at = std::upper_bound(preempted_.begin(), preempted_.end(), s.arrival,
                                   [&](uint64_t arrival, uint64_t id) { return arrival < seqs_.at(id).arrival; });
  preempted_.insert(at, s.seq_id);
  ++counters_["preemptions"];
}

bool decode_core::grow(sequence& s) {
  const uint32_t need = pool_.blocks_for(static_cast<uint32_t>(s.tokens.size()));
  while (s.blocks.size() < need) {
    const auto more = need - static_cast<uint32_t>(s.blocks.size());
    if (pool_.can_allocate(more)) {
      const auto blocks = pool_.allocate(more);
      s.blocks.insert(s.blocks.end(), blocks.begin(), blocks.end());
      break;
    }
    // LIFO, as vLLM: the most recently admitted sequence has the least work to lose. Steps
    // never overlap, so nothing is in flight here; the check keeps preempt() honest anyway.
    auto victim = std::find_if(running_.rbegin(), running_.rend(), [&](uint64_t id) { return !computing(id); });
    if (victim == running_.rend()) return false;
    sequence& v = seqs_.at(*victim);
    preempt(v);
    if (&v == &s) return false;
  }
  return true;
}

decode_core::sequence* decode_core::next_recompute() {
  for (uint64_t id : running_) {
    sequence& s = seqs_.at(id);
    if (s.state == decode_state::recomputing) return &s;
  }
  return nullptr;
}

std::chrono::nanoseconds decode_core::begin_recompute(sequence& s) {
  // Positions 0 .. size-2 hold KV; the last token is the next decode step's input. No token
  // is sampled (last = false) and no sampling is passed: the engine keeps no prompt state.
  const auto target = static_cast<uint32_t>(s.tokens.size() - 1);
  const uint32_t n = std::min(std::max<uint32_t>(settings_.chunk_tokens, 1), target - s.recomputed);
  prefill_chunk chunk;
  chunk.seq_id = s.seq_id;
  chunk.tokens = std::span<const int32_t>(s.tokens).subspan(s.recomputed, n);
  chunk.start = s.recomputed;
  chunk.blocks = s.blocks;
  chunk.last = false;
  in_flight_.push_back(s.seq_id);
  recompute_in_flight_ = n;
  ++counters_["recompute_steps"];
  return launch([this, chunk] { return engine_.prefill(std::span(&chunk, 1)); });
}

std::chrono::nanoseconds decode_core::launch(std::function<step_output()> untimed) {
  auto step = [untimed = std::move(untimed)] {
    const auto began = steady::now();
    step_output out = untimed();
    out.engine_wall = steady::now() - began;
    return out;
  };
  if (!background_) {
    if (send_before_computing_) send_before_computing_();
    in_flight_output_ = step();
    return in_flight_output_.modeled;
  }
  // The step's spans stay valid: in-flight sequences are neither erased nor changed until
  // finish_step (on_cancel and tick skip them, grow and preempt run only in begin_step).
  background_->launch(std::move(step), notify_);
  in_flight_output_ = {};
  return std::chrono::nanoseconds{0};
}

void decode_core::compute_in_background(std::function<void()> notify) {
  notify_ = std::move(notify);
  if (!background_) background_ = std::make_unique<step_thread>();
}

std::optional<std::chrono::nanoseconds> decode_core::begin_decode() {
  std::vector<uint64_t> batch;
  // Oldest first: a sequence that must grow preempts only younger ones, never one already
  // in this batch. Copy: grow() may take sequences out of running_.
  const std::vector<uint64_t> order = running_;
  for (uint64_t id : order) {
    if (batch.size() >= settings_.max_batch) break;
    auto it = seqs_.find(id);
    if (it == seqs_.end() || it->second.state != decode_state::running) continue;
    if (grow(it->second)) batch.push_back(id);
  }
  if (batch.empty()) return std::nullopt;
  std::vector<decode_slot> slots;
  for (uint64_t id : batch) {
    sequence& s = seqs_.at(id);
    slots.push_back({id, s.tokens, s.blocks, &s.sampling});
  }
  send_first_tokens(batch);  // before the launch: the step computes the token after it
  in_flight_ = std::move(batch);
  recompute_in_flight_ = 0;
  ++counters_["steps"];
  counters_["batched_sequences"] += slots.size();
  ++counters_[decode_batch_counter(slots.size())];
  if (step_log_) {
    logged_step_ = {"decode", step_began_ms_, 0, 0, static_cast<uint32_t>(slots.size()), slots.size(), 0, {}};
    for (const auto& s : slots) logged_step_.context += s.history.size();
  }
  return launch([this, slots = std::move(slots)] { return engine_.decode(slots); });
}

std::optional<std::chrono::nanoseconds> decode_core::begin_step(int64_t now_ms) {
  if (!in_flight_.empty()) return std::nullopt;
  step_began_ms_ = now_ms;
  // A recompute chunk and a decode step take turns, so neither the recomputing sequence
  // nor the running batch waits for the other to finish.
  sequence* r = next_recompute();
  if (r && !last_step_recompute_) {
    last_step_recompute_ = true;
    return begin_recompute(*r);
  }
  last_step_recompute_ = false;
  if (auto wait = begin_decode()) return wait;
  r = next_recompute();  // nothing to decode (or it was preempted while growing)
  if (!r) return std::nullopt;
  last_step_recompute_ = true;
  return begin_recompute(*r);
}

void decode_core::finish_step(int64_t now_ms) {
  if (engine_busy()) in_flight_output_ = background_->take();
  for (uint64_t id : deferred_releases_) engine_.release(id);
  deferred_releases_.clear();
  if (recompute_in_flight_ > 0) {
    finish_recompute(now_ms);
  } else {
    record_hop(counters_, "step", (now_ms - step_began_ms_) * 1000);  // decode steps only (hop_stats.hpp)
    if (step_log_) log_step(*step_log_, logged_step_, in_flight_output_, now_ms);
    finish_decode(now_ms);
  }
  run_deferred(now_ms);
  try_admit_waiting(now_ms);
}

void decode_core::run_deferred(int64_t now_ms) {
  auto deferred = std::move(deferred_);
  deferred_.clear();
  for (auto& [env, message] : deferred) {
    if (auto* moved = std::get_if<msg::kv_moved>(&message)) on_moved(*moved, now_ms);
    else on_chunk(env, std::move(std::get<msg::kv_chunk>(message)), now_ms);
  }
}

void decode_core::finish_recompute(int64_t now_ms) {
  const uint64_t id = in_flight_.front();
  const uint32_t n = recompute_in_flight_;
  in_flight_.clear();
  in_flight_output_ = {};
  recompute_in_flight_ = 0;
  counters_["recomputed_tokens"] += n;
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  sequence& s = it->second;
  if (s.cancelled) return end(s, s.cancel_reason, msg::error_code::none, "cancelled");
  if (s.deadline_ms > 0 && now_ms >= s.deadline_ms)
    return end(s, msg::finish_reason::timeout, msg::error_code::timeout, "deadline passed during decode");
  s.recomputed += n;
  if (s.recomputed + 1 < s.tokens.size()) return;
  s.state = decode_state::running;
  ++counters_["resumed"];
}

void decode_core::send_first_tokens(const std::vector<uint64_t>& ids) {
  std::map<std::string, msg::token_batch> batches;  // one message per destination
  for (uint64_t id : ids) {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || !it->second.first_unsent) continue;
    sequence& s = it->second;
    s.first_unsent = false;
    const msg::token_logprobs* logprobs = s.first_logprobs ? &*s.first_logprobs : nullptr;
    msg::token_batch_push(batches[s.client], s.request_id, s.tokens.at(s.prompt_len), 0, logprobs);
    s.first_logprobs.reset();
  }
  for (auto& [client, batch] : batches) out_.send(client, batch);
}

void decode_core::finish_decode(int64_t now_ms) {
  std::map<std::string, msg::token_batch> batches;  // one message per destination
  std::vector<uint64_t> ended;
  const auto& eos = engine_.info().eos_ids;
  for (std::size_t i = 0; i < in_flight_.size(); ++i) {
    auto it = seqs_.find(in_flight_[i]);
    if (it == seqs_.end()) continue;
    sequence& s = it->second;
    const int32_t token = in_flight_output_.tokens.at(i);
    s.tokens.push_back(token);
    ++s.generated;
    msg::token_batch_push(batches[s.client], s.request_id, token, s.generated - 1, in_flight_output_.logprobs_at(i));
    const bool stop_token = !s.sampling.ignore_eos &&
                            (std::find(eos.begin(), eos.end(), token) != eos.end() ||
                             std::find(s.sampling.stop_token_ids.begin(), s.sampling.stop_token_ids.end(), token) !=
                                 s.sampling.stop_token_ids.end());
    if (s.cancelled) ended.push_back(s.seq_id);
    else if (stop_token || s.generated >= s.sampling.max_new_tokens ||
             s.tokens.size() >= engine_.info().max_context || (s.deadline_ms > 0 && now_ms >= s.deadline_ms)) {
      ended.push_back(s.seq_id);
    }
  }
  counters_["tokens"] += in_flight_.size();
  for (auto& [client, batch] : batches) out_.send(client, batch);
  in_flight_.clear();
  in_flight_output_ = {};
  for (uint64_t id : ended) {
    sequence& s = seqs_.at(id);
    if (s.cancelled) {
      end(s, s.cancel_reason, msg::error_code::none, "cancelled");
      continue;
    }
    const int32_t last = s.tokens.back();
    const bool stopped = !s.sampling.ignore_eos &&
                         (std::find(eos.begin(), eos.end(), last) != eos.end() ||
                          std::find(s.sampling.stop_token_ids.begin(), s.sampling.stop_token_ids.end(), last) !=
                              s.sampling.stop_token_ids.end());
    if (stopped) end(s, msg::finish_reason::stop, msg::error_code::none, {});
    else if (s.generated >= s.sampling.max_new_tokens || s.tokens.size() >= engine_.info().max_context)
      end(s, msg::finish_reason::length, msg::error_code::none, {});
    else end(s, msg::finish_reason::timeout, msg::error_code::timeout, "deadline passed during decode");
  }
}

void decode_core::tick(int64_t now_ms) {
  std::vector<uint64_t> expired;
  for (auto& [id, s] : seqs_) {
    // Until the confirm the broker holds the handle: renew its lease, bound the wait.
    const bool handle_pending = s.state < decode_state::preempted;
    if (handle_pending && now_ms >= s.next_renew_ms) {
      out_.send(settings_.broker, msg::kv_renew{s.handle_id});
      s.next_renew_ms = now_ms + settings_.renew_every_ms;
    }
    if (computing(id)) continue;
    const bool deadline = s.deadline_ms > 0 && now_ms >= s.deadline_ms;
    const bool waited_too_long = handle_pending && now_ms >= s.wait_until_ms;
    if (deadline || waited_too_long) expired.push_back(id);
  }
  for (uint64_t id : expired) {
    sequence& s = seqs_.at(id);
    if (s.state == decode_state::waiting_memory) {
      out_.send(settings_.broker, msg::kv_nack{s.handle_id, "no KV memory free in time"});
      ++counters_["memory_timeouts"];
      end(s, msg::finish_reason::error, msg::error_code::overloaded, "decode workers had no KV memory free in time");
    } else if (s.state == decode_state::pulling) {
      out_.send(settings_.broker, msg::kv_nack{s.handle_id, "KV did not arrive in time"});
      ++counters_["transfer_timeouts"];
      end(s, msg::finish_reason::timeout, msg::error_code::timeout, "KV transfer did not finish in time");
    } else {
      ++counters_["deadline_expired"];
      end(s, msg::finish_reason::timeout, msg::error_code::timeout, "deadline passed during decode");
    }
  }
  for (auto it = early_.begin(); it != early_.end();) {
    if (now_ms < it->second.wait_until_ms) {
      ++it;
      continue;
    }
    ++counters_["early_expired"];  // streamed ahead for a request that never came (it ended at prefill)
    pool_.free(it->second.blocks);
    it = early_.erase(it);
  }
  // Blocks freed outside a step (cancel, failed transfer, expiry) admit waiting adoptions here;
  // when nothing runs, no finish_step would ever do it.
  try_admit_waiting(now_ms);
}

void decode_core::end(sequence& s, msg::finish_reason reason, msg::error_code code, const std::string& message) {
  const uint64_t id = s.seq_id;
  send_first_tokens({id});  // the client gets what it would have had from the router, then the finish
  msg::finish f;
  f.request_id = s.request_id;
  f.reason = reason;
  f.code = code;
  f.message = message;
  f.prompt_tokens = s.prompt_len;
  f.completion_tokens = s.generated;
  out_.send(s.client, f);
  out_.send(settings_.router, msg::request_done{id, reason, s.generated});
  pool_.free(s.blocks);
  if (engine_busy()) deferred_releases_.push_back(id);  // the engine is computing on another thread
  else engine_.release(id);
  std::erase(waiting_, id);
  std::erase(preempted_, id);
  std::erase(running_, id);
  seqs_.erase(id);
  ++counters_[std::string("finished_") + std::string(msg::to_string(reason))];
}

msg::load_report decode_core::load() const {
  msg::load_report r;
  r.actor = out_.self();
  // A preempted sequence holds no KV and waits for memory, as a new adoption does.
  r.queued = static_cast<uint32_t>(waiting_.size() + preempted_.size());
  r.running = static_cast<uint32_t>(seqs_.size() - r.queued);
  r.free_blocks = pool_.free_blocks();
  r.total_blocks = pool_.total_blocks();
  return r;
}

}  // namespace duet
