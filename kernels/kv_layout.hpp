#pragma once
// The paged KV pool as kernels and their CPU references see it (bf16).
//
// A block holds every layer's K and V for block_tokens tokens, as bf16 indexed
// [layer][0 = K, 1 = V][kv_head][slot][head_dim]; block_elems is that count rounded up so that a
// block is a multiple of 256 bytes, and every block starts 256-byte aligned in a pool whose base
// is. K (or V) of one (layer, kv_head) is block_tokens * head_dim contiguous elements of a block.
#include <cstdint>

#if defined(__CUDACC__)
#define DUET_HD __host__ __device__ __forceinline__
#else
#define DUET_HD inline
#endif

namespace duet::kernels {

struct kv_pool_view {
  uint16_t* pool = nullptr;  // bf16 bits; block b starts at pool + b * block_elems
  uint64_t block_elems = 0;  // elements per block (block bytes / 2), a multiple of 128
  uint32_t layers = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t block_tokens = 0;
  uint32_t blocks = 0;  // blocks the pool holds, when known (0: not); prefill attention variant 5
                        // needs it to bound its TMA view of the pool

  /// Elements from a block's start to token `slot` of (layer, kv, kv_head).
  [[nodiscard]] DUET_HD uint64_t offset(uint32_t layer, uint32_t kv, uint32_t kv_head,
                                        uint32_t slot) const {
    return ((static_cast<uint64_t>(layer) * 2 + kv) * kv_heads + kv_head) * block_tokens *
               head_dim +
           static_cast<uint64_t>(slot) * head_dim;
  }
};

/// Elements of one block for this shape, rounded up to a multiple of 256 bytes.
[[nodiscard]] DUET_HD uint64_t kv_block_elems(uint32_t layers, uint32_t kv_heads, uint32_t head_dim,
                                              uint32_t block_tokens) {
  const uint64_t n = 2ull * layers * kv_heads * head_dim * block_tokens;
  return (n + 127) / 128 * 128;
}

}  // namespace duet::kernels
