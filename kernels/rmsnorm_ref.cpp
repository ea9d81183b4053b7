#include <cmath>
#include <vector>

#include "kernels/bf16_host.hpp"
#include "kernels/rmsnorm.cuh"

namespace duet::kernels {

void add_rmsnorm_reference(const rmsnorm_params& p) {
  std::vector<float> x(p.hidden);
  for (uint32_t r = 0; r < p.rows; ++r) {
    uint16_t* res = p.residual + static_cast<uint64_t>(r) * p.hidden;
    double sumsq = 0;
    for (uint32_t i = 0; i < p.hidden; ++i) {
      x[i] = bf16_to_f32(res[i]);
      if (p.delta) {
        x[i] = round_bf16(x[i] + bf16_to_f32(p.delta[static_cast<uint64_t>(r) * p.hidden + i]));
        res[i] = f32_to_bf16(x[i]);
      }
      sumsq += static_cast<double>(x[i]) * x[i];
    }
    const float inv =
        static_cast<float>(1.0 / std::sqrt(sumsq / p.hidden + static_cast<double>(p.eps)));
    for (uint32_t i = 0; i < p.hidden; ++i) {
      p.out[static_cast<uint64_t>(r) * p.hidden + i] =
          f32_to_bf16(bf16_to_f32(p.weight[i]) * round_bf16(x[i] * inv));
    }
  }
}

}  // namespace duet::kernels
