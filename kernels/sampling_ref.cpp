#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/sampling.cuh"
#include "kernels/sampling_common.hpp"

namespace duet::kernels {

using sampling_detail::key_of;
using sampling_detail::mass_of;

void sample_tokens_reference(const sample_params& p) {
  std::vector<uint32_t> order(p.vocab);
  for (uint32_t r = 0; r < p.rows; ++r) {
    const float* row = p.logits + static_cast<uint64_t>(r) * p.ld;
    const sample_row& rq = p.requests[r];
    int best = -1;
    for (uint32_t i = 0; i < p.vocab; ++i) {
      if (row[i] == row[i] && (best < 0 || row[i] > row[best])) best = static_cast<int>(i);
    }
    best = std::max(best, 0);
    const float mx = row[best];
    double sum = 0;
    for (uint32_t i = 0; i < p.vocab; ++i) {
      if (row[i] == row[i]) sum += std::exp(static_cast<double>(row[i]) - mx);
    }
    const double lse = mx + std::log(sum);
    int token = best;
    if (rq.temperature > 0.0f) {
      const float inv_t = 1.0f / rq.temperature;
      const float vmax = mx * inv_t;
      auto value = [&](uint32_t i) { return row[i] * inv_t; };
      std::iota(order.begin(), order.end(), 0u);
      std::sort(order.begin(), order.end(),
                [&](uint32_t a, uint32_t b) { return key_of(value(a)) > key_of(value(b)); });
      uint32_t min_key = 0;
      if (rq.top_k > 0 && static_cast<uint32_t>(rq.top_k) < p.vocab)
        min_key = key_of(value(order[rq.top_k - 1]));
      if (rq.top_p < 1.0f) {
        uint64_t total = 0;
        for (uint32_t i : order) {
          if (key_of(value(i)) >= min_key) total += mass_of(value(i), vmax);
        }
        const double tp = rq.top_p > 0.0f ? static_cast<double>(rq.top_p) : 0.0;
        uint64_t target = static_cast<uint64_t>(tp * static_cast<double>(total));
        if (target == 0) target = 1;
        uint64_t cum = 0;
        for (uint32_t i : order) {
          if (key_of(value(i)) < min_key) break;
          cum += mass_of(value(i), vmax);
          if (cum >= target) {
            min_key = key_of(value(i));
            break;
          }
        }
      }
      const double log_min_p =
          rq.min_p > 0.0f ? std::log(static_cast<double>(rq.min_p)) : -INFINITY;
      std::vector<double> w(p.vocab, -1.0);
      double total = 0;
      int last = -1;
      for (uint32_t i = 0; i < p.vocab; ++i) {
        const float v = value(i);
        if (!(v == v) || key_of(v) < min_key) continue;
        const double rel = static_cast<double>(v) - static_cast<double>(vmax);
        if (rel < log_min_p) continue;
        w[i] = std::exp(rel);
        total += w[i];
        last = static_cast<int>(i);
      }
      const double target = rq.uniform * total;
      token = last >= 0 ? last : best;
      double cum = 0;
      for (uint32_t i = 0; i < p.vocab; ++i) {
        if (w[i] < 0) continue;
        cum += w[i];
        if (cum > target) {
          token = static_cast<int>(i);
          break;
        }
      }
    }
    p.tokens[r] = token;
    p.logprobs[r] = static_cast<float>(static_cast<double>(row[token]) - lse);
    const uint32_t n_top = std::min({rq.top_logprobs, p.max_top, p.vocab, sampling_max_top});
    if (p.max_top == 0) continue;
    std::iota(order.begin(), order.end(), 0u);
    std::partial_sort(
        order.begin(), order.begin() + std::min<uint32_t>(n_top, p.vocab), order.end(),
        [&](uint32_t a, uint32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    for (uint32_t j = 0; j < p.max_top; ++j) {
      const bool have = j < n_top;
      p.top_ids[static_cast<uint64_t>(r) * p.max_top + j] =
          have ? static_cast<int32_t>(order[j]) : -1;
      p.top_logprobs[static_cast<uint64_t>(r) * p.max_top + j] =
          have ? static_cast<float>(static_cast<double>(row[order[j]]) - lse) : -INFINITY;
    }
  }
}

}  // namespace duet::kernels
