#include "runtime/engine_bench.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>

namespace duet {

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

/// A call's time: what an engine that models its steps (the sim engine) says it would take,
/// else the wall time since t0.
double call_ms(clock_type::time_point t0, const step_output& out) {
  if (out.modeled.count() > 0) return std::chrono::duration<double, std::milli>(out.modeled).count();
  return ms_since(t0);
}

void summarize(std::vector<double> ms, engine_bench_row& row) {
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) { return ms[static_cast<std::size_t>(q * static_cast<double>(ms.size() - 1) + 0.5)]; };
  row.ms_median = at(0.5);
  row.ms_p10 = at(0.1);
  row.ms_p90 = at(0.9);
}

std::vector<int32_t> random_prompt(uint32_t n, uint32_t vocab, std::mt19937_64& rng) {
  // Ids from the low half of the vocabulary: ordinary tokens, not the specials at its end.
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(std::max<uint32_t>(vocab / 2, 2) - 1));
  std::vector<int32_t> out(n);
  for (auto& t : out) t = id(rng);
  return out;
}

std::vector<uint32_t> block_range(uint32_t first, uint32_t count) {
  std::vector<uint32_t> out(count);
  std::iota(out.begin(), out.end(), first);
  return out;
}

uint32_t blocks_for(uint64_t tokens, uint32_t block_tokens) {
  return static_cast<uint32_t>((tokens + block_tokens - 1) / block_tokens);
}

engine_bench_row bench_prefill(engine& e, uint32_t tokens, const engine_bench_options& o, std::mt19937_64& rng) {
  const auto prompt = random_prompt(tokens, e.info().vocab_size, rng);
  const auto blocks = block_range(0, blocks_for(tokens, e.info().block_tokens));
  msg::sampling_params greedy;
  greedy.temperature = 0;
  std::vector<double> ms;
  for (uint32_t r = 0; r <= o.prefill_repeats; ++r) {
    prefill_chunk chunk{1000 + r, prompt, 0, blocks, true, &greedy};
    const auto t0 = clock_type::now();
    const auto out = e.prefill(std::span(&chunk, 1));
    const double took = call_ms(t0, out);
    e.release(chunk.seq_id);
    if (out.tokens.size() != 1) throw std::runtime_error("bench engine: prefill returned no token");
    if (r > 0) ms.push_back(took);  // the first call pays for plans and allocations
  }
  engine_bench_row row;
  row.kind = "prefill";
  row.tokens = tokens;
  summarize(std::move(ms), row);
  row.tokens_per_s = tokens / row.ms_median * 1e3;
  return row;
}

/// Greedy decode steps over a batch from given histories (copied: a pass leaves them unchanged).
/// The engine keeps no state per step beyond the KV it appends, and a step at position p
/// overwrites what an earlier pass appended there, so passes can repeat from the same start.
struct decode_pass {
  decode_check check;
  std::vector<double> ms;  // each step's wall time
};

decode_pass run_decode_pass(engine& e, std::vector<std::vector<int32_t>> history,
                            const std::vector<std::vector<uint32_t>>& blocks, uint32_t steps,
                            const msg::sampling_params& sampling) {
  const auto batch = static_cast<uint32_t>(history.size());
  decode_pass pass;
  for (uint32_t step = 0; step < steps; ++step) {
    std::vector<decode_slot> slots;
    for (uint32_t b = 0; b < batch; ++b) slots.push_back({100 + b, history[b], blocks[b], &sampling});
    const auto t0 = clock_type::now();
    auto out = e.decode(slots);
    pass.ms.push_back(call_ms(t0, out));
    if (out.tokens.size() != batch) throw std::runtime_error("bench engine: decode returned a wrong token count");
    for (uint32_t b = 0; b < batch; ++b) history[b].push_back(out.tokens[b]);
    pass.check.tokens.push_back(std::move(out.tokens));
    pass.check.logprobs.push_back(std::move(out.logprobs));
  }
  return pass;
}

const msg::token_logprobs* logprobs_of(const decode_check& c, std::size_t step, std::size_t b) {
  if (step >= c.logprobs.size() || b >= c.logprobs[step].size() || !c.logprobs[step][b]) return nullptr;
  return &*c.logprobs[step][b];
}

