#pragma once
// Every decoder layer of one batch-1 decode step in one persistent kernel (a "megakernel"):
// the embedding row, per layer RMSNorm, QKV GEMV (+bias), RoPE with the KV append, attention
// over the paged pool, o GEMV, the residual adds, gate/up GEMV, SwiGLU and down GEMV, then the
// final RMSNorm into the LM head's input. One CTA per SM (a cooperative launch, so all are
// resident) and a grid-wide barrier between dependent stages, five per layer. Before each
// barrier a warp already issues the loads of its first weight row of the next GEMV, so the
// weight stream does not drain at a stage boundary as it does between kernels.
//
// The GEMVs sum in the order of the skinny GEMM kernel (gemm.cu) and the norms in the order of
// add_rmsnorm, so apart from attention (fp32 online softmax over a split of the keys per CTA,
// the splits merged by the last CTA of each KV head) the bits equal the kernels run apart.
// References: those kernels' CPU references, and the engine path that runs them apart.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/kernel_status.hpp"
#include "kernels/kv_layout.hpp"

namespace duet::kernels {

/// One layer's weights, bf16 bits, as the engine holds them (QKV and gate/up fused).
struct decode_layer_weights {
  const uint16_t* input_norm = nullptr;
  const uint16_t* qkv = nullptr;       // [q_dim + 2 kv_dim, hidden]
  const uint16_t* qkv_bias = nullptr;  // or nullptr
  const uint16_t* o = nullptr;         // [hidden, q_dim]
  const uint16_t* o_bias = nullptr;    // or nullptr
  const uint16_t* post_norm = nullptr;
  const uint16_t* gate_up = nullptr;  // [2 ffn, hidden]: gate rows, then up
  const uint16_t* down = nullptr;     // [hidden, ffn]
};

struct decode_layers_params {
  const decode_layer_weights* layers = nullptr;  // device array of `layer_count`
  uint32_t layer_count = 0;
  const uint16_t* embedding = nullptr;  // [vocab, hidden]
  const uint16_t* final_norm = nullptr;
  uint32_t vocab = 0;
  uint32_t hidden = 0, heads = 0, kv_heads = 0, ffn = 0;  // head_dim 128
  float eps = 0.0f, scale = 0.0f;
  // The step's one row (device): token, RoPE position, pool slot of the new key, and the keys
  // to attend (positions 0 .. seq_len - 1, the last being the new one) through its block table.
  const int32_t* token = nullptr;
  const int32_t* position = nullptr;
  const int32_t* slot = nullptr;
  const int32_t* seq_len = nullptr;
  const int32_t* block_table = nullptr;
  kv_pool_view kv;
  const float* rope_cos = nullptr;  // [rope_positions, 64]
  const float* rope_sin = nullptr;
  uint32_t rope_positions = 0;
  // Activations (device, bf16): residual [2, hidden] (the two alternate), qkv, attn [q_dim],
  // gate_up [2 ffn], delta [hidden]; out [hidden] is the final norm's output.
  uint16_t* residual = nullptr;
  uint16_t* qkv = nullptr;
  uint16_t* attn = nullptr;
  uint16_t* gate_up = nullptr;
  uint16_t* delta = nullptr;
  uint16_t* out = nullptr;
  void* workspace = nullptr;  // decode_layers_workspace_bytes; the launcher zeroes its counters
  uint32_t poll_ns = 128;     // sleep between two reads of the barrier counter
  uint32_t l2_prefetch_bytes = 0;  // a warp's next weights asked into L2 at each barrier (0: none)
  // Diagnostics (or nullptr): per barrier b and CTA c, globaltimer ns at arrival
  // trace[(2 b) ctas + c] and at release trace[(2 b + 1) ctas + c]; the kernel's start per CTA
  // after the last barrier's pair (decode_layers_trace_words).
  uint64_t* trace = nullptr;
};

/// Barriers one launch passes: five per layer.
[[nodiscard]] DUET_HD uint32_t decode_layers_barriers(uint32_t layers) { return 5 * layers; }
/// Words of decode_layers_params::trace for a grid of `ctas`.
[[nodiscard]] inline uint64_t decode_layers_trace_words(uint32_t layers, uint32_t ctas) {
  return (2ull * decode_layers_barriers(layers) + 1) * ctas;
}

inline constexpr uint32_t decode_layers_max_group = 8;  // query heads per KV head

/// Whether the shape runs in the fused kernel (head_dim 128, group <= 8, sizes multiples of 8).
[[nodiscard]] bool decode_layers_supported(uint32_t hidden, uint32_t heads, uint32_t kv_heads,
                                           uint32_t head_dim, uint32_t ffn);
/// Workspace bytes for a grid of `ctas` (at most the SMs the kernel runs on).
[[nodiscard]] uint64_t decode_layers_workspace_bytes(uint32_t layers, uint32_t heads,
                                                     uint32_t kv_heads, uint32_t ctas);
/// The grid for `sms` SMs: one CTA per SM when one fits (0: the kernel cannot run here).
[[nodiscard]] uint32_t decode_layers_ctas(const decode_layers_params& p, uint32_t sms);
/// Zeroes the barrier and merge counters (a memset on the stream), then launches `ctas` CTAs
/// cooperatively. Capturable in a CUDA graph.
kstatus decode_layers(const decode_layers_params& p, uint32_t ctas, cudaStream_t stream);

}  // namespace duet::kernels
