#include <cublasLt.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "kernels/device_util.cuh"
#include "kernels/gemm.cuh"
#include "kernels/launch.cuh"
#include "kernels/rmsnorm.cuh"

namespace duet::kernels {

namespace {

// ------------------------------------------------------------------------------ skinny kernel
//
// A CTA computes 8 consecutive outputs (8 rows of w) for every row of x (m <= 4; m = 1 has its
// own instantiation, which also takes the SwiGLU input): its 256
// threads split k, thread t taking 16-byte chunks t, t + 256, ... of all 8 rows, two chunks of
// each row (16 loads of 16 bytes) in flight before any math; then a warp-shuffle and shared
// memory reduction. The x chunks come from L1/L2.

constexpr int sk_rows = 8;
constexpr int sk_threads = 256;
constexpr int sk_unroll = 2;
static_assert(sk_threads == rmsnorm_threads, "the norm's sum must run in add_rmsnorm's order");

// What the kernel reads as its input row.
enum class x_mode : int { plain, swiglu, rmsnorm, rmsnorm_scale_last };

template <x_mode mode>
__device__ __forceinline__ void x_chunk(const gemm_params& p, int r, uint32_t c, float& inv,
                                        float (&x)[8]) {
  const uint16_t* row = p.x + static_cast<uint64_t>(r) * p.ldx;
  if constexpr (mode == x_mode::swiglu) {
    float g[8], u[8];
    dev::unpack8(reinterpret_cast<const uint4*>(row)[c], g);
    dev::unpack8(reinterpret_cast<const uint4*>(row + p.k)[c], u);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = dev::rbf(dev::rbf(g[i] / (1.0f + __expf(-g[i]))) * u[i]);
  } else if constexpr (mode == x_mode::rmsnorm) {
    float w[8];
    dev::unpack8(reinterpret_cast<const uint4*>(row)[c], x);
    dev::unpack8(reinterpret_cast<const uint4*>(p.x_norm_weight)[c], w);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = dev::rbf(w[i] * dev::rbf(x[i] * inv));
  } else if constexpr (mode == x_mode::rmsnorm_scale_last) {
    float w[8];
    dev::unpack8(reinterpret_cast<const uint4*>(row)[c], x);
    dev::unpack8(reinterpret_cast<const uint4*>(p.x_norm_weight)[c], w);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      inv = fmaf(x[i], x[i], inv);  // here the running sum of squares (the caller's order)
      x[i] *= w[i];
    }
  } else {
    dev::unpack8(reinterpret_cast<const uint4*>(row)[c], x);
  }
}

// 1 / rms of row 0 of x, summed as rmsnorm_kernel sums: thread t squares chunks t, t + 256, ...
// in order, then warps, then the eight warp sums in order.
__device__ __forceinline__ float inverse_rms(const gemm_params& p) {
  __shared__ float partial[sk_threads / 32];
  float sumsq = 0.0f;
  for (uint32_t c = threadIdx.x; c < p.k / 8; c += sk_threads) {
    float x[8];
    dev::unpack8(reinterpret_cast<const uint4*>(p.x)[c], x);
#pragma unroll
    for (int i = 0; i < 8; ++i) sumsq = fmaf(x[i], x[i], sumsq);
  }
  sumsq = dev::warp_sum(sumsq);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sumsq;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < sk_threads / 32; ++w) total += partial[w];
  return rsqrtf(total / static_cast<float>(p.k) + p.x_norm_eps);
}

// Output row j of this CTA: rows 8b .. 8b + 7, or with RoPE in the epilogue, head elements
// 4g .. 4g + 3 and their rotation partners half + 4g .. (the CTA's group g within its head).
__device__ __forceinline__ uint32_t output_row(const gemm_params& p, int j) {
  if (!p.y_rope.x) return blockIdx.x * sk_rows + j;
  const uint32_t groups = p.y_rope.head_dim / sk_rows;  // CTAs per head
  const uint32_t head = blockIdx.x / groups, g = blockIdx.x % groups;
  return head * p.y_rope.head_dim + (j < 4 ? 0 : p.y_rope.head_dim / 2) + 4 * g + (j & 3);
}

