#pragma once
// Rotary position embedding from precomputed cos/sin tables (any frequency rule, llama3 scaling
// included: the tables carry it), rotate-half pairing (i, i + head_dim/2), applied in place to
// the query and key heads of packed QKV rows, fused with the KV append: the rotated K heads and
// the V heads are stored into their slots of the paged pool (kv_layout.hpp).
// The rounding is Hugging Face's bf16 one:
//   out = bf16(bf16(x * bf16(cos)) + bf16(rotate_half(x) * bf16(sin)))
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_status.hpp"
#include "kernels/kv_layout.hpp"

namespace duet::kernels {

struct rope_params {
  uint16_t* x = nullptr;    // [rows, row_stride] bf16: q_heads, then k_heads, then k_heads V heads
  uint32_t row_stride = 0;  // elements between rows, a multiple of 8
  const int32_t* positions = nullptr;  // [rows]; clamped to [0, max_positions)
  const float* cos = nullptr;          // [max_positions, head_dim / 2]
  const float* sin = nullptr;          // [max_positions, head_dim / 2]
  uint32_t rows = 0;
  uint32_t q_heads = 0;
  uint32_t k_heads = 0;   // = kv.kv_heads when appending
  uint32_t head_dim = 0;  // even; a multiple of 8 when appending
  uint32_t max_positions = 0;
  // KV append, done when slots != nullptr.
  const int32_t* slots =
      nullptr;  // [rows]: block * block_tokens + slot in block; negative: not stored
  kv_pool_view kv;
  uint32_t layer = 0;
};

kstatus rope_apply(const rope_params& p, cudaStream_t stream);
void rope_apply_reference(const rope_params& p);

}  // namespace duet::kernels
