#include "kernels/bf16_host.hpp"
#include "kernels/gemm.cuh"

namespace duet::kernels {

void gemm_reference(const gemm_params& p) {
  for (uint32_t r = 0; r < p.m; ++r) {
    const uint16_t* x = p.x + static_cast<uint64_t>(r) * p.ldx;
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
        float& y = static_cast<float*>(p.y)[at];
        y = p.accumulate ? y + acc : acc;
      } else {
        uint16_t& y = static_cast<uint16_t*>(p.y)[at];
        y = f32_to_bf16(p.accumulate ? bf16_to_f32(y) + acc : acc);
      }
    }
  }
}

}  // namespace duet::kernels