// Thread j (< 8) of a CTA whose rows are four rotated pairs: rope_kernel_vec8's arithmetic on the
// bf16 outputs, then the K and V heads into their slot of the pool.
template <int max_m>
__device__ void rope_epilogue(const gemm_params& p, int j,
                              const float (&red)[sk_threads / 32][sk_rows][max_m], float scale) {
  __shared__ float out[sk_rows];
  const rope_params& rp = p.y_rope;
  const uint32_t n = output_row(p, j);
  float v = 0.0f;
#pragma unroll
  for (int w = 0; w < sk_threads / 32; ++w) v += red[w][j][0];
  v *= scale;
  if (p.bias) v += dev::bf(p.bias[n]);
  out[j] = dev::rbf(v);
  __syncwarp(0xffu);
  const uint32_t head = n / rp.head_dim, d = n % rp.head_dim, half = rp.head_dim / 2;
  uint16_t result = dev::to_bf(out[j]);
  if (head < rp.q_heads + rp.k_heads) {
    int32_t pos = rp.positions[0];
    pos = pos < 0 ? 0 : min(pos, static_cast<int32_t>(rp.max_positions) - 1);
    const uint32_t i = d % half;
    const float c = dev::rbf(rp.cos[static_cast<uint64_t>(pos) * half + i]);
    const float sv = dev::rbf(rp.sin[static_cast<uint64_t>(pos) * half + i]);
    const float a = out[j & 3], b = out[4 + (j & 3)];
    result = j < 4 ? dev::to_bf(dev::rbf(a * c) + dev::rbf(-b * sv))
                   : dev::to_bf(dev::rbf(b * c) + dev::rbf(a * sv));
  }
  static_cast<uint16_t*>(p.y)[n] = result;
  const int32_t s = rp.slots ? rp.slots[0] : -1;
  if (s < 0 || head < rp.q_heads) return;
  const uint32_t kv = head < rp.q_heads + rp.k_heads ? 0 : 1;
  const uint32_t kv_head = head - rp.q_heads - kv * rp.k_heads;
  uint16_t* block = rp.kv.pool + static_cast<uint64_t>(static_cast<uint32_t>(s) / rp.kv.block_tokens) *
                                     rp.kv.block_elems;
  block[rp.kv.offset(rp.layer, kv, kv_head, static_cast<uint32_t>(s) % rp.kv.block_tokens) + d] =
      result;
}

