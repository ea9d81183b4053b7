#include "runtime/engine_bench.hpp"

#include <algorithm>
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
    const double took = ms_since(t0);
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
    pass.ms.push_back(ms_since(t0));
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
  if (batch > 1) {
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
  if (row.kind == "decode") {
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
