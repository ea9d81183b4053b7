#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
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

// -------------------------------------------------------------------------------- bulk kernel
//
// The skinny kernel's CTAs issue all their weight loads at once, wait, reduce and exit: each
// SM's loads come in bursts with gaps while CTAs reduce and start (qkv and o, n = 6144 and
// 4096, stream at 2.7-2.8 TB/s, gate_up at 3.85). A persistent kernel with register double
// buffering was no better (2.8-2.9 on qkv and o, 3.4 on gate_up and down: 64 KB in flight per
// SM against the skinny kernel's 128 KB in bursts). Here one CTA per SM keeps bk_stages
// stages of 32 KB in flight continuously: a producer warp copies 8 rows × 2,048 columns of the
// weight per stage with cp.async.bulk onto a full mbarrier, 4 consumer warps multiply them
// from shared memory against x and free the stage; a CTA walks groups of 8 rows (every k
// stage of a group in turn, so the group's sums stay in registers) with a grid-wide stride.
// Weights are static, so the copies start before the wait for the previous kernel (PDL).

constexpr int bk_rows = 8;
constexpr uint32_t bk_cols = 2048;  // k elements of one row per stage: 4 KB
constexpr int bk_stages = 4;
constexpr int bk_consumers = 128;
constexpr int bk_threads = bk_consumers + 32;
constexpr uint32_t bk_stage_bytes = bk_rows * bk_cols * 2;

template <int max_m>
constexpr size_t bulk_smem_bytes() {
  return size_t{bk_stages} * bk_stage_bytes + 2 * bk_stages * 8 + sizeof(float) * (bk_consumers / 32) * bk_rows * max_m;
}

template <int max_m, bool swiglu>
__global__ void __launch_bounds__(bk_threads, 1) bulk_kernel(gemm_params p, uint32_t k_stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = dev::smem_addr(smem);
  const uint32_t full = base + bk_stages * bk_stage_bytes, empty = full + 8 * bk_stages;
  auto* red = reinterpret_cast<float*>(smem + bk_stages * bk_stage_bytes + 16 * bk_stages);  // [warp][row][m]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int m = static_cast<int>(p.m);
  const uint32_t groups = (p.n + bk_rows - 1) / bk_rows;
  const uint32_t mine = blockIdx.x < groups ? (groups - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const uint32_t items = mine * k_stages;
  if (tid == 0) {
    for (int s = 0; s < bk_stages; ++s) {
      dev::mbar_init(full + 8 * s, 1);
      dev::mbar_init(empty + 8 * s, bk_consumers);
    }
    dev::mbar_init_fence();
  }
  __syncthreads();
  if (warp == bk_consumers / 32) {  // the producer
    if (!p.w_static) dev::pdl_wait();
    dev::pdl_launch_dependents();
    if (lane != 0) return;
    for (uint32_t i = 0; i < items; ++i) {
      const uint32_t s = i % bk_stages, use = i / bk_stages;
      if (use > 0) dev::mbar_wait(empty + 8 * s, (use - 1) & 1);
      const uint32_t group = blockIdx.x + (i / k_stages) * gridDim.x, c0 = (i % k_stages) * bk_cols;
      const uint32_t row_bytes = min(bk_cols, p.k - c0) * 2;
      dev::mbar_arrive_expect_tx(full + 8 * s, row_bytes * bk_rows);
      for (int j = 0; j < bk_rows; ++j) {
        const uint64_t row = min(group * bk_rows + j, p.n - 1);
        dev::bulk_copy_g2s(base + s * bk_stage_bytes + j * bk_cols * 2, p.w + row * p.k + c0, row_bytes, full + 8 * s);
      }
    }
    return;
  }
  dev::pdl_wait();  // x is the previous kernel's output
  if (p.w_static) dev::pdl_launch_dependents();
  float acc[bk_rows][max_m] = {};
  for (uint32_t i = 0; i < items; ++i) {
    const uint32_t s = i % bk_stages, use = i / bk_stages;
    const uint32_t kstage = i % k_stages, c0 = kstage * bk_cols;
    const uint32_t vectors = min(bk_cols, p.k - c0) / 8;
    dev::mbar_wait(full + 8 * s, use & 1);
    const auto* stage = reinterpret_cast<const uint4*>(smem + s * bk_stage_bytes);
#pragma unroll
    for (uint32_t q = 0; q < bk_cols / 8 / bk_consumers; ++q) {
      const uint32_t e = tid + q * bk_consumers;
      if (e >= vectors) break;
      float x[max_m][8];
#pragma unroll
      for (int r = 0; r < max_m; ++r) {
        if (r < m) x_chunk<swiglu>(p, r, c0 / 8 + e, x[r]);
      }
#pragma unroll
      for (int j = 0; j < bk_rows; ++j) {
        float w[8];
        dev::unpack8(stage[j * (bk_cols / 8) + e], w);
#pragma unroll
        for (int r = 0; r < max_m; ++r) {
          if (r < m) {
#pragma unroll
            for (int t = 0; t < 8; ++t) acc[j][r] = fmaf(x[r][t], w[t], acc[j][r]);
          }
        }
      }
    }
    dev::mbar_arrive(empty + 8 * s);
    if (kstage + 1 < k_stages) continue;
    // The group's last stage: its sums across the consumer warps.
    const uint32_t group = blockIdx.x + (i / k_stages) * gridDim.x;
#pragma unroll
    for (int j = 0; j < bk_rows; ++j) {
#pragma unroll
      for (int r = 0; r < max_m; ++r) {
        if (r < m) {
          const float v = dev::warp_sum(acc[j][r]);
          if (lane == 0) red[(warp * bk_rows + j) * max_m + r] = v;
        }
        acc[j][r] = 0.0f;
      }
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(bk_consumers) : "memory");
    if (tid < bk_rows * m) {
      const int j = tid / m, r = tid % m;
      const uint32_t n = group * bk_rows + j;
      if (n < p.n) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < bk_consumers / 32; ++w) v += red[(w * bk_rows + j) * max_m + r];
        if (p.bias) v += dev::bf(p.bias[n]);
        if (p.y_fp32) {
          static_cast<float*>(p.y)[static_cast<uint64_t>(r) * p.ldy + n] = v;
        } else {
          static_cast<uint16_t*>(p.y)[static_cast<uint64_t>(r) * p.ldy + n] = dev::to_bf(v);
        }
      }
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(bk_consumers) : "memory");  // red is written again
  }