template <int max_m, x_mode mode>
__global__ void __launch_bounds__(sk_threads) skinny_kernel(gemm_params p) {
  __shared__ float red[sk_threads / 32][sk_rows][max_m];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m = static_cast<int>(p.m);
  const uint4* wrow[sk_rows];
#pragma unroll
  for (int j = 0; j < sk_rows; ++j) {
    wrow[j] = reinterpret_cast<const uint4*>(
        p.w + static_cast<uint64_t>(min(output_row(p, j), p.n - 1)) * p.k);
  }
  const uint32_t chunks = p.k / 8;
  uint4 wv[sk_unroll][sk_rows];
  auto load_w = [&](uint32_t base) {
#pragma unroll
    for (int u = 0; u < sk_unroll; ++u) {
      const uint32_t c = base + u * sk_threads;
#pragma unroll
      for (int j = 0; j < sk_rows; ++j)
        wv[u][j] = c < chunks ? __ldcs(wrow[j] + c) : make_uint4(0, 0, 0, 0);
    }
  };
  // Weights that no earlier kernel writes stream in before the wait for the previous kernel.
  if (p.w_static) load_w(tid);
  dev::pdl_wait();
  if (!p.late_dependents) dev::pdl_launch_dependents();
  if (!p.w_static) load_w(tid);
  // The norm's scale, while the first weights are in flight; or, scaling last, the thread's sum
  // of squares over its chunks.
  float inv = mode == x_mode::rmsnorm_scale_last ? 0.0f : 1.0f;
  if constexpr (mode == x_mode::rmsnorm) inv = inverse_rms(p);
  float acc[sk_rows][max_m] = {};
  for (uint32_t base = tid; base < chunks; base += sk_threads * sk_unroll) {
    if (base != static_cast<uint32_t>(tid)) load_w(base);
#pragma unroll
    for (int u = 0; u < sk_unroll; ++u) {
      const uint32_t c = base + u * sk_threads;
      if (c >= chunks) break;
      float x[max_m][8];
#pragma unroll
      for (int r = 0; r < max_m; ++r) {
        if (r < m) x_chunk<mode>(p, r, c, inv, x[r]);
      }
#pragma unroll
      for (int j = 0; j < sk_rows; ++j) {
        float w[8];
        dev::unpack8(wv[u][j], w);
#pragma unroll
        for (int r = 0; r < max_m; ++r) {
          if (r < m) {
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[j][r] = fmaf(x[r][i], w[i], acc[j][r]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < sk_rows; ++j) {
#pragma unroll
    for (int r = 0; r < max_m; ++r) {
      if (r < m) {
        const float v = dev::warp_sum(acc[j][r]);
        if (lane == 0) red[warp][j][r] = v;
      }
    }
  }
  float scale = 1.0f;
  if constexpr (mode == x_mode::rmsnorm_scale_last) {
    __shared__ float squares[sk_threads / 32];
    const float ss = dev::warp_sum(inv);
    if (lane == 0) squares[warp] = ss;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < sk_threads / 32; ++w) total += squares[w];  // add_rmsnorm's order
    scale = rsqrtf(total / static_cast<float>(p.k) + p.x_norm_eps);
  } else {
    __syncthreads();
  }
  if (p.late_dependents) dev::pdl_launch_dependents();
  if (p.y_rope.x) {
    if (tid < sk_rows) rope_epilogue(p, tid, red, scale);
    return;
  }
  if (tid < sk_rows * m) {
    const int j = tid / m, r = tid % m;
    const uint32_t n = blockIdx.x * sk_rows + j;
    if (n < p.n) {
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < sk_threads / 32; ++w) v += red[w][j][r];
      v *= scale;
      if (p.bias) v += dev::bf(p.bias[n]);
      const uint64_t at = static_cast<uint64_t>(r) * p.ldy + n;
      if (p.y_fp32) {
        static_cast<float*>(p.y)[at] = v;
      } else if (p.y_residual) {
        const float sum = dev::bf(p.y_residual[at]) + dev::rbf(v);
        static_cast<uint16_t*>(p.y)[at] = dev::to_bf(sum);
      } else {
        static_cast<uint16_t*>(p.y)[at] = dev::to_bf(v);
      }
    }
  }
}

// ------------------------------------------------------------------------------------ cuBLASLt

#define DUET_LT(call)                                              \
  do {                                                             \
    const cublasStatus_t duet_lt_status = (call);                  \
    if (duet_lt_status != CUBLAS_STATUS_SUCCESS)                   \
      return kstatus{cudaErrorUnknown, #call, __FILE__, __LINE__}; \
  } while (0)

using plan_key = std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, bool, bool>;

struct plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::vector<cublasLtMatmulAlgo_t> candidates;  // untimed yet when non-empty
};

bool skinny_from_env() {
  const char* v = std::getenv("DUET_GEMM_SKINNY");
  return !(v && std::strcmp(v, "0") == 0);
}

bool tune_enabled() {
  const char* v = std::getenv("DUET_GEMM_TUNE");
  return !(v && std::strcmp(v, "0") == 0);
}

}  // namespace

struct gemm_runner::impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  uint64_t workspace_bytes = 0;
  std::map<plan_key, plan> plans;

  ~impl() {
    for (auto& [key, pl] : plans) {
      if (pl.desc) cublasLtMatmulDescDestroy(pl.desc);
      if (pl.a) cublasLtMatrixLayoutDestroy(pl.a);
      if (pl.b) cublasLtMatrixLayoutDestroy(pl.b);
      if (pl.d) cublasLtMatrixLayoutDestroy(pl.d);
    }
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }

  // Column-major view: D^T [n, m] = op(W as col-major [k, n])^T . X^T (col-major [k, m]).
  kstatus make_plan(const gemm_params& p, plan& pl) {
    DUET_LT(cublasLtMatmulDescCreate(&pl.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
    DUET_LT(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                           sizeof(transa)));
    DUET_LT(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                           sizeof(transb)));
    if (p.bias) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bias_type = CUDA_R_16BF;
      DUET_LT(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                             sizeof(epilogue)));
      DUET_LT(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                             &bias_type, sizeof(bias_type)));
    }
    DUET_LT(cublasLtMatrixLayoutCreate(&pl.a, CUDA_R_16BF, p.k, p.n, p.k));
    DUET_LT(cublasLtMatrixLayoutCreate(&pl.b, CUDA_R_16BF, p.k, p.m, p.ldx));
    DUET_LT(
        cublasLtMatrixLayoutCreate(&pl.d, p.y_fp32 ? CUDA_R_32F : CUDA_R_16BF, p.n, p.m, p.ldy));
    cublasLtMatmulPreference_t pref = nullptr;
    DUET_LT(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = workspace_bytes;
    const cublasStatus_t set = cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    cublasLtMatmulHeuristicResult_t results[8];
    int found = 0;
    const cublasStatus_t heur =
        set == CUBLAS_STATUS_SUCCESS
            ? cublasLtMatmulAlgoGetHeuristic(handle, pl.desc, pl.a, pl.b, pl.d, pl.d, pref, 8,
                                             results, &found)
            : set;
    cublasLtMatmulPreferenceDestroy(pref);
    DUET_LT(heur);
    if (found == 0)
      return kstatus{cudaErrorNotSupported, "cuBLASLt has no algorithm for this GEMM", __FILE__,
                     __LINE__};
    pl.algo = results[0].algo;
    // Timing the candidates pays for shapes that recur: decode buckets and full prefill passes
    // (m a multiple of 64); other shapes keep the heuristic's first choice.
    if (found > 1 && tune_enabled() && p.m % 64 == 0) {
      for (int i = 0; i < found; ++i) pl.candidates.push_back(results[i].algo);
    }
    return {};
  }

  kstatus matmul(const gemm_params& p, const plan& pl, const cublasLtMatmulAlgo_t& algo,
                 cudaStream_t stream) {
    const float alpha = 1.0f, beta = 0.0f;
    if (p.bias) {
      DUET_LT(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                             sizeof(p.bias)));
    }
    DUET_LT(cublasLtMatmul(handle, pl.desc, &alpha, p.w, pl.a, p.x, pl.b, &beta, p.y, pl.d, p.y,
                           pl.d, &algo, workspace, workspace_bytes, stream));
    return {};
  }

  // Times every candidate algorithm (3 runs each, after one warm-up) and keeps the fastest.
  kstatus tune(const gemm_params& p, plan& pl, cudaStream_t stream) {
    cudaEvent_t start, stop;
    DUET_KCHECK(cudaEventCreate(&start));
    DUET_KCHECK(cudaEventCreate(&stop));
    float best = 1e30f;
    cublasLtMatmulAlgo_t best_algo = pl.algo;
    for (const auto& algo : pl.candidates) {
      if (!matmul(p, pl, algo, stream).ok()) continue;
      cudaEventRecord(start, stream);
      bool ok = true;
      for (int i = 0; i < 3 && ok; ++i) ok = matmul(p, pl, algo, stream).ok();
      cudaEventRecord(stop, stream);
      if (cudaEventSynchronize(stop) != cudaSuccess) break;
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (ok && ms < best) {
        best = ms;
        best_algo = algo;
      }
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    pl.algo = best_algo;
    pl.candidates.clear();
    DUET_KCHECK(cudaGetLastError());
    return {};
  }
};

