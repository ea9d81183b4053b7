#include "runtime/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace duet {

namespace {

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Descending by value, then ascending by id: a total order, so every sort is deterministic.
struct by_value_desc {
  const float* values;
  bool operator()(int32_t a, int32_t b) const {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  }
};

int32_t argmax_first(std::span<const float> v) {
  int32_t best = 0;
  for (std::size_t i = 1; i < v.size(); ++i) {
    if (v[i] > v[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

bool has_penalties(const msg::sampling_params& p) {
  return p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
}

}  // namespace

uint64_t sampler_seed(const msg::sampling_params* params, uint64_t seq_id) {
  if (params && params->has_seed) return params->seed;
  return mix64(seq_id ^ 0x2545f4914f6cdd1dull);
}

double sampler_uniform(uint64_t seed, uint64_t position) {
  const uint64_t h = mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ (position * 0xd1b54a32d192ed03ull + 1));
  return static_cast<double>(h >> 11) * 0x1p-53;
}

void sampler::apply_penalties(std::span<float> logits, const msg::sampling_params& p,
                              std::span<const int32_t> context) {
  if (!has_penalties(p) || context.empty()) return;
  counts_scratch_.assign(context.begin(), context.end());
  std::sort(counts_scratch_.begin(), counts_scratch_.end());
  const int64_t vocab = static_cast<int64_t>(logits.size());
  for (std::size_t i = 0; i < counts_scratch_.size();) {
    std::size_t j = i;
    while (j < counts_scratch_.size() && counts_scratch_[j] == counts_scratch_[i]) ++j;
    const int32_t token = counts_scratch_[i];
    const auto count = static_cast<float>(j - i);
    i = j;
    if (token < 0 || token >= vocab) continue;
    float& l = logits[static_cast<std::size_t>(token)];
    if (p.repetition_penalty != 1.0f) {
      // Hugging Face RepetitionPenaltyLogitsProcessor: shrink toward zero, once per token.
      l = l < 0 ? l * p.repetition_penalty : l / p.repetition_penalty;
    }
    // OpenAI: frequency scales with the count, presence applies once.
    l -= count * p.frequency_penalty + p.presence_penalty;
  }
}

sample_result sampler::sample(std::span<const float> logits, const msg::sampling_params* params,
                              std::span<const int32_t> context, uint64_t seed, uint64_t position) {
  if (logits.empty()) throw std::invalid_argument("sampler: empty logits");
  const std::size_t vocab = logits.size();
  sample_result result;

  work_.assign(logits.begin(), logits.end());
  if (params) apply_penalties(work_, *params, context);

  const bool greedy = !params || !(params->temperature > 0.0f);
  if (greedy) {
    result.token = argmax_first(work_);
  } else {
    const msg::sampling_params& p = *params;
    const float inv_t = 1.0f / p.temperature;
    for (float& l : work_) l *= inv_t;
    const float* values = work_.data();
    // Candidates, sorted (descending) only where a filter needs the order.
    ids_.resize(vocab);
    std::iota(ids_.begin(), ids_.end(), 0);
    bool sorted = false;
    if (p.top_k > 0 && static_cast<std::size_t>(p.top_k) < ids_.size()) {
      // Keep the k largest and every token tied with the k-th (Hugging Face TopKLogitsWarper).
      const auto k = static_cast<std::size_t>(p.top_k);
      std::nth_element(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(k - 1), ids_.end(), by_value_desc{values});
      const float kth = values[ids_[k - 1]];
      std::size_t keep = k;
      for (std::size_t i = k; i < ids_.size(); ++i) {
        if (values[ids_[i]] >= kth) std::swap(ids_[keep++], ids_[i]);
      }
      ids_.resize(keep);
      std::sort(ids_.begin(), ids_.end(), by_value_desc{values});
      sorted = true;
    }
    float max_value = -std::numeric_limits<float>::infinity();
    for (int32_t id : ids_) max_value = std::max(max_value, values[id]);
    if (p.top_p < 1.0f) {
      // Keep the most likely tokens while the mass before them is under top_p (Hugging Face
      // TopPLogitsWarper, at least one token), normalised over the candidates so far.
      double total = 0;
      for (int32_t id : ids_) total += std::exp(static_cast<double>(values[id]) - max_value);
      const double target = static_cast<double>(std::max(p.top_p, 0.0f)) * total;
      std::size_t sorted_prefix = ids_.size();
      if (!sorted) {
        // Sort only as long a prefix as the kept set can need: grow it until it holds the mass.
        sorted_prefix = std::min<std::size_t>(64, ids_.size());
        while (true) {
          std::partial_sort(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(sorted_prefix), ids_.end(),
                            by_value_desc{values});
          double mass = 0;
          for (std::size_t i = 0; i < sorted_prefix; ++i) mass += std::exp(static_cast<double>(values[ids_[i]]) - max_value);
          if (mass >= target || sorted_prefix == ids_.size()) break;
          sorted_prefix = std::min(ids_.size(), sorted_prefix * 4);
        }
      }
      double before = 0;
      std::size_t keep = 0;
      while (keep < sorted_prefix && (keep == 0 || before < target)) {
        before += std::exp(static_cast<double>(values[ids_[keep]]) - max_value);
        ++keep;
      }
      ids_.resize(keep);
      sorted = true;
    }
    if (p.min_p > 0.0f) {
      // Keep tokens with probability >= min_p * the top probability (Hugging Face MinPLogitsWarper):
      // the ratio is exp(l - max), whatever the normalisation.
      const double floor = std::log(static_cast<double>(std::min(p.min_p, 1.0f)));  // over 1: the top token
      std::size_t keep = 0;
      for (int32_t id : ids_) {
        if (static_cast<double>(values[id]) - max_value >= floor) ids_[keep++] = id;
      }
      ids_.resize(std::max<std::size_t>(keep, 1));
    }
    // Draw: walk the candidates in their order until the cumulative weight passes u * total.
    weights_.resize(ids_.size());
    double total = 0;
    for (std::size_t i = 0; i < ids_.size(); ++i) {
      weights_[i] = std::exp(static_cast<double>(values[ids_[i]]) - max_value);
      total += weights_[i];
    }
    const double target = sampler_uniform(seed, position) * total;
    double cumulative = 0;
    result.token = ids_.back();
    for (std::size_t i = 0; i < ids_.size(); ++i) {
      cumulative += weights_[i];
      if (cumulative > target) {
        result.token = ids_[i];
        break;
      }
    }
  }

  // Log-probabilities of the raw distribution.
  double max_raw = logits[0];
  for (float l : logits) max_raw = std::max(max_raw, static_cast<double>(l));
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max_raw);
  const double lse = max_raw + std::log(sum);
  result.logprob = static_cast<float>(static_cast<double>(logits[static_cast<std::size_t>(result.token)]) - lse);
  const uint32_t n_top = params ? std::min<uint32_t>(params->top_logprobs, static_cast<uint32_t>(vocab)) : 0;
  if (n_top > 0) {
    ids_.resize(vocab);
    std::iota(ids_.begin(), ids_.end(), 0);
    std::partial_sort(ids_.begin(), ids_.begin() + n_top, ids_.end(), by_value_desc{logits.data()});
    for (uint32_t i = 0; i < n_top; ++i) {
      result.top.push_back({ids_[i], static_cast<float>(static_cast<double>(logits[static_cast<std::size_t>(ids_[i])]) - lse)});
    }
  }
  return result;
}

}  // namespace duet
