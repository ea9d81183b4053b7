#pragma once
// y = x . w^T (+ bias): bf16 operands, fp32 accumulation, bf16 or fp32 output. Weights are
// row-major [n, k] as Hugging Face stores them. Large m goes through cuBLASLt (algorithm picked
// per plan bucket of rows, gemm_plan_rows: for decode buckets and m a multiple of 64 the
// candidates are timed on first use outside graph capture, those of up to 256 rows with their
// weight out of L2, as in a decode step; other m run their bucket's algorithm); m <=
// gemm_skinny_max_rows can use a bandwidth-bound kernel of our own (picked for m = 1), which may
// also apply SwiGLU to its input on the fly (x = silu_mul(gate_up), silu_mul.cuh).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/kernel_status.hpp"

namespace duet::kernels {

inline constexpr uint32_t gemm_skinny_max_rows = 4;

/// Whether the automatic path may pick the skinny kernel for m = 1 (DUET_GEMM_SKINNY=0 turns it
/// off).
[[nodiscard]] bool gemm_skinny_enabled();

struct gemm_params {
  const uint16_t* x =
      nullptr;       // [m, ldx] bf16 (with x_swiglu: [m, ldx] holding gate | up, 2k wide)
  uint32_t ldx = 0;  // elements between rows of x
  const uint16_t* w = nullptr;     // [n, k] bf16, row-major
  const uint16_t* bias = nullptr;  // [n] bf16 or nullptr
  void* y = nullptr;               // [m, ldy] bf16, or fp32 when y_fp32
  uint32_t ldy = 0;
  uint32_t m = 0, n = 0, k = 0;
  bool y_fp32 = false;
  bool x_swiglu =
      false;  // skinny path only: x[r][i] = bf16(bf16(silu(gate[r][i])) * up[r][i]); best at m = 1
  // w is never written by kernels queued earlier on the stream (model weights): the skinny path
  // then loads its first weight chunks before waiting for the previous kernel (PDL), so a GEMV's
  // weight stream starts while the kernel before it finishes.
  bool w_static = false;
  // y += x . w^T: cuBLASLt's beta = 1 with y as C and D (in place), so a residual add costs the
  // GEMM one read of y instead of a kernel that reads y and the product and writes y back.
  // cuBLASLt only (the automatic path picks it for any m); tuning writes its trial runs to a
  // scratch copy, so y is added to once.
  bool accumulate = false;
};

enum class gemm_path : uint8_t { automatic, cublaslt, skinny };

/// The rows of the cuBLASLt plan a GEMM of m rows runs (its algorithm; the layouts are m's own):
/// powers of two up to 32, multiples of 32 up to 256 (the decode buckets), then multiples of 64.
[[nodiscard]] inline uint32_t gemm_plan_rows(uint32_t m) {
  if (m <= 32) {
    uint32_t b = 1;
    while (b < m) b *= 2;
    return b;
  }
  const uint32_t step = m <= 256 ? 32 : 64;
  return (m + step - 1) / step * step;
}

/// Every plan bucket from 1 row up to `max_m` (the shapes an engine warms before serving). One
/// row is a pass too: a prompt one token past a chunk boundary ends with it, and its o and down
/// GEMMs accumulate, which the skinny kernel does not, so they meet cuBLASLt at m = 1.
[[nodiscard]] inline std::vector<uint32_t> gemm_plan_buckets(uint32_t max_m) {
  std::vector<uint32_t> out;
  for (uint32_t m = 1; m <= max_m; m = gemm_plan_rows(m + 1)) out.push_back(m);
  return out;
}

/// One cuBLASLt handle, its workspace and the per-shape plans; one per stream owner.
class gemm_runner {
 public:
  gemm_runner();
  ~gemm_runner();
  gemm_runner(const gemm_runner&) = delete;
  gemm_runner& operator=(const gemm_runner&) = delete;

  /// Creates the handle and a workspace on the current device.
  kstatus init(uint64_t workspace_bytes = 32ull << 20);
  /// automatic: skinny for m = 1 (unless disabled) or whenever x_swiglu, cuBLASLt otherwise;
  /// skinny takes m <= gemm_skinny_max_rows when asked for.
  kstatus run(const gemm_params& p, cudaStream_t stream, gemm_path path = gemm_path::automatic);
  /// The cuBLASLt algorithms tuning chooses among for this shape (the heuristic's): each must
  /// compute the same GEMM, which the tests check.
  [[nodiscard]] kstatus candidates(const gemm_params& p, std::size_t& count);
  kstatus run_candidate(const gemm_params& p, std::size_t index, cudaStream_t stream);

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// fp32 accumulation over the same bf16 inputs (output rounded to bf16 unless y_fp32).
void gemm_reference(const gemm_params& p);

/// One timed run of a shape's tuning: candidate algorithm `candidate`, its run `round`.
struct tuning_trial {
  uint32_t candidate;
  uint32_t round;
};

/// The order of a shape's timed runs. Interleaved: every candidate once per round, rounds
/// forward and backward by turns, so that a card heating up while it tunes weighs on every
/// candidate alike; otherwise each candidate's rounds in a row.
[[nodiscard]] inline std::vector<tuning_trial> tuning_trial_order(uint32_t candidates,
                                                                  uint32_t rounds,
                                                                  bool interleaved) {
  std::vector<tuning_trial> order;
  order.reserve(std::size_t{candidates} * rounds);
  if (interleaved) {
    for (uint32_t r = 0; r < rounds; ++r) {
      for (uint32_t j = 0; j < candidates; ++j)
        order.push_back({r % 2 == 0 ? j : candidates - 1 - j, r});
    }
  } else {
    for (uint32_t i = 0; i < candidates; ++i) {
      for (uint32_t r = 0; r < rounds; ++r) order.push_back({i, r});
    }
  }
  return order;
}

/// The time a candidate is judged by: the median of its runs when interleaved (one stalled run
/// does not decide), their mean otherwise (the rule before 2026-12-06). 0 for no runs.
[[nodiscard]] inline float tuning_trial_time(std::vector<float> runs, bool interleaved) {
  if (runs.empty()) return 0.0f;
  if (interleaved) {
    const auto middle = runs.begin() + static_cast<std::ptrdiff_t>(runs.size() / 2);
    std::nth_element(runs.begin(), middle, runs.end());
    return *middle;
  }
  float sum = 0.0f;
  for (const float t : runs) sum += t;
  return sum / static_cast<float>(runs.size());
}

}  // namespace duet::kernels
