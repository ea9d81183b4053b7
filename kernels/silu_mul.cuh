#pragma once
// SwiGLU activation of a fused gate/up projection, with Hugging Face's bf16 rounding:
//   out = bf16(bf16(silu(gate)) * up),  silu(g) = g / (1 + exp(-g)) in fp32.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_status.hpp"

namespace duet::kernels {

struct silu_mul_params {
  const uint16_t* gate_up = nullptr;  // [rows, 2 * ffn] bf16: gate in [0, ffn), up in [ffn, 2 ffn)
  uint16_t* out = nullptr;            // [rows, ffn] bf16
  uint32_t rows = 0;
  uint32_t ffn = 0;  // a multiple of 8
};

kstatus silu_mul(const silu_mul_params& p, cudaStream_t stream);
void silu_mul_reference(const silu_mul_params& p);

}  // namespace duet::kernels