/// True when a's top two are (x, y) and b's are (y, x), each with a margin within `tie`.
bool near_tie_swap(const msg::token_logprobs& a, const msg::token_logprobs& b, double tie, double& margin) {
  if (a.top_ids.size() < 2 || b.top_ids.size() < 2) return false;
  if (a.top_ids[0] != b.top_ids[1] || a.top_ids[1] != b.top_ids[0]) return false;
  margin = std::max(a.top_logprobs[0] - a.top_logprobs[1], b.top_logprobs[0] - b.top_logprobs[1]);
  return margin <= tie;
}

/// One sequence of a mix row: its whole prompt, its blocks and where its timed chunk starts.
struct mix_sequence {
  std::vector<int32_t> prompt;
  std::vector<uint32_t> blocks;
  uint32_t prior = 0;
  std::string part;  // the part it belongs to, for messages
};

std::string part_label(const prefill_mix_part& p) {
  return std::to_string(p.sequences) + "x" + std::to_string(p.tokens) +
         (p.prior > 0 ? "@" + std::to_string(p.prior) : "");
}

std::vector<mix_sequence> mix_sequences(const prefill_mix& mix, uint32_t vocab, uint32_t block_tokens,
                                        std::mt19937_64& rng) {
  std::vector<mix_sequence> out;
  uint32_t next_block = 0;
  for (const auto& part : mix.parts) {
    for (uint32_t i = 0; i < part.sequences; ++i) {
      mix_sequence s;
      s.prompt = random_prompt(part.prior + part.tokens, vocab, rng);
      s.blocks = block_range(next_block, blocks_for(s.prompt.size(), block_tokens));
      next_block += static_cast<uint32_t>(s.blocks.size());
      s.prior = part.prior;
      s.part = part_label(part);
      out.push_back(std::move(s));
    }
  }
  return out;
}

/// The gap from `lp`'s best log-probability to `token`'s, when `token` is among its top
/// candidates (-1 otherwise, or without `lp`).
double gap_to_best(const msg::token_logprobs* lp, int32_t token) {
  if (!lp) return -1;
  for (std::size_t k = 0; k < lp->top_ids.size() && k < lp->top_logprobs.size(); ++k) {
    if (lp->top_ids[k] == token) return lp->top_logprobs[0] - lp->top_logprobs[k];
  }
  return -1;
}

/// Compares each chunk's sampled token (after its prior) with a prefill of its whole prompt. A
/// different token passes as a near tie when each call ranks the other's token within `tie`
/// of its own best.
void judge_mix_tokens(engine& e, const std::vector<mix_sequence>& seqs, const step_output& chunked,
                      uint64_t first_id, const msg::sampling_params& checking, double tie, engine_bench_row& row) {
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    prefill_chunk whole{first_id + i, seqs[i].prompt, 0, seqs[i].blocks, true, &checking};
    const auto ref = e.prefill(std::span(&whole, 1));
    if (ref.tokens.size() != 1) throw std::runtime_error("bench engine: prefill returned no token");
    const msg::token_logprobs* a = i < chunked.logprobs.size() && chunked.logprobs[i] ? &*chunked.logprobs[i] : nullptr;
    const msg::token_logprobs* b = !ref.logprobs.empty() && ref.logprobs[0] ? &*ref.logprobs[0] : nullptr;
    if (chunked.tokens[i] == ref.tokens[0]) {
      if (a && b) row.logprob_spread = std::max(row.logprob_spread, static_cast<double>(std::abs(a->logprob - b->logprob)));
      continue;
    }
    const double gap_in_ref = gap_to_best(b, chunked.tokens[i]);
    const double gap_in_chunk = gap_to_best(a, ref.tokens[0]);
    if (gap_in_ref >= 0 && gap_in_chunk >= 0 && gap_in_ref <= tie && gap_in_chunk <= tie) {
      row.swap_margin = std::max({row.swap_margin, gap_in_ref, gap_in_chunk});
      ++row.near_tie_divergences;
      continue;
    }
    if (!row.sequences_agree) continue;
    const auto gap = [](double g) { return g >= 0 ? std::to_string(g) + " nats below" : std::string("not in the top 5 of"); };
    row.sequences_agree = false;
    row.disagreement = "sequence " + std::to_string(i) + " (" + seqs[i].part + "): its chunk chose token " +
                       std::to_string(chunked.tokens[i]) + " (" + gap(gap_in_ref) + " the whole prompt's best), its whole prompt token " +
                       std::to_string(ref.tokens[0]) + " (" + gap(gap_in_chunk) + " the chunk's best)";
  }
}

