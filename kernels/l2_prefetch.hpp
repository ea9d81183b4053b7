#pragma once
// Weights that a later kernel of the stream reads, pulled into L2 by CTAs appended to an earlier
// launch. A batch-1 decode step reads 15 GB of weights through GEMVs separated by small kernels
// (norms, RoPE, attention) that leave HBM idle; CTAs of those small kernels that only prefetch
// the next GEMV's weights keep it busy (docs/cuda-engine.md, "L2 prefetch").
#include <algorithm>
#include <cstdint>

namespace duet::kernels {

struct l2_prefetch {
  const void* ptr = nullptr;  // 16-byte aligned
  uint64_t bytes = 0;         // the tail past a multiple of 16 is not prefetched
  uint32_t ctas = 0;          // CTAs appended to the launch that only prefetch; 0: none
};

/// A prefetch of the first `bytes` (at most `cap_bytes`) of `ptr`, one CTA per MiB (1 to 64).
inline l2_prefetch l2_prefetch_of(const void* ptr, uint64_t bytes, uint64_t cap_bytes) {
  const uint64_t take = std::min(bytes, cap_bytes);
  if (!ptr || take < 16) return {};
  const uint64_t mib = take >> 20;
  return {ptr, take, static_cast<uint32_t>(std::clamp<uint64_t>(mib, 1, 64))};
}

}  // namespace duet::kernels
