#include <cmath>

#include "kernels/bf16_host.hpp"
#include "kernels/silu_mul.cuh"

namespace duet::kernels {

void silu_mul_reference(const silu_mul_params& p) {
  for (uint32_t r = 0; r < p.rows; ++r) {
    const uint16_t* in = p.gate_up + static_cast<uint64_t>(r) * 2 * p.ffn;
    for (uint32_t i = 0; i < p.ffn; ++i) {
      const float g = bf16_to_f32(in[i]), u = bf16_to_f32(in[p.ffn + i]);
      p.out[static_cast<uint64_t>(r) * p.ffn + i] =
          f32_to_bf16(round_bf16(g / (1.0f + std::exp(-g))) * u);
    }
  }
}

}  // namespace duet::kernels