/// One prefill step of several chunks, each after its prior (prefilled untimed first, as
/// earlier steps of a serving run leave it); the first call, untimed, asks for top-5
/// log-probabilities to judge the chunks' tokens against whole-prompt prefills afterwards.
engine_bench_row bench_prefill_mix(engine& e, const prefill_mix& mix, const engine_bench_options& o,
                                   std::mt19937_64& rng) {
  const auto seqs = mix_sequences(mix, e.info().vocab_size, e.info().block_tokens, rng);
  constexpr uint64_t first_id = 2000;
  msg::sampling_params greedy;
  greedy.temperature = 0;
  msg::sampling_params checking = greedy;
  checking.top_logprobs = 5;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i].prior == 0) continue;
    prefill_chunk head{first_id + i, std::span(seqs[i].prompt).first(seqs[i].prior), 0, seqs[i].blocks, false, &greedy};
    (void)e.prefill(std::span(&head, 1));
  }
  std::vector<double> ms;
  step_output checked;
  for (uint32_t r = 0; r <= o.prefill_repeats; ++r) {
    std::vector<prefill_chunk> chunks;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      chunks.push_back({first_id + i, std::span(seqs[i].prompt).subspan(seqs[i].prior), seqs[i].prior,
                        seqs[i].blocks, true, r == 0 ? &checking : &greedy});
    }
    const auto t0 = clock_type::now();
    auto out = e.prefill(chunks);
    const double took = call_ms(t0, out);
    if (out.tokens.size() != seqs.size()) throw std::runtime_error("bench engine: a mix step returned a wrong token count");
    if (r == 0) {
      checked = std::move(out);
    } else {
      ms.push_back(took);
    }
  }
  engine_bench_row row;
  row.kind = "prefill_mix";
  row.mix = mix.label;
  row.batch = mix.sequences();
  row.tokens = static_cast<uint32_t>(mix.tokens());
  row.attention_pairs = mix.attention_pairs();
  summarize(std::move(ms), row);
  row.tokens_per_s = static_cast<double>(row.tokens) / row.ms_median * 1e3;
  judge_mix_tokens(e, seqs, checked, first_id, checking, o.mix_tie_margin, row);
  for (std::size_t i = 0; i < seqs.size(); ++i) e.release(first_id + i);
  return row;
}

/// `batch` sequences of `context` tokens: one is prefilled, the others get copies of its KV
/// blocks (read_blocks/write_blocks), so only one prefill is paid per row. An untimed checking
/// pass with top-2 log-probabilities judges agreement; the timed pass must repeat its tokens.
engine_bench_row bench_decode(engine& e, uint32_t batch, uint32_t context, const engine_bench_options& o,
                              std::mt19937_64& rng) {
  const uint32_t bt = e.info().block_tokens;
  const uint32_t per_seq = blocks_for(uint64_t{context} + o.warmup + o.steps + 1, bt);
  msg::sampling_params greedy;
  greedy.temperature = 0;
  std::vector<std::vector<int32_t>> history(batch, random_prompt(context, e.info().vocab_size, rng));
  std::vector<std::vector<uint32_t>> blocks(batch);
  for (uint32_t b = 0; b < batch; ++b) blocks[b] = block_range(b * per_seq, per_seq);
  const uint32_t prompt_blocks = blocks_for(context, bt);
  prefill_chunk chunk{1, std::span<const int32_t>(history[0]), 0, blocks[0], true, &greedy};
  const auto first = e.prefill(std::span(&chunk, 1));
  if (first.tokens.size() != 1) throw std::runtime_error("bench engine: prefill returned no token");
  // The sim engine holds no KV bytes: its steps cost what the sequences' lengths say.
  if (batch > 1 && e.info().engine != "sim") {
    std::vector<std::byte> kv(static_cast<std::size_t>(e.info().block_bytes) * prompt_blocks);
    const std::span<const uint32_t> src(blocks[0].data(), prompt_blocks);
    if (!e.read_blocks(src, kv)) throw std::runtime_error("bench engine: this engine cannot copy KV blocks");
    for (uint32_t b = 1; b < batch; ++b) {
      if (!e.write_blocks(std::span<const uint32_t>(blocks[b].data(), prompt_blocks), kv))
        throw std::runtime_error("bench engine: writing KV blocks failed");
    }
  }
  for (auto& h : history) h.push_back(first.tokens[0]);
  const uint32_t steps = o.warmup + o.steps;
  msg::sampling_params checking = greedy;
  checking.top_logprobs = 2;
  const decode_pass check = run_decode_pass(e, history, blocks, steps, checking);
  const decode_pass timed = run_decode_pass(e, history, blocks, steps, greedy);
  e.release(1);
  for (uint32_t b = 0; b < batch; ++b) e.release(100 + b);
  engine_bench_row row;
  row.kind = "decode";
  row.batch = batch;
  row.tokens = context;
  summarize(std::vector<double>(timed.ms.begin() + o.warmup, timed.ms.end()), row);
  row.tokens_per_s = batch / row.ms_median * 1e3;
  judge_decode_agreement(check.check, o.tie_margin, row);
  for (uint32_t step = 0; step < steps && row.sequences_agree; ++step) {
    if (timed.check.tokens[step] == check.check.tokens[step]) continue;
    row.sequences_agree = false;
    row.disagreement = "step " + std::to_string(step) + ": the timed pass did not repeat the checking pass's tokens";
  }
  return row;
}

}  // namespace

