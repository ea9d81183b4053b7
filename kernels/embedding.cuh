#pragma once
// Row gather: out[r] = table[ids[r]] (token embeddings; also picks the rows that feed the LM head).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_status.hpp"

namespace duet::kernels {

struct embedding_params {
  const uint16_t* table = nullptr;  // [vocab, hidden] bf16
  const int32_t* ids = nullptr;     // [rows]; an id outside [0, vocab) gives a row of zeros
  uint16_t* out = nullptr;          // [rows, hidden] bf16
  uint32_t rows = 0;
  uint32_t hidden = 0;  // a multiple of 8
  uint32_t vocab = 0;
};

/// Gathers the rows on `stream`.
kstatus embedding_gather(const embedding_params& p, cudaStream_t stream);
/// The same on host memory.
void embedding_gather_reference(const embedding_params& p);

}  // namespace duet::kernels
