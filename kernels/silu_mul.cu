#include "kernels/device_util.cuh"
#include "kernels/launch.cuh"
#include "kernels/silu_mul.cuh"

namespace duet::kernels {

namespace {

__global__ void silu_mul_kernel(silu_mul_params p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const uint32_t row = blockIdx.y;
  const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.ffn / 8) return;
  const uint4* in =
      reinterpret_cast<const uint4*>(p.gate_up + static_cast<uint64_t>(row) * 2 * p.ffn);
  float g[8], u[8], y[8];
  dev::unpack8(in[c], g);
  dev::unpack8(in[p.ffn / 8 + c], u);
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = dev::rbf(g[i] / (1.0f + __expf(-g[i]))) * u[i];
  reinterpret_cast<uint4*>(p.out + static_cast<uint64_t>(row) * p.ffn)[c] = dev::pack8(y);
}

}  // namespace

kstatus silu_mul(const silu_mul_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(p.ffn % 8 == 0 && p.ffn > 0, "silu_mul: ffn must be a positive multiple of 8");
  DUET_KREQUIRE(p.gate_up && p.out, "silu_mul: null pointer");
  DUET_KREQUIRE(p.rows <= 65535u, "silu_mul: at most 65535 rows");
  if (p.rows == 0) return {};
  const uint32_t chunks = p.ffn / 8;
  dim3 grid((chunks + 255) / 256, p.rows);
  DUET_KCHECK(launch(silu_mul_kernel, grid, dim3(256), 0, stream, p));
  return {};
}

}  // namespace duet::kernels
