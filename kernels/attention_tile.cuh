#pragma once
// Online-softmax step shared by the mma.sync (attention.cu) and wgmma (attention_wgmma.cu) prefill
// kernels. A thread holds rows g and g + 8 of a 16-row tile in the mma.m16n8 accumulator layout
// (lane = 4 g + t; s[nt] = columns 8 nt + 2 t, + 1 of both rows), which is also the layout of each
// warp's 16 rows in a wgmma m64nN accumulator. Included by .cu files only.
#include <cmath>

namespace duet::kernels::tile {

/// The maximum of row g (r = 0) or g + 8 (r = 1) over the tile's NT column blocks, reduced across
/// the four lanes that hold the row.
template <int NT>
__device__ __forceinline__ float row_max(const float (&s)[NT][4], int r) {
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
}

/// 2^x as one MUFU.EX2 (ex2.approx.ftz). exp2f without --use_fast_math adds a range test and two
/// scalings around it so that results under 2^-126 come out denormal; a probability that small
/// against its row's maximum (which is 1) is 0 in P's bf16 and in l's fp32 sums alike. On the
/// wgmma kernel: 8K prefill 1.3 %, 32K 1.7 % faster (H100, 2026-12-06; docs/cuda-engine.md).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// softmax_update with FlashAttention-4's conditional rescaling: a 16-row tile's running maxima
/// move (and O and l are rescaled) only when some row's new maximum exceeds its running one by
/// more than 8 in log2 units; otherwise the probabilities are taken against the stale maxima. They
/// are then at most 2^8, exact in fp32 and as precise in bf16, and O / l is the same quotient.
/// Measured no faster than softmax_update by itself, but with the rescale in a warp-uniform branch
/// the 64-key sub-tile kernel spills 20 bytes instead of 92, and that one is the fastest.
template <int NT>
__device__ __forceinline__ void softmax_update_lazy(float (&s)[NT][4], float (&m)[2],
                                                    float (&l)[2], float (&o)[16][4],
                                                    float scale_log2) {
  const float mx[2] = {row_max(s, 0), row_max(s, 1)};
  // -inf running maxima (nothing seen yet) always grow; a -inf row maximum never does.
  const bool grow = (mx[0] - m[0]) * scale_log2 > 8.0f || (mx[1] - m[1]) * scale_log2 > 8.0f;
  if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], mx[r]);
      const float alpha =
          m_new == -INFINITY ? 1.0f : exp2f(m[r] * scale_log2 - m_new * scale_log2);
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        o[nt][2 * r] *= alpha;
        o[nt][2 * r + 1] *= alpha;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float base = m[r] == -INFINITY ? 0.0f : m[r] * scale_log2;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * r] = exp2_ftz(fmaf(s[nt][2 * r], scale_log2, -base));
      s[nt][2 * r + 1] = exp2_ftz(fmaf(s[nt][2 * r + 1], scale_log2, -base));
      l[r] += s[nt][2 * r] + s[nt][2 * r + 1];
    }
  }
}

}  // namespace duet::kernels::tile