uint32_t prefill_mix::sequences() const {
  uint32_t n = 0;
  for (const auto& p : parts) n += p.sequences;
  return n;
}

uint64_t prefill_mix::tokens() const {
  uint64_t n = 0;
  for (const auto& p : parts) n += uint64_t{p.sequences} * p.tokens;
  return n;
}

double prefill_mix::attention_pairs() const {
  double pairs = 0;
  for (const auto& p : parts) {
    const double t = p.tokens;
    pairs += p.sequences * (t * p.prior + t * (t + 1) / 2.0);
  }
  return pairs;
}

prefill_mix parse_prefill_mix(const std::string& text) {
  const auto fail = [&](const std::string& part) {
    return std::invalid_argument("prefill mix '" + text + "': cannot read '" + part +
                                 "' (want NxT or NxT@P joined by '+', e.g. 4x256 or 1x1024@3072+2x256)");
  };
  const auto number = [&](std::string_view digits, const std::string& part) {
    uint32_t v = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
    if (digits.empty() || ec != std::errc{} || end != digits.data() + digits.size()) throw fail(part);
    return v;
  };
  prefill_mix mix;
  mix.label = text;
  std::string_view rest = text;
  while (true) {
    const auto plus = rest.find('+');
    const std::string part(rest.substr(0, plus));
    const auto x = part.find('x');
    const auto at = part.find('@');
    if (x == std::string::npos || (at != std::string::npos && at < x)) throw fail(part);
    prefill_mix_part p;
    p.sequences = number(std::string_view(part).substr(0, x), part);
    p.tokens = number(std::string_view(part).substr(x + 1, at == std::string::npos ? std::string::npos : at - x - 1), part);
    if (at != std::string::npos) p.prior = number(std::string_view(part).substr(at + 1), part);
    if (p.sequences == 0 || p.tokens == 0) throw fail(part);
    mix.parts.push_back(p);
    if (plus == std::string_view::npos) break;
    rest.remove_prefix(plus + 1);
  }
  return mix;
}

void judge_decode_agreement(const decode_check& p, double tie, engine_bench_row& row) {
  const auto batch = static_cast<uint32_t>(p.tokens.empty() ? 0 : p.tokens[0].size());
  std::vector<bool> same(batch, true);
  for (uint32_t step = 0; step < p.tokens.size(); ++step) {
    const msg::token_logprobs* first = logprobs_of(p, step, 0);
    for (uint32_t b = 1; b < batch; ++b) {
      if (!same[b]) continue;
      const msg::token_logprobs* other = logprobs_of(p, step, b);
      if (first && other && p.tokens[step][b] == p.tokens[step][0]) {
        row.logprob_spread = std::max(row.logprob_spread, static_cast<double>(std::abs(other->logprob - first->logprob)));
        continue;
      }
      if (p.tokens[step][b] == p.tokens[step][0]) continue;
      double margin = 0;
      if (first && other && near_tie_swap(*first, *other, tie, margin)) {
        same[b] = false;
        row.swap_margin = std::max(row.swap_margin, margin);
        ++row.near_tie_divergences;
        if (row.first_divergence_step < 0) row.first_divergence_step = static_cast<int>(step);
        continue;
      }
      row.sequences_agree = false;
      row.disagreement = "step " + std::to_string(step) + ": sequence " + std::to_string(b) + " chose token " +
                         std::to_string(p.tokens[step][b]) + ", sequence 0 token " +
                         std::to_string(p.tokens[step][0]) +
                         (first && other ? ", not a near-tie swap of their top two" : " (no log-probabilities to judge)");
      return;
    }
  }
}

