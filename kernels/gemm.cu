#include <cublasLt.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/device_util.cuh"
#include "kernels/gemm.cuh"
#include "kernels/launch.cuh"

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

template <bool swiglu>
__device__ __forceinline__ void x_chunk(const gemm_params& p, int r, uint32_t c, float (&x)[8]) {
  const uint16_t* row = p.x + static_cast<uint64_t>(r) * p.ldx;
  if constexpr (swiglu) {
    float g[8], u[8];
    dev::unpack8(reinterpret_cast<const uint4*>(row)[c], g);
    dev::unpack8(reinterpret_cast<const uint4*>(row + p.k)[c], u);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = dev::rbf(dev::rbf(g[i] / (1.0f + __expf(-g[i]))) * u[i]);
  } else {
    dev::unpack8(reinterpret_cast<const uint4*>(row)[c], x);
  }
}

template <int max_m, bool swiglu>
__global__ void __launch_bounds__(sk_threads) skinny_kernel(gemm_params p) {
  __shared__ float red[sk_threads / 32][sk_rows][max_m];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t n0 = blockIdx.x * sk_rows;
  const int m = static_cast<int>(p.m);
  const uint4* wrow[sk_rows];
#pragma unroll
  for (int j = 0; j < sk_rows; ++j) {
    wrow[j] =
        reinterpret_cast<const uint4*>(p.w + static_cast<uint64_t>(min(n0 + j, p.n - 1)) * p.k);
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
  dev::pdl_launch_dependents();
  if (!p.w_static) load_w(tid);
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
        if (r < m) x_chunk<swiglu>(p, r, c, x[r]);
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
  __syncthreads();
  if (tid < sk_rows * m) {
    const int j = tid / m, r = tid % m;
    const uint32_t n = n0 + j;
    if (n < p.n) {
      float v = 0.0f;
#pragma unroll
      for (int w = 0; w < sk_threads / 32; ++w) v += red[w][j][r];
      if (p.bias) v += dev::bf(p.bias[n]);
      if (p.y_fp32) {
        static_cast<float*>(p.y)[static_cast<uint64_t>(r) * p.ldy + n] = v;
      } else {
        static_cast<uint16_t*>(p.y)[static_cast<uint64_t>(r) * p.ldy + n] = dev::to_bf(v);
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

// DUET_GEMM_LOG=1: each tuned shape prints the heuristic's first choice and the kept one.
bool log_enabled() {
  const char* v = std::getenv("DUET_GEMM_LOG");
  return v && std::strcmp(v, "1") == 0;
}

// The algorithm's id, tile, stages and split-k, as cuBLASLt numbers them (for DUET_GEMM_LOG).
std::string describe(const cublasLtMatmulAlgo_t& algo) {
  int id = 0, tile = 0, stages = 0, splits = 0;
  size_t got = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &got);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile,
                                       &got);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                       sizeof stages, &got);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                       sizeof splits, &got);
  return "algo " + std::to_string(id) + " tile " + std::to_string(tile) + " stages " +
         std::to_string(stages) + " split-k " + std::to_string(splits);
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
    // Asking for more than 8 returned 8 on every Llama-8B shape (cuBLAS 13.0, H200).
    constexpr int wanted = 8;
    cublasLtMatmulHeuristicResult_t results[wanted];
    int found = 0;
    const cublasStatus_t heur =
        set == CUBLAS_STATUS_SUCCESS
            ? cublasLtMatmulAlgoGetHeuristic(handle, pl.desc, pl.a, pl.b, pl.d, pl.d, pref, wanted,
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
    float best = 1e30f, first = 0;
    int best_index = -1;
    cublasLtMatmulAlgo_t best_algo = pl.algo;
    for (std::size_t i = 0; i < pl.candidates.size(); ++i) {
      const cublasLtMatmulAlgo_t& algo = pl.candidates[i];
      if (!matmul(p, pl, algo, stream).ok()) continue;
      cudaEventRecord(start, stream);
      bool ok = true;
      for (int r = 0; r < 3 && ok; ++r) ok = matmul(p, pl, algo, stream).ok();
      cudaEventRecord(stop, stream);
      if (cudaEventSynchronize(stop) != cudaSuccess) break;
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (i == 0) first = ms / 3;
      if (ok && ms < best) {
        best = ms;
        best_algo = algo;
        best_index = static_cast<int>(i);
      }
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (log_enabled()) {
      std::fprintf(stderr,
                   "gemm tune m=%u n=%u k=%u: %zu candidates, heuristic's first %.3f ms, kept #%d "
                   "%.3f ms (%s)\n",
                   p.m, p.n, p.k, pl.candidates.size(), first, best_index, best / 3,
                   describe(best_algo).c_str());
    }
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
    path = (p.x_swiglu || (p.m == 1 && gemm_skinny_enabled())) ? gemm_path::skinny
                                                               : gemm_path::cublaslt;
  }
  if (path == gemm_path::skinny) {
    DUET_KREQUIRE(p.m <= gemm_skinny_max_rows,
                  "gemm: the skinny path takes at most gemm_skinny_max_rows rows");
    DUET_KREQUIRE(p.n <= 65535u * sk_rows * 1024u, "gemm: n too large for the skinny path");
    const dim3 grid((p.n + sk_rows - 1) / sk_rows);
    DUET_KREQUIRE(!p.x_swiglu || p.m == 1, "gemm: SwiGLU input takes one row");
    if (p.x_swiglu) {
      DUET_KCHECK(launch(skinny_kernel<1, true>, grid, dim3(sk_threads), 0, stream, p));
    } else if (p.m == 1) {
      DUET_KCHECK(launch(skinny_kernel<1, false>, grid, dim3(sk_threads), 0, stream, p));
    } else {
      DUET_KCHECK(
          launch(skinny_kernel<gemm_skinny_max_rows, false>, grid, dim3(sk_threads), 0, stream, p));
    }
    return {};
  }
  DUET_KREQUIRE(!p.x_swiglu, "gemm: cuBLASLt takes no SwiGLU input; run silu_mul first");
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
