#pragma once
// Token sampling from a logits vector: penalties, greedy, temperature, top-k, top-p, min-p,
// seeded randomness that depends only on (seed, position), and log-probabilities.
//
// Order (Hugging Face's logits-processor order): repetition penalty, frequency and presence
// penalties, then greedy (temperature 0) or temperature, top-k, top-p, min-p and a draw.
// docs/cpu-engine.md states the semantics of each filter.
#include <cstdint>
#include <span>
#include <vector>

#include "messages/catalogue.hpp"

namespace duet {

struct token_logprob {
  int32_t token = 0;
  float logprob = 0.0f;
  friend bool operator==(const token_logprob&, const token_logprob&) = default;
};

/// One sampled token.
struct sample_result {
  int32_t token = 0;
  /// log_softmax of the raw logits (before penalties and temperature) at `token`.
  float logprob = 0.0f;
  /// The top_logprobs most likely tokens under the same raw distribution, most likely first
  /// (ties: lower token id first).
  std::vector<token_logprob> top;
};

/// The seed of a sequence's random stream: sampling.seed when has_seed, else derived from the
/// sequence id (so prefill and decode engines that never talk still continue one stream).
[[nodiscard]] uint64_t sampler_seed(const msg::sampling_params* params, uint64_t seq_id);

/// The uniform number in [0, 1) used to draw the token at `position` of a stream: a pure
/// function of (seed, position), with 53 random bits.
[[nodiscard]] double sampler_uniform(uint64_t seed, uint64_t position);

/// Samples tokens; holds scratch buffers only (one sampler per thread).
class sampler {
 public:
  /// Samples the token at `position` (the index it will have in the sequence). `context` holds
  /// the tokens the penalties look at (the engine passes the whole sequence so far: prompt and
  /// generated tokens). `params` == nullptr means greedy with no penalties.
  [[nodiscard]] sample_result sample(std::span<const float> logits, const msg::sampling_params* params,
                                     std::span<const int32_t> context, uint64_t seed, uint64_t position);

  /// The logits after the penalties of `params` for `context` (the first stage of sample()).
  void apply_penalties(std::span<float> logits, const msg::sampling_params& params,
                       std::span<const int32_t> context);

 private:
  std::vector<float> work_;
  std::vector<int32_t> ids_;
  std::vector<int32_t> counts_scratch_;
  std::vector<double> weights_;
};

}  // namespace duet
