#pragma once
// Device helpers shared by the kernel families (included by .cu files only): bf16 packing,
// 16-byte vectors, warp reductions, cp.async, ldmatrix and the bf16 mma.sync tile.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace duet::kernels::dev {

__device__ __forceinline__ float bf(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}
__device__ __forceinline__ uint16_t to_bf(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
/// f rounded to bf16 and back (one rounding step of the Hugging Face bf16 computation).
__device__ __forceinline__ float rbf(float f) {
  return bf(to_bf(f));
}

__device__ __forceinline__ float lo(uint32_t pair) {
  return __uint_as_float(pair << 16);
}
__device__ __forceinline__ float hi(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}
__device__ __forceinline__ uint32_t pack(float a, float b) {
  return static_cast<uint32_t>(to_bf(a)) | (static_cast<uint32_t>(to_bf(b)) << 16);
}

/// 8 bf16 values (16 bytes) to floats and back.
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  f[0] = lo(v.x);
  f[1] = hi(v.x);
  f[2] = lo(v.y);
  f[3] = hi(v.y);
  f[4] = lo(v.z);
  f[5] = hi(v.z);
  f[6] = lo(v.w);
  f[7] = hi(v.w);
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack(f[0], f[1]), pack(f[2], f[3]), pack(f[4], f[5]), pack(f[6], f[7]));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ----------------------------------------------------------------------------- cp.async

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
/// 16-byte global -> shared copy; `valid` false writes zeros instead (no global read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ----------------------------------------------------------------------------- ldmatrix / mma

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

/// c[16x8] += a[16x16] * b[16x8], bf16 inputs, fp32 accumulators (row.col).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// Rows of 128 bf16 (256 bytes, 16 chunks of 16 bytes) in shared memory, chunk c of row r stored
/// at chunk c ^ (r & 7): ldmatrix over 8 rows of one logical chunk touches 8 distinct bank groups.
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 3);
}

}  // namespace duet::kernels::dev
