#pragma once
// RMSNorm fused with the residual add (Hugging Face LlamaRMSNorm in bf16):
//   residual = bf16(residual + delta)                      (when delta is given)
//   out      = bf16(weight * bf16(residual * rsqrt(mean(residual^2) + eps)))
// with the mean in fp32, exactly the rounding steps of the bf16 PyTorch model.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_status.hpp"

namespace duet::kernels {

struct rmsnorm_params {
  uint16_t* residual = nullptr;      // [rows, hidden] bf16, read; written when delta != nullptr
  const uint16_t* delta = nullptr;   // [rows, hidden] bf16 or nullptr (no add)
  const uint16_t* weight = nullptr;  // [hidden] bf16
  uint16_t* out = nullptr;           // [rows, hidden] bf16
  uint32_t rows = 0;
  uint32_t hidden = 0;  // a multiple of 8, at most 16384
  float eps = 1e-5f;
};

kstatus add_rmsnorm(const rmsnorm_params& p, cudaStream_t stream);
void add_rmsnorm_reference(const rmsnorm_params& p);

}  // namespace duet::kernels
