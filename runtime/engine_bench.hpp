#pragma once
// `duet bench engine`: one engine's prefill and decode speed through the engine interface
// (docs/benchmarks.md, "Engine benchmark"), whatever runs the math (cpu or cuda).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/engine.hpp"

namespace duet {

struct engine_bench_options {
  std::vector<uint32_t> prefill_tokens{2048};  // one sequence of each length
  std::vector<uint32_t> batches{1, 8};         // decode batch sizes ...
  std::vector<uint32_t> contexts{1024};        // ... at each context length (tokens of KV)
  uint32_t steps = 20;                         // timed decode steps per row
  uint32_t warmup = 3;                         // untimed decode steps first (graphs, plans)
  uint32_t prefill_repeats = 3;                // timed prefills per length (after one untimed)
  uint64_t seed = 1;                           // prompt token ids
};

/// One measured row: wall-clock milliseconds of each engine call.
struct engine_bench_row {
  std::string kind;       // "prefill" | "decode"
  uint32_t batch = 1;     // sequences per call
  uint32_t tokens = 0;    // prefill: prompt tokens; decode: context tokens per sequence
  double ms_median = 0, ms_p10 = 0, ms_p90 = 0;
  double tokens_per_s = 0;  // prefill: prompt tokens / median; decode: batch / median
  /// Decode rows: every sequence of the batch has the same context, so greedy decoding must give
  /// each the same tokens; false means the engine or the block copies disagree.
  bool sequences_agree = true;
};

/// KV blocks an engine needs for every row of `o` (the largest row, plus one spare sequence).
[[nodiscard]] uint32_t engine_bench_blocks(const engine_bench_options& o, uint32_t block_tokens);

/// Runs every row on `e` (its pool must hold engine_bench_blocks blocks). `progress` gets a line
/// per row as it starts (nullptr: quiet). Throws std::invalid_argument for rows the engine cannot
/// run (a context beyond its max_context, a batch of 0).
[[nodiscard]] std::vector<engine_bench_row> run_engine_bench(
    engine& e, const engine_bench_options& o, const std::function<void(const std::string&)>& progress);

[[nodiscard]] nlohmann::json to_json(const engine_bench_row& row);

}  // namespace duet
