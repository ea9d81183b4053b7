#pragma once
// Kernel launch with programmatic dependent launch (PDL): the next kernel of the stream may be
// scheduled while this one drains, and waits in pdl_wait() (griddepcontrol.wait) until the
// previous grid has completed and its writes are visible. Included by .cu files only.
#include <cuda_runtime.h>

#include "kernels/kernel_status.hpp"
#include "kernels/l2_prefetch.hpp"

namespace duet::kernels {

/// Whether launchers ask for PDL (default on; DUET_CUDA_PDL=0 in the environment turns it off).
bool pdl_enabled();

namespace dev {
/// First statement of every kernel launched through launch(): waits for the previous grid.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
/// Lets the next kernel of the stream (launched with PDL) be scheduled now instead of when this
/// grid's blocks exit: its blocks run what precedes their pdl_wait() (the skinny GEMM's weight
/// loads) while this grid finishes. Correctness never depends on it: pdl_wait() still waits for
/// this whole grid and its writes.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}
/// The share of `p` that prefetch CTA `cta` (0 <= cta < p.ctas) pulls into L2: lane i of warp 0
/// issues pieces i, i + 32, ... of 32 KiB with cp.async.bulk.prefetch, which needs no wait and
/// no buffer. Called by a kernel's appended CTAs before anything else, without waiting for the
/// previous grid: weights are never written by kernels queued before.
__device__ __forceinline__ void l2_prefetch_share(const l2_prefetch& p, uint32_t cta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr uint64_t piece = 32 << 10;
  if (threadIdx.x >= 32 || cta >= p.ctas) return;
  const uint64_t total = p.bytes & ~uint64_t{15};
  const uint64_t share = (total / p.ctas + 15) & ~uint64_t{15};
  const uint64_t end = min(total, (cta + 1) * share);
  const char* base = static_cast<const char*>(p.ptr);
  for (uint64_t off = cta * share + threadIdx.x * piece; off < end; off += 32 * piece) {
    const uint32_t size = static_cast<uint32_t>(min(piece, end - off));
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(base + off), "r"(size)
                 : "memory");
  }
#endif
}
}  // namespace dev

template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace duet::kernels
