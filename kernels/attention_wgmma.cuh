#pragma once
// Prefill attention on Hopper's warpgroup MMA (wgmma, sm_90a): variant 4 of prefill_attention
// (attention.cuh), which dispatches here. Built for sm_90a only (kernels/cuda.cmake), so it runs
// on compute capability 9.0 exactly (H100, H200, H20); prefill_attention_wgmma_available()
// (attention.cuh) says whether the current device is one.
#include <cuda_runtime_api.h>

#include "kernels/attention.cuh"
#include "kernels/kernel_status.hpp"

namespace duet::kernels {

/// The parameters as prefill_attention takes them (already checked there).
kstatus prefill_attention_wgmma(const prefill_attention_params& p, cudaStream_t stream);

}  // namespace duet::kernels
