#include <cstring>

#include "kernels/bf16_host.hpp"
#include "kernels/rope.cuh"

namespace duet::kernels {

void rope_apply_reference(const rope_params& p) {
  const uint32_t half = p.head_dim / 2;
  for (uint32_t r = 0; r < p.rows; ++r) {
    int32_t pos = p.positions[r];
    pos = pos < 0 ? 0
                  : (static_cast<uint32_t>(pos) >= p.max_positions
                         ? static_cast<int32_t>(p.max_positions) - 1
                         : pos);
    uint16_t* x = p.x + static_cast<uint64_t>(r) * p.row_stride;
    for (uint32_t head = 0; head < p.q_heads + p.k_heads; ++head) {
      uint16_t* h = x + static_cast<uint64_t>(head) * p.head_dim;
      for (uint32_t i = 0; i < half; ++i) {
        const float c = round_bf16(p.cos[static_cast<uint64_t>(pos) * half + i]);
        const float s = round_bf16(p.sin[static_cast<uint64_t>(pos) * half + i]);
        const float a = bf16_to_f32(h[i]), b = bf16_to_f32(h[i + half]);
        h[i] = f32_to_bf16(round_bf16(a * c) + round_bf16(-b * s));
        h[i + half] = f32_to_bf16(round_bf16(b * c) + round_bf16(a * s));
      }
    }
    const int32_t s = p.slots ? p.slots[r] : -1;
    if (s < 0) continue;
    uint16_t* block =
        p.kv.pool +
        static_cast<uint64_t>(static_cast<uint32_t>(s) / p.kv.block_tokens) * p.kv.block_elems;
    const uint32_t slot = static_cast<uint32_t>(s) % p.kv.block_tokens;
    for (uint32_t h = 0; h < p.k_heads; ++h) {
      std::memcpy(block + p.kv.offset(p.layer, 0, h, slot),
                  x + static_cast<uint64_t>(p.q_heads + h) * p.head_dim,
                  p.head_dim * sizeof(uint16_t));
      std::memcpy(block + p.kv.offset(p.layer, 1, h, slot),
                  x + static_cast<uint64_t>(p.q_heads + p.k_heads + h) * p.head_dim,
                  p.head_dim * sizeof(uint16_t));
    }
  }
}

}  // namespace duet::kernels
