#include "kernels/device_util.cuh"
#include "kernels/launch.cuh"
#include "kernels/rmsnorm.cuh"

namespace duet::kernels {

namespace {

constexpr int threads = 256;

// One CTA per row; the row's (summed) values stay in shared memory between the two passes.
__global__ void __launch_bounds__(threads) rmsnorm_kernel(rmsnorm_params p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ float row_values[];
  __shared__ float partial[threads / 32];
  const uint64_t base = static_cast<uint64_t>(blockIdx.x) * p.hidden;
  const uint32_t chunks = p.hidden / 8;
  float sumsq = 0.0f;
  for (uint32_t c = threadIdx.x; c < chunks; c += threads) {
    float x[8];
    dev::unpack8(reinterpret_cast<const uint4*>(p.residual + base)[c], x);
    if (p.delta) {
      float d[8];
      dev::unpack8(reinterpret_cast<const uint4*>(p.delta + base)[c], d);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = dev::rbf(x[i] + d[i]);
      reinterpret_cast<uint4*>(p.residual + base)[c] = dev::pack8(x);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sumsq = fmaf(x[i], x[i], sumsq);
      row_values[c * 8 + i] = x[i];
    }
  }
  sumsq = dev::warp_sum(sumsq);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sumsq;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < threads / 32; ++w) total += partial[w];
  const float inv = rsqrtf(total / static_cast<float>(p.hidden) + p.eps);
  for (uint32_t c = threadIdx.x; c < chunks; c += threads) {
    float w[8], y[8];
    dev::unpack8(reinterpret_cast<const uint4*>(p.weight)[c], w);
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = w[i] * dev::rbf(row_values[c * 8 + i] * inv);
    reinterpret_cast<uint4*>(p.out + base)[c] = dev::pack8(y);
  }
}

}  // namespace

kstatus add_rmsnorm(const rmsnorm_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(p.hidden % 8 == 0 && p.hidden > 0 && p.hidden <= 16384,
                "add_rmsnorm: hidden must be a positive multiple of 8, at most 16384");
  DUET_KREQUIRE(p.residual && p.weight && p.out, "add_rmsnorm: null pointer");
  if (p.rows == 0) return {};
  const size_t smem = p.hidden * sizeof(float);
  if (smem > 48 * 1024)
    DUET_KCHECK(cudaFuncSetAttribute(rmsnorm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     64 * 1024));
  DUET_KCHECK(launch(rmsnorm_kernel, dim3(p.rows), dim3(threads), smem, stream, p));
  return {};
}

}  // namespace duet::kernels
