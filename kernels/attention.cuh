#pragma once
// Causal attention over the paged KV pool (kv_layout.hpp), bf16 in and out, fp32 softmax, GQA
// (query head h reads KV head h / (heads / kv_heads)), head_dim 128.
//
// prefill_attention: the rows of one step's chunks (several sequences packed), each attending
// to every earlier position of its sequence, earlier chunks' KV included (this step's K and V
// must already be in the pool). Flash-attention tiles of 128 queries (32 per warp) x 64 keys on
// bf16 mma.sync, the next K/V tile loading while the current one is computed.
//
// decode_attention: one query row per sequence. One CTA serves all query heads of one KV head
// (the group is one 16-row mma tile) over a range of keys; long contexts are split over up to
// max_splits CTAs, and the last CTA of a (sequence, KV head) to finish merges the partial
// results (flash-decoding), so one launch does the whole step and the launch shape depends only
// on the batch (it can be captured in a CUDA graph while the lengths change).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_status.hpp"
#include "kernels/kv_layout.hpp"

namespace duet::kernels {

struct prefill_attention_params {
  const uint16_t* q = nullptr;  // [rows, q_stride] bf16, head h at column h * 128, RoPE applied
  uint32_t q_stride = 0;        // a multiple of 8
  uint16_t* out = nullptr;      // [rows, out_stride] bf16, head h at column h * 128
  uint32_t out_stride = 0;      // a multiple of 8
  kv_pool_view kv;              // head_dim 128
  uint32_t layer = 0;
  const int32_t* block_table = nullptr;  // every sequence's blocks, concatenated
  const int32_t* seq_rows =
      nullptr;  // [seqs + 1]: sequence s owns rows [seq_rows[s], seq_rows[s + 1])
  const int32_t* seq_start = nullptr;  // [seqs]: position of sequence s's first row
  const int32_t* seq_table = nullptr;  // [seqs]: where sequence s's blocks begin in block_table
  uint32_t seqs = 0;
  uint32_t max_seq_rows = 0;  // the most rows of one sequence (sizes the grid)
  uint32_t heads = 0;
  uint32_t kv_heads = 0;  // divides heads
  float scale = 0.0f;     // softmax scale, 1 / sqrt(head_dim)
  uint32_t variant = 0;   // 0: 128-row tiles, double-buffered K/V; 1: the first, single-buffered
                          // 64-row kernel; 2: 64-row tiles, double-buffered (the earlier default);
                          // 3: variant 0 in 32-key sub-tiles; 4: wgmma, cp.async loads; 5: wgmma,
                          // a TMA producer warp (whole blocks: kv.blocks set, block_tokens a power
                          // of two >= 8, finite values in unused slots); 6: variant 5 with the
                          // warpgroups' S GEMMs in turns; 4 to 6 need compute capability 9.0
                          // (attention_wgmma.cuh)
};

kstatus prefill_attention(const prefill_attention_params& p, cudaStream_t stream);
/// Whether the current device runs variants 4 to 6 (wgmma, built for sm_90a): compute
/// capability 9.0.
[[nodiscard]] bool prefill_attention_wgmma_available();
/// fp64 softmax over the same bf16 inputs; writes bf16.
void prefill_attention_reference(const prefill_attention_params& p);

struct decode_attention_params {
  const uint16_t* q = nullptr;  // [batch, q_stride] bf16, head h at column h * 128, RoPE applied
  uint32_t q_stride = 0;
  uint16_t* out = nullptr;  // [batch, out_stride] bf16
  uint32_t out_stride = 0;
  kv_pool_view kv;  // head_dim 128
  uint32_t layer = 0;
  const int32_t* block_table = nullptr;  // every sequence's blocks, concatenated
  const int32_t* seq_table = nullptr;    // [batch]: where sequence b's blocks begin in block_table
  const int32_t* seq_lens = nullptr;     // [batch]: keys to attend (positions 0 .. len - 1), >= 1
  uint32_t batch = 0;
  uint32_t heads = 0;
  uint32_t kv_heads = 0;  // heads / kv_heads <= 16
  float scale = 0.0f;
  uint32_t max_splits = 1;        // CTAs per (sequence, KV head), <= decode_attention_max_splits
  uint32_t split_min_keys = 128;  // a split gets at least this many keys
  uint32_t variant =
      0;  // 0 (and 2 to 6): double-buffered 16-key warp tiles; 1: the first, single-buffered kernel
  // Workspace (decode_attention_workspace_bytes), the counters zeroed once before first use;
  // every launch leaves them zero again.
  void* workspace = nullptr;
  // The batch the workspace was sized for (0: this launch's batch). Launches of any batch up to it
  // may share the workspace only when it is set: the split counters are placed for it.
  uint32_t workspace_batch = 0;
};

inline constexpr uint32_t decode_attention_max_splits = 64;
/// Bytes of workspace decode_attention needs for `batch` sequences of this shape (and for any
/// smaller batch at no more splits, launched with workspace_batch = batch).
[[nodiscard]] uint64_t decode_attention_workspace_bytes(uint32_t batch, uint32_t heads,
                                                        uint32_t kv_heads, uint32_t max_splits);
/// CTAs of the decode kernel that fit on one SM at once (registers and shared memory, sm_90).
inline constexpr uint32_t decode_attention_ctas_per_sm = 3;

/// The split count for `batch` sequences: the fewest splits (at most decode_attention_max_splits)
/// whose batch x kv_heads x splits CTAs make at least 0.9 of a wave of the SMs and fill their
/// last wave best (0.95 of it suffices), within 4 waves; a batch that alone makes 4 waves or more
/// takes one split. Measured on the H200 (8B shape): batch 64 at one split left a tail wave 0.29
/// full, and three splits took the 8K-context step from 29.4 to 25.1 ms; batch 256 at three
/// splits was 6 % slower than at one (partials and merges), hence the cap.
[[nodiscard]] inline uint32_t decode_attention_splits(uint32_t batch, uint32_t kv_heads,
                                                      uint32_t sm_count) {
  const double slots = double(decode_attention_ctas_per_sm) * sm_count;
  const double ctas = double(batch) * kv_heads;
  if (ctas <= 0 || slots <= 0 || ctas >= 4 * slots) return 1;
  uint32_t best = 1;
  double best_score = -1;
  for (uint32_t s = 1; s <= decode_attention_max_splits; ++s) {
    const double waves = ctas * s / slots;
    if (waves > 4 && best_score >= 0) break;
    const double filled = waves / static_cast<double>(static_cast<uint64_t>(waves + 0.999999));
    // Too few CTAs to fill the GPU count as that fraction of a wave; ties keep fewer splits.
    const double score = waves < 0.9 ? waves * filled : filled;
    if (score > best_score + 0.02) {
      best = s;
      best_score = score;
    }
    if (waves >= 0.9 && filled >= 0.95) break;
  }
  return best;
}

kstatus decode_attention(const decode_attention_params& p, cudaStream_t stream);
void decode_attention_reference(const decode_attention_params& p);

}  // namespace duet::kernels