#endif
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

// The automatic path's kernel for one row: DUET_GEMV=bulk picks the bulk kernel.
bool bulk_from_env() {
  const char* v = std::getenv("DUET_GEMV");
  return v && std::strcmp(v, "bulk") == 0;
}

template <int max_m, bool swiglu>
kstatus launch_bulk(const gemm_params& p, cudaStream_t stream) {
  int device = 0, sms = 0, major = 0, per_sm = 0;
  DUET_KCHECK(cudaGetDevice(&device));
  DUET_KCHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  DUET_KREQUIRE(major >= 9, "gemm: the bulk path needs compute capability 9.0 (cp.async.bulk)");
  DUET_KCHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  constexpr size_t smem = bulk_smem_bytes<max_m>();
  // Once per device, on the eager warm-up before any decode graph is captured.
  static std::array<std::atomic<int>, 64> blocks_per_sm{};
  DUET_KREQUIRE(device >= 0 && device < 64, "gemm: device ordinal out of range");
  per_sm = blocks_per_sm[device].load();
  if (per_sm == 0) {
    DUET_KCHECK(cudaFuncSetAttribute(bulk_kernel<max_m, swiglu>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
    DUET_KCHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bulk_kernel<max_m, swiglu>, bk_threads, smem));
    DUET_KREQUIRE(per_sm > 0, "gemm: the bulk kernel does not fit on an SM");
    blocks_per_sm[device].store(per_sm);
  }
  const uint32_t groups = (p.n + bk_rows - 1) / bk_rows;
  const uint32_t grid = std::min<uint32_t>(groups, static_cast<uint32_t>(std::max(1, sms * per_sm)));
  const uint32_t k_stages = (p.k + bk_cols - 1) / bk_cols;
  DUET_KCHECK(launch(bulk_kernel<max_m, swiglu>, dim3(grid), dim3(bk_threads), smem, stream, p, k_stages));
  return {};
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
    cublasLtMatmulHeuristicResult_t results[16];
    int found = 0;
    const cublasStatus_t heur =
        set == CUBLAS_STATUS_SUCCESS
            ? cublasLtMatmulAlgoGetHeuristic(handle, pl.desc, pl.a, pl.b, pl.d, pl.d, pref, 16,
                                             results, &found)
            : set;
    cublasLtMatmulPreferenceDestroy(pref);
    DUET_LT(heur);
    if (found == 0)
      return kstatus{cudaErrorNotSupported, "cuBLASLt has no algorithm for this GEMM", __FILE__,
                     __LINE__};
    pl.algo = results[0].algo;
    // Timing the candidates pays for shapes that recur: decode buckets (powers of two) and full
    // prefill passes (m a multiple of 64); other shapes keep the heuristic's first choice.
    const bool recurs = p.m % 64 == 0 || (p.m & (p.m - 1)) == 0;
    if (tune_enabled() && recurs) {
      for (int i = 0; i < found; ++i) pl.candidates.push_back(results[i].algo);
      if (p.m <= 256) add_split_k(pl, found, results);
      if (pl.candidates.size() < 2) pl.candidates.clear();
    }
    return {};
  }

  // Decode's GEMMs have few rows: the heuristic's tiles of 64-256 outputs give n = 4096-6144 only
  // 16-96 CTAs on 132 SMs, so the weights stream from a fraction of them (cuBLASLt read the qkv
  // and o weights at 1.5-1.6 TB/s at m = 64). Splitting k across CTAs fills the SMs; every
  // split the library accepts (cublasLtMatmulAlgoCheck, within the workspace) is timed too.
  void add_split_k(plan& pl, int found, const cublasLtMatmulHeuristicResult_t* results) {
    for (int i = 0; i < found; ++i) {
      int32_t support = 0;
      uint32_t schemes = 0;
      size_t written = 0;
      if (cublasLtMatmulAlgoCapGetAttribute(&results[i].algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &support,
                                            sizeof(support), &written) != CUBLAS_STATUS_SUCCESS ||
          !support)
        continue;
      if (cublasLtMatmulAlgoCapGetAttribute(&results[i].algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &schemes,
                                            sizeof(schemes), &written) != CUBLAS_STATUS_SUCCESS)
        continue;
      uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
      for (const uint32_t s : {CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE,
                               CUBLASLT_REDUCTION_SCHEME_INPLACE}) {
        if (schemes & s) {
          scheme = s;
          break;
        }
      }
      if (scheme == CUBLASLT_REDUCTION_SCHEME_NONE) continue;
      for (const uint32_t splits : {2u, 3u, 4u, 6u, 8u, 12u}) {
        cublasLtMatmulAlgo_t algo = results[i].algo;
        cublasLtMatmulHeuristicResult_t checked{};
        if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                                 sizeof(splits)) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                 sizeof(scheme)) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoCheck(handle, pl.desc, pl.a, pl.b, pl.d, pl.d, &algo, &checked) !=
                CUBLAS_STATUS_SUCCESS ||
            checked.workspaceSize > workspace_bytes)
          continue;
        pl.candidates.push_back(algo);
      }
    }
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

bool gemm_bulk_default() {
  static const bool enabled = bulk_from_env();
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
    if (path == gemm_path::skinny && gemm_bulk_default()) path = gemm_path::bulk;
  }
  if (path == gemm_path::bulk) {
    DUET_KREQUIRE(p.m <= gemm_skinny_max_rows, "gemm: the bulk path takes at most gemm_skinny_max_rows rows");
    DUET_KREQUIRE(!p.x_swiglu || p.m == 1, "gemm: SwiGLU input takes one row");
    if (p.x_swiglu) return launch_bulk<1, true>(p, stream);
    if (p.m == 1) return launch_bulk<1, false>(p, stream);
    return launch_bulk<gemm_skinny_max_rows, false>(p, stream);
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
