#pragma once
// `duet bench engine`: one engine's prefill and decode speed through the engine interface
// (docs/benchmarks.md, "Engine benchmark"), whatever runs the math (cpu or cuda).
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine.hpp"

namespace duet {

/// Sequences of one prefill step that share a shape: `sequences` chunks of `tokens` tokens, each
/// after `prior` tokens of its prompt already in KV (a later chunk of a long prompt).
struct prefill_mix_part {
  uint32_t sequences = 1, tokens = 0, prior = 0;
};

/// One prefill step as a serving run composes it: several prompts' chunks in one engine call.
/// Written "NxT[@P]" joined by '+': "4x256" is four 256-token prompts, "1x1024@3072" a
/// 1,024-token chunk after 3,072 tokens of its prompt, "1x512@1536+2x256" both kinds at once.
struct prefill_mix {
  std::string label;
  std::vector<prefill_mix_part> parts;
  [[nodiscard]] uint32_t sequences() const;
  [[nodiscard]] uint64_t tokens() const;
  /// (query, key) pairs of the step's causal attention: each chunk attends to its prior and to
  /// itself up to each row.
  [[nodiscard]] double attention_pairs() const;
};

/// Parses one mix ("NxT[@P]+..."); throws std::invalid_argument with the part it cannot read.
[[nodiscard]] prefill_mix parse_prefill_mix(const std::string& text);

struct engine_bench_options {
  std::vector<uint32_t> prefill_tokens{2048};  // one sequence of each length
  std::vector<prefill_mix> prefill_mixes;      // steps of several chunks, after their priors
  std::vector<uint32_t> batches{1, 8};         // decode batch sizes ...
  std::vector<uint32_t> contexts{1024};        // ... at each context length (tokens of KV)
  uint32_t steps = 20;                         // timed decode steps per row
  uint32_t warmup = 3;                         // untimed decode steps first (graphs, plans)
  uint32_t prefill_repeats = 3;                // timed prefills per length (after one untimed)
  uint64_t seed = 1;                           // prompt token ids
  /// Two sequences with the same tokens may pick different ones where both sequences' top-2
  /// log-probability margin is at most this (nats): rounding noise, not a fault.
  double tie_margin = 0.05;
  /// Mix rows: a chunk's token may differ from its whole prompt's where each call ranks the
  /// other's token within this of its best (nats, top 5). The two calls run passes of other
  /// shapes, so other GEMM algorithms, whose bf16 rounding a random-weight model of this depth
  /// amplifies: the same token's log-probability moved by up to 0.12 between them on the H200.
  double mix_tie_margin = 0.3;
};

/// One measured row: wall-clock milliseconds of each engine call.
struct engine_bench_row {
  std::string kind;       // "prefill" | "prefill_mix" | "decode"
  uint32_t batch = 1;     // sequences per call
  uint32_t tokens = 0;    // prefill: prompt tokens (a mix: the step's); decode: context tokens per sequence
  std::string mix;        // prefill_mix: its label
  double attention_pairs = 0;  // prefill_mix: (query, key) pairs of its attention
  double ms_median = 0, ms_p10 = 0, ms_p90 = 0;
  double tokens_per_s = 0;  // prefill: prompt tokens / median; decode: batch / median
  /// Decode rows: every sequence of the batch starts from the same KV and tokens, so greedy
  /// decoding must give each the same tokens, except where rounding that differs between rows of
  /// one batch (GEMM tiles) swaps two near-tied candidates: judged on an untimed checking pass
  /// that asks for the top-2 log-probabilities (docs/benchmarks.md, "Engine benchmark"). False
  /// means the engine or the block copies disagree; `disagreement` says where. Mix rows: the
  /// token each chunk sampled after its prior must be the one a prefill of its whole prompt
  /// samples, or a near tie within mix_tie_margin (counted in near_tie_divergences).
  bool sequences_agree = true;
  std::string disagreement;
  /// Sequences that left sequence 0's tokens on a near-tie swap, and the first step (counting
  /// warm-up steps) where one did (-1: none).
  uint32_t near_tie_divergences = 0;
  int first_divergence_step = -1;
  /// Largest |difference| of the chosen token's log-probability between sequence 0 and a
  /// sequence with the same tokens so far (rounding between rows; -1 when the engine gives no
  /// log-probabilities), and the largest top-2 margin of a near-tie swap.
  double logprob_spread = -1;
  double swap_margin = 0;
};

/// A batch of sequences decoded greedily from the same KV and tokens: each step's tokens and, where
/// the engine gives them, their top-2 log-probabilities ([step][sequence]; an empty step: none).
struct decode_check {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<std::optional<msg::token_logprobs>>> logprobs;
};

/// Sets row's agreement fields from `c`: every sequence keeps sequence 0's tokens until a near-tie
/// swap (both sequences' top two swapped, each margin within `tie_margin`) takes it off them; it is
/// not compared after that, since its inputs differ.
void judge_decode_agreement(const decode_check& c, double tie_margin, engine_bench_row& row);

/// KV blocks an engine needs for every row of `o` (the largest row, plus one spare sequence).
[[nodiscard]] uint32_t engine_bench_blocks(const engine_bench_options& o, uint32_t block_tokens);

/// Runs every row on `e` (its pool must hold engine_bench_blocks blocks). `progress` gets a line
/// per row as it starts (nullptr: quiet). Throws std::invalid_argument for rows the engine cannot
/// run (a context beyond its max_context, a batch of 0).
[[nodiscard]] std::vector<engine_bench_row> run_engine_bench(
    engine& e, const engine_bench_options& o, const std::function<void(const std::string&)>& progress);

[[nodiscard]] nlohmann::json to_json(const engine_bench_row& row);

}  // namespace duet
