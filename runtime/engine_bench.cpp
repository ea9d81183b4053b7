#include "runtime/engine_bench.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>
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

/// `batch` sequences of `context` tokens: one is prefilled, the others get copies of its KV
/// blocks (read_blocks/write_blocks), so only one prefill is paid per row.
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
  std::vector<double> ms;
  bool agree = true;
  for (uint32_t step = 0; step < o.warmup + o.steps; ++step) {
    std::vector<decode_slot> slots;
    for (uint32_t b = 0; b < batch; ++b) slots.push_back({100 + b, history[b], blocks[b], &greedy});
    const auto t0 = clock_type::now();
    const auto out = e.decode(slots);
    const double took = ms_since(t0);
    if (out.tokens.size() != batch) throw std::runtime_error("bench engine: decode returned a wrong token count");
    for (uint32_t b = 0; b < batch; ++b) {
      agree = agree && out.tokens[b] == out.tokens[0];
      history[b].push_back(out.tokens[b]);
    }
    if (step >= o.warmup) ms.push_back(took);
  }
  e.release(1);
  for (uint32_t b = 0; b < batch; ++b) e.release(100 + b);
  engine_bench_row row;
  row.kind = "decode";
  row.batch = batch;
  row.tokens = context;
  summarize(std::move(ms), row);
  row.tokens_per_s = batch / row.ms_median * 1e3;
  row.sequences_agree = agree;
  return row;
}

}  // namespace

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
  if (row.kind == "decode") j["sequences_agree"] = row.sequences_agree;
  return j;
}

}  // namespace duet
