#pragma once
// The batch sizes a CUDA engine captures decode graphs for: a step of n sequences replays the
// graph of the smallest bucket >= n, its extra rows padded (docs/cuda-engine.md, "Decode graphs").
#include <cstdint>
#include <cstdlib>
#include <vector>

namespace duet {

/// Powers of two up to `step`, then every multiple of `step` up to `max_batch` (which is always
/// the last bucket). A step of 0 keeps powers of two only (duet's rule before 2026-12-03); the
/// padding then reaches up to half the batch (129 sequences run 256 rows).
[[nodiscard]] inline std::vector<uint32_t> decode_graph_buckets(uint32_t max_batch, uint32_t step) {
  std::vector<uint32_t> out;
  uint32_t b = 1;
  for (; b < max_batch && (step == 0 || b < step); b *= 2) out.push_back(b);
  if (step > 0) {
    for (b = step; b < max_batch; b += step) out.push_back(b);
  }
  if (max_batch > 0) out.push_back(max_batch);
  return out;
}

/// The rows of the graph a step of `batch` sequences replays: the smallest bucket that holds
/// it (`buckets` ascending), or the batch itself past the last one or with no buckets.
[[nodiscard]] inline uint32_t decode_graph_rows(const std::vector<uint32_t>& buckets, uint32_t batch) {
  for (const uint32_t b : buckets) {
    if (b >= batch) return b;
  }
  return batch;
}

/// The step the CUDA engine captures its decode graphs at: 32, or DUET_DECODE_BUCKET_STEP
/// (0: powers of two only). The simulator reads it too, so it prices a run as it ran.
[[nodiscard]] inline uint32_t decode_bucket_step_from_env() {
  const char* v = std::getenv("DUET_DECODE_BUCKET_STEP");
  return v ? static_cast<uint32_t>(std::atoi(v)) : 32u;
}

}  // namespace duet
