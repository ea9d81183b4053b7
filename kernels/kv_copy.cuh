#pragma once
// KV handover between two pools on the device: blocks src_blocks[i] of one pool into
// dst_blocks[i] of another, all in one launch. One cudaMemcpyAsync per 2 MiB block costs
// more in launches than in bytes (2,048 of them for a 32K-token prompt of the 8B model);
// a single gather kernel runs at the device's copy bandwidth. The source may be another
// process's pool opened with cudaIpcOpenMemHandle.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_status.hpp"

namespace duet::kernels {

struct kv_copy_params {
  const void* src_pool = nullptr;
  void* dst_pool = nullptr;
  const uint32_t* src_blocks = nullptr;  // device array of `count` block ids
  const uint32_t* dst_blocks = nullptr;  // device array of `count` block ids
  uint32_t count = 0;
  uint64_t block_bytes = 0;  // a multiple of 16
};

kstatus kv_copy_blocks(const kv_copy_params& p, cudaStream_t stream);

}  // namespace duet::kernels