uint32_t engine_bench_blocks(const engine_bench_options& o, uint32_t block_tokens) {
  uint64_t need = 0;
  for (uint32_t t : o.prefill_tokens) need = std::max<uint64_t>(need, blocks_for(t, block_tokens));
  for (const auto& mix : o.prefill_mixes) {
    uint64_t blocks = 0;
    for (const auto& p : mix.parts) blocks += uint64_t{p.sequences} * blocks_for(uint64_t{p.prior} + p.tokens, block_tokens);
    need = std::max(need, blocks);
  }
  const uint32_t max_batch = o.batches.empty() ? 0 : *std::max_element(o.batches.begin(), o.batches.end());
  for (uint32_t c : o.contexts) {
    need = std::max<uint64_t>(need, uint64_t{max_batch} * blocks_for(uint64_t{c} + o.warmup + o.steps + 1, block_tokens));
  }
  return static_cast<uint32_t>(need + 1);
}

std::vector<engine_bench_row> run_engine_bench(engine& e, const engine_bench_options& o,
                                               const std::function<void(const std::string&)>& progress) {
  const uint32_t max_context = e.info().max_context;
  for (uint32_t t : o.prefill_tokens) {
    if (t == 0 || t > max_context)
      throw std::invalid_argument("prefill length " + std::to_string(t) + " is not in 1.." + std::to_string(max_context));
  }
  for (const auto& mix : o.prefill_mixes) {
    for (const auto& p : mix.parts) {
      if (p.sequences == 0 || p.tokens == 0 || uint64_t{p.prior} + p.tokens > max_context)
        throw std::invalid_argument("prefill mix " + mix.label + ": part " + part_label(p) + " is empty or exceeds max_context " +
                                    std::to_string(max_context));
    }
  }
  for (uint32_t c : o.contexts) {
    if (c == 0 || uint64_t{c} + o.warmup + o.steps + 1 > max_context)
      throw std::invalid_argument("context " + std::to_string(c) + " plus the decode steps exceeds max_context " +
                                  std::to_string(max_context));
  }
  for (uint32_t b : o.batches) {
    if (b == 0) throw std::invalid_argument("a decode batch must be at least 1");
  }
  if (o.steps == 0) throw std::invalid_argument("--steps must be at least 1");
  std::mt19937_64 rng(o.seed);
  std::vector<engine_bench_row> rows;
  for (uint32_t t : o.prefill_tokens) {
    if (progress) progress("prefill " + std::to_string(t) + " tokens");
    rows.push_back(bench_prefill(e, t, o, rng));
  }
  for (const auto& mix : o.prefill_mixes) {
    if (progress) progress("prefill mix " + mix.label);
    rows.push_back(bench_prefill_mix(e, mix, o, rng));
  }
  for (uint32_t c : o.contexts) {
    for (uint32_t b : o.batches) {
      if (progress) progress("decode batch " + std::to_string(b) + ", context " + std::to_string(c));
      rows.push_back(bench_decode(e, b, c, o, rng));
    }
  }
  return rows;
}

nlohmann::json to_json(const engine_bench_row& row) {
  nlohmann::json j{{"kind", row.kind},           {"batch", row.batch},   {"tokens", row.tokens},
                   {"ms_median", row.ms_median}, {"ms_p10", row.ms_p10}, {"ms_p90", row.ms_p90},
                   {"tokens_per_s", row.tokens_per_s}};
  if (row.kind == "prefill_mix") {
    j["mix"] = row.mix;
    j["attention_pairs"] = row.attention_pairs;
  }
  if (row.kind != "prefill") {
    j["sequences_agree"] = row.sequences_agree;
    if (!row.sequences_agree) j["disagreement"] = row.disagreement;
    j["near_tie_divergences"] = row.near_tie_divergences;
    j["first_divergence_step"] = row.first_divergence_step;
    j["swap_margin"] = row.swap_margin;
    if (row.logprob_spread >= 0) j["logprob_spread"] = row.logprob_spread;
  }
  return j;
}

}  // namespace duet
