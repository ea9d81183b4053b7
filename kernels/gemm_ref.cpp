#include <cmath>
#include <vector>

#include "kernels/bf16_host.hpp"
#include "kernels/gemm.cuh"

namespace duet::kernels {

void gemm_reference(const gemm_params& p) {
  for (uint32_t r = 0; r < p.m; ++r) {
    const uint16_t* x = p.x + static_cast<uint64_t>(r) * p.ldx;
    std::vector<uint16_t> normed;
    if (p.x_norm_weight) {
      double sumsq = 0.0;
      for (uint32_t i = 0; i < p.k; ++i) sumsq += double{bf16_to_f32(x[i])} * bf16_to_f32(x[i]);
      const float inv = static_cast<float>(1.0 / std::sqrt(sumsq / p.k + p.x_norm_eps));
      normed.resize(p.k);
      for (uint32_t i = 0; i < p.k; ++i) {
        normed[i] = f32_to_bf16(bf16_to_f32(p.x_norm_weight[i]) *
                                round_bf16(bf16_to_f32(x[i]) * inv));
      }
      x = normed.data();
    }
    for (uint32_t n = 0; n < p.n; ++n) {
      const uint16_t* w = p.w + static_cast<uint64_t>(n) * p.k;
      float acc = 0.0f;
      for (uint32_t i = 0; i < p.k; ++i) {
        float xv = bf16_to_f32(x[i]);
        if (p.x_swiglu) {
          const float u = bf16_to_f32(x[p.k + i]);
          xv = round_bf16(round_bf16(xv / (1.0f + std::exp(-xv))) * u);
        }
        acc += xv * bf16_to_f32(w[i]);
      }
      if (p.bias) acc += bf16_to_f32(p.bias[n]);
      const uint64_t at = static_cast<uint64_t>(r) * p.ldy + n;
      if (p.y_fp32) {
        static_cast<float*>(p.y)[at] = acc;
      } else if (p.y_residual) {
        static_cast<uint16_t*>(p.y)[at] = f32_to_bf16(bf16_to_f32(p.y_residual[at]) + round_bf16(acc));
      } else {
        static_cast<uint16_t*>(p.y)[at] = f32_to_bf16(acc);
      }
    }
  }
  if (p.y_rope.x) {
    rope_params r = p.y_rope;
    r.x = static_cast<uint16_t*>(p.y);
    rope_apply_reference(r);
  }
}

}  // namespace duet::kernels
