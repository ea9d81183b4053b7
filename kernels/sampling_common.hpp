#pragma once
// Helpers shared by the sampling kernel and its CPU reference, so both compute bit-identical
// keys and weights.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DUET_SHD __host__ __device__ __forceinline__
#else
#define DUET_SHD inline
#endif

namespace duet::kernels::sampling_detail {

/// Order-preserving bit pattern of a float: a > b  <=>  key(a) > key(b) (NaN excluded).
DUET_SHD uint32_t key_of(float f) {
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(f);
#else
  std::memcpy(&u, &f, 4);
#endif
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// Probability weight of scaled logit v relative to the maximum vmax, in 2^-24 fixed point.
DUET_SHD uint32_t mass_of(float v, float vmax) {
#if defined(__CUDA_ARCH__)
  const float e = expf(v - vmax);
#else
  const float e = std::exp(v - vmax);
#endif
  return static_cast<uint32_t>(e * 16777216.0f + 0.5f);
}

}  // namespace duet::kernels::sampling_detail
