#pragma once
// y = x . w^T (+ bias): bf16 operands, fp32 accumulation, bf16 or fp32 output. Weights are
// row-major [n, k] as Hugging Face stores them. Large m goes through cuBLASLt (algorithm picked
// per shape; for m a multiple of 64 the candidates are timed on first use outside graph
// capture); m <= gemm_skinny_max_rows can use a bandwidth-bound kernel of our own (picked for m =
// 1), which may also apply SwiGLU (x = silu_mul(gate_up), silu_mul.cuh) or RMSNorm (rmsnorm.cuh)
// to its input on the fly and add its output to the residual stream.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "kernels/kernel_status.hpp"
#include "kernels/rope.cuh"

namespace duet::kernels {

inline constexpr uint32_t gemm_skinny_max_rows = 4;

/// Whether the automatic path may pick the skinny kernel for m = 1 (DUET_GEMM_SKINNY=0 turns it
/// off).
[[nodiscard]] bool gemm_skinny_enabled();

struct gemm_params {
  const uint16_t* x =
      nullptr;       // [m, ldx] bf16 (with x_swiglu: [m, ldx] holding gate | up, 2k wide)
  uint32_t ldx = 0;  // elements between rows of x
  const uint16_t* w = nullptr;     // [n, k] bf16, row-major
  const uint16_t* bias = nullptr;  // [n] bf16 or nullptr
  void* y = nullptr;               // [m, ldy] bf16, or fp32 when y_fp32
  uint32_t ldy = 0;
  uint32_t m = 0, n = 0, k = 0;
  bool y_fp32 = false;
  bool x_swiglu =
      false;  // skinny path only: x[r][i] = bf16(bf16(silu(gate[r][i])) * up[r][i]); best at m = 1
  // w is never written by kernels queued earlier on the stream (model weights): the skinny path
  // then loads its first weight chunks before waiting for the previous kernel (PDL), so a GEMV's
  // weight stream starts while the kernel before it finishes.
  bool w_static = false;
  // Skinny path, m = 1: x is the residual stream and the GEMV reads its RMSNorm instead,
  // bf16(x_norm_weight[i] * bf16(x[i] * rsqrt(mean(x^2) + x_norm_eps))), summed in the order
  // add_rmsnorm sums (the same bits), so the norm kernel before a batch-1 GEMV is not needed.
  const uint16_t* x_norm_weight = nullptr;
  float x_norm_eps = 0.0f;
  // With x_norm_weight: sum x_norm_weight * x against the weights and scale the sums by the
  // norm's 1/rms at the end (the same 1/rms bits), so no CTA waits for the norm before its main
  // loop; the normalized input is then not rounded to bf16 (within bf16 noise of the above).
  bool x_norm_scale_last = false;
  // Let the next kernel's CTAs launch (PDL) only after this one's main loop, not at its start.
  bool late_dependents = false;
  // Skinny path, bf16 output: y = bf16(y_residual + bf16(x . w^T + bias)), the layer's residual
  // add as add_rmsnorm does it; y may be y_residual itself (each output reads only its own slot).
  const uint16_t* y_residual = nullptr;
  // Skinny path, m = 1, bf16 output: when y_rope.x is set (to y), rope_apply's RoPE and KV append
  // (rope.cuh; y_rope.rows = 1) on the output row, a packed q | k | v row: the same bits without
  // the launch. A CTA then takes both halves of four rotated pairs instead of eight rows in a row.
  rope_params y_rope{};
};

enum class gemm_path : uint8_t { automatic, cublaslt, skinny };

/// One cuBLASLt handle, its workspace and the per-shape plans; one per stream owner.
class gemm_runner {
 public:
  gemm_runner();
  ~gemm_runner();
  gemm_runner(const gemm_runner&) = delete;
  gemm_runner& operator=(const gemm_runner&) = delete;

  /// Creates the handle and a workspace on the current device.
  kstatus init(uint64_t workspace_bytes = 32ull << 20);
  /// automatic: skinny for m = 1 (unless disabled) or whenever x_swiglu, x_norm_weight or
/// y_residual is set, cuBLASLt otherwise;
  /// skinny takes m <= gemm_skinny_max_rows when asked for.
  kstatus run(const gemm_params& p, cudaStream_t stream, gemm_path path = gemm_path::automatic);

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// fp32 accumulation over the same bf16 inputs (output rounded to bf16 unless y_fp32).
void gemm_reference(const gemm_params& p);

}  // namespace duet::kernels
