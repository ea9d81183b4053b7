#pragma once
// Token sampling on the GPU, one CTA per row of logits: greedy (argmax, lowest id on ties),
// or temperature with top-k, top-p and min-p filters and a seeded draw; the log-probability of
// the chosen token and the top-N log-probabilities under the raw distribution.
//
// Filters (Hugging Face's order and semantics): top-k keeps every token whose scaled logit is at
// least the k-th largest; top-p keeps the most likely tokens while the mass before them (among
// the top-k survivors) is under top_p, at least one; min-p keeps tokens whose probability is at
// least min_p times the top one. Each filter is a threshold on the scaled logit, found by a
// radix select over the logits' order-preserving bit patterns (the top-p one weighted by
// probability mass in 2^-24 fixed point), so no sort is needed; tokens tied at a threshold are
// kept together. The draw walks the kept tokens in id order until the cumulative weight passes
// uniform * total (the CPU sampler walks them sorted when a filter sorted them: the same
// distribution, a different map from the uniform number to a token).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_status.hpp"

namespace duet::kernels {

inline constexpr uint32_t sampling_max_top = 32;

/// One row's request; the host fills these.
struct sample_row {
  float temperature = 0.0f;   // <= 0: greedy
  float top_p = 1.0f;         // >= 1: off
  float min_p = 0.0f;         // <= 0: off
  int32_t top_k = 0;          // <= 0 or >= vocab: off
  uint32_t top_logprobs = 0;  // <= sampling_max_top and <= the params' max_top
  uint32_t pad = 0;
  double uniform = 0.0;  // the draw's uniform number in [0, 1)
};

struct sample_params {
  const float* logits = nullptr;  // [rows, ld] fp32
  uint32_t ld = 0;
  uint32_t rows = 0;
  uint32_t vocab = 0;
  const sample_row* requests = nullptr;  // [rows]
  int32_t* tokens = nullptr;             // [rows]
  float* logprobs = nullptr;             // [rows]: log_softmax(raw logits)[token]
  int32_t* top_ids =
      nullptr;  // [rows, max_top], most likely first (ties: lower id); may be null if max_top == 0
  float* top_logprobs = nullptr;  // [rows, max_top]
  uint32_t max_top = 0;
  // Optional workspace of sample_stats_bytes(rows, vocab): a first kernel of many CTAs reads each
  // row once for its maximum, first argmax and sum of exponentials, in sample_stat_splits(vocab)
  // pieces, instead of the row's one CTA reading it twice. Null: the one CTA does.
  void* stats = nullptr;
};

uint32_t sample_stat_splits(uint32_t vocab);
uint64_t sample_stats_bytes(uint32_t rows, uint32_t vocab);

kstatus sample_tokens(const sample_params& p, cudaStream_t stream);
/// The same semantics on the host (double where the kernel uses double, the same fixed point).
void sample_tokens_reference(const sample_params& p);

}  // namespace duet::kernels
