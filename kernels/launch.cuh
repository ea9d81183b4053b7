#pragma once
// Kernel launch with programmatic dependent launch (PDL): the next kernel of the stream may be
// scheduled while this one drains, and waits in pdl_wait() (griddepcontrol.wait) until the
// previous grid has completed and its writes are visible. Included by .cu files only.
#include <cuda_runtime.h>

#include "kernels/kernel_status.hpp"

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