bool gemm_skinny_enabled() {
  static const bool enabled = skinny_from_env();
  return enabled;
}

gemm_runner::gemm_runner() : impl_(std::make_unique<impl>()) {}
gemm_runner::~gemm_runner() = default;

kstatus gemm_runner::init(uint64_t workspace_bytes) {
  DUET_LT(cublasLtCreate(&impl_->handle));
  DUET_KCHECK(cudaMalloc(&impl_->workspace, workspace_bytes));
  impl_->workspace_bytes = workspace_bytes;
  return {};
}

kstatus gemm_runner::run(const gemm_params& p, cudaStream_t stream, gemm_path path) {
  DUET_KREQUIRE(p.x && p.w && p.y, "gemm: null pointer");
  DUET_KREQUIRE(p.k % 8 == 0 && p.k > 0 && p.n > 0, "gemm: k must be a positive multiple of 8");
  DUET_KREQUIRE(p.ldx >= (p.x_swiglu ? 2 * p.k : p.k) && p.ldx % 8 == 0,
                "gemm: ldx too small or not a multiple of 8");
  DUET_KREQUIRE(p.ldy >= p.n, "gemm: ldy smaller than n");
  DUET_KREQUIRE(!(p.bias && p.y_fp32), "gemm: bias with fp32 output is not supported");
  if (p.m == 0) return {};
  if (path == gemm_path::automatic) {
    // Measured on the H200 (docs/cuda-engine.md): at m = 1 the skinny kernel beats cuBLASLt on
    // every Llama-8B shape (2.4-3.9 TB/s against 1.5-3.3), at m = 4 it loses (1.1-1.6
    // against 1.7-3.3).
    const bool fused = p.x_swiglu || p.x_norm_weight || p.y_residual || p.y_rope.x;
    path = (fused || (p.m == 1 && gemm_skinny_enabled())) ? gemm_path::skinny
                                                          : gemm_path::cublaslt;
  }
  if (path == gemm_path::skinny) {
    DUET_KREQUIRE(p.m <= gemm_skinny_max_rows,
                  "gemm: the skinny path takes at most gemm_skinny_max_rows rows");
    DUET_KREQUIRE(p.n <= 65535u * sk_rows * 1024u, "gemm: n too large for the skinny path");
    const dim3 grid((p.n + sk_rows - 1) / sk_rows);
    DUET_KREQUIRE(!p.x_swiglu || p.m == 1, "gemm: SwiGLU input takes one row");
    DUET_KREQUIRE(!p.x_norm_weight || (p.m == 1 && !p.x_swiglu),
                  "gemm: an RMSNorm input takes one row and no SwiGLU");
    DUET_KREQUIRE(!(p.y_residual && p.y_fp32), "gemm: a residual add takes bf16 output");
    if (p.y_rope.x) {
      const rope_params& r = p.y_rope;
      DUET_KREQUIRE(p.m == 1 && !p.y_fp32 && !p.y_residual && r.x == p.y && r.rows == 1,
                    "gemm: RoPE in the epilogue takes one bf16 row, y_rope.x = y");
      DUET_KREQUIRE(r.head_dim % 8 == 0 && r.head_dim > 0 &&
                        p.n == (r.q_heads + 2 * r.k_heads) * r.head_dim,
                    "gemm: RoPE in the epilogue needs n = (q_heads + 2 k_heads) * head_dim, "
                    "head_dim a multiple of 8");
      DUET_KREQUIRE(r.positions && r.cos && r.sin && r.max_positions > 0,
                    "gemm: RoPE in the epilogue needs positions and tables");
      DUET_KREQUIRE(!r.slots || (r.kv.pool && r.kv.block_tokens > 0 && r.layer < r.kv.layers &&
                                 r.kv.head_dim == r.head_dim && r.kv.kv_heads == r.k_heads),
                    "gemm: RoPE in the epilogue: bad KV pool, layer or heads");
    }
    if (p.x_swiglu) {
      DUET_KCHECK(launch(skinny_kernel<1, x_mode::swiglu>, grid, dim3(sk_threads), 0, stream, p));
    } else if (p.x_norm_weight && p.x_norm_scale_last) {
      DUET_KCHECK(launch(skinny_kernel<1, x_mode::rmsnorm_scale_last>, grid, dim3(sk_threads), 0,
                         stream, p));
    } else if (p.x_norm_weight) {
      DUET_KCHECK(launch(skinny_kernel<1, x_mode::rmsnorm>, grid, dim3(sk_threads), 0, stream, p));
    } else if (p.m == 1) {
      DUET_KCHECK(launch(skinny_kernel<1, x_mode::plain>, grid, dim3(sk_threads), 0, stream, p));
    } else {
      DUET_KCHECK(launch(skinny_kernel<gemm_skinny_max_rows, x_mode::plain>, grid,
                         dim3(sk_threads), 0, stream, p));
    }
    return {};
  }
  DUET_KREQUIRE(!p.x_swiglu, "gemm: cuBLASLt takes no SwiGLU input; run silu_mul first");
  DUET_KREQUIRE(!p.x_norm_weight && !p.y_residual && !p.y_rope.x,
                "gemm: cuBLASLt takes no RMSNorm input, residual add or RoPE; run their kernels");
  DUET_KREQUIRE(impl_->handle, "gemm: runner not initialised");
  const plan_key key{p.m, p.n, p.k, p.ldx, p.ldy, p.y_fp32, p.bias != nullptr};
  auto it = impl_->plans.find(key);
  if (it == impl_->plans.end()) {
    plan pl;
    const kstatus made = impl_->make_plan(p, pl);
    if (!made.ok()) return made;
    it = impl_->plans.emplace(key, pl).first;
  }
  if (!it->second.candidates.empty()) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    DUET_KCHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing == cudaStreamCaptureStatusNone) {
      const kstatus tuned = impl_->tune(p, it->second, stream);
      if (!tuned.ok()) return tuned;
    }
  }
  return impl_->matmul(p, it->second, it->second.algo, stream);
}

}  // namespace duet::kernels
