#include <cublasLt.h>

#include <algorithm>
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
// A CTA computes `rows` consecutive outputs (rows of w) for every row of x (m <= 4; m = 1 has its
// own instantiation, which also takes the SwiGLU input): its threads split k, thread t taking
// 16-byte chunks t, t + threads, ... of every row, `unroll` chunks of each row (rows x unroll
// loads of 16 bytes) in flight before any math; then a warp-shuffle and shared memory reduction.
// The x chunks come from L1/L2. Three shapes (DUET_GEMM_SKINNY_VARIANT, gemm_params):
//   0: 8 rows, 256 threads, 2 chunks per row in flight: 64 KiB per CTA in flight (k = 4096 read
//      in one go), 2 CTAs per SM at m = 1.
//   1: 4 rows, 128 threads, 4 chunks per row in flight: the same 16 loads per thread, 32 KiB per
//      CTA, twice the CTAs; for small n (qkv, o), whose 8-row grids are under three waves.
//   2: split-k: 8 rows, 128 threads, 2 chunks per row in flight, and k cut into `splits` slices,
//      one CTA each (blockIdx.y); each writes its fp32 partial sums to the runner's workspace, the
//      last CTA of a row group to arrive (an atomic ticket, left at zero again for the next launch
//      or graph replay) adds the slices in slice order (deterministic), adds the bias and stores.
//      The launcher picks the splits (skinny_splits); with one split it runs variant 0's kernel.
// Registers (ptxas, CUDA 13, sm_90; no spills) and CTAs per SM they allow, m = 1 / SwiGLU / m = 4:
// variant 0 115 / 106 / 173 (2 / 2 / 1), variant 1 92 / 112 / 142 (5 / 4 / 3), variant 2 94 /
// 107 / 156 (5 / 4 / 3).

constexpr int sk_rows = 8;
constexpr int sk_threads = 256;
constexpr int sk_unroll = 2;
constexpr int sk1_rows = 4, sk1_threads = 128, sk1_unroll = 4;
constexpr int sk2_rows = 8, sk2_threads = 128, sk2_unroll = 2;
constexpr uint32_t sk2_max_splits = 4;
// A slice is at least one full pass of the CTA over k (threads x unroll chunks, 2048 of k).
constexpr uint32_t sk2_min_slice_chunks = sk2_threads * sk2_unroll;
// Splits aim at this many CTAs per SM (4 waves of 4 CTAs of 128 threads at m = 1).
constexpr uint32_t sk2_target_ctas_per_sm = 16;

/// Variant 2's workspace: one ticket per row group, the partial sums per (group, slice).
struct skinny_split {
  float* partials = nullptr;    // [groups, splits, sk2_rows, gemm_skinny_max_rows]
  uint32_t* tickets = nullptr;  // [groups], zero between launches
  uint32_t slice_chunks = 0;    // 16-byte chunks of k per slice (blockIdx.y)
};

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

template <int rows, int threads, int unroll, int max_m, bool swiglu, bool split>
__global__ void __launch_bounds__(threads) skinny_kernel(gemm_params p, skinny_split sp) {
  __shared__ float red[threads / 32][rows][max_m];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t n0 = blockIdx.x * rows;
  const int m = static_cast<int>(p.m);
  const uint4* wrow[rows];
#pragma unroll
  for (int j = 0; j < rows; ++j) {
    wrow[j] =
        reinterpret_cast<const uint4*>(p.w + static_cast<uint64_t>(min(n0 + j, p.n - 1)) * p.k);
  }
  // This CTA's chunks of k: all of them, or slice blockIdx.y.
  uint32_t c_begin = 0, c_end = p.k / 8;
  if constexpr (split) {
    c_begin = blockIdx.y * sp.slice_chunks;
    c_end = min(c_end, c_begin + sp.slice_chunks);
  }
  const uint32_t first = c_begin + tid;
  uint4 wv[unroll][rows];
  auto load_w = [&](uint32_t base) {
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      const uint32_t c = base + u * threads;
#pragma unroll
      for (int j = 0; j < rows; ++j)
        wv[u][j] = c < c_end ? __ldcs(wrow[j] + c) : make_uint4(0, 0, 0, 0);
    }
  };
  // Weights that no earlier kernel writes stream in before the wait for the previous kernel.
  if (p.w_static) load_w(first);
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  if (!p.w_static) load_w(first);
  float acc[rows][max_m] = {};
  for (uint32_t base = first; base < c_end; base += threads * unroll) {
    if (base != first) load_w(base);
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      const uint32_t c = base + u * threads;
      if (c >= c_end) break;
      float x[max_m][8];
#pragma unroll
      for (int r = 0; r < max_m; ++r) {
        if (r < m) x_chunk<swiglu>(p, r, c, x[r]);
      }
#pragma unroll
      for (int j = 0; j < rows; ++j) {
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
  for (int j = 0; j < rows; ++j) {
#pragma unroll
    for (int r = 0; r < max_m; ++r) {
      if (r < m) {
        const float v = dev::warp_sum(acc[j][r]);
        if (lane == 0) red[warp][j][r] = v;
      }
    }
  }
  __syncthreads();
  const bool mine = tid < rows * m;  // thread tid owns output (j, r)
  const int j = mine ? tid / m : 0, r = mine ? tid % m : 0;
  const uint32_t n = n0 + j;
  float v = 0.0f;
  if (mine) {
#pragma unroll
    for (int w = 0; w < threads / 32; ++w) v += red[w][j][r];
  }
  if constexpr (split) {
    // Partial of slice s for (group, j, r); the last CTA of the group sums slices 0, 1, ... in
    // order, so the result does not depend on which CTA arrives last.
    __shared__ bool last_cta;
    const uint32_t splits = gridDim.y;
    const uint64_t group_at = static_cast<uint64_t>(blockIdx.x) * splits;
    constexpr int slot = rows * gemm_skinny_max_rows;
    if (mine) sp.partials[(group_at + blockIdx.y) * slot + j * gemm_skinny_max_rows + r] = v;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      const uint32_t before = atomicAdd(sp.tickets + blockIdx.x, 1u);
      last_cta = before == splits - 1;
      if (last_cta) atomicExch(sp.tickets + blockIdx.x, 0u);  // every slice has arrived
    }
    __syncthreads();
    if (!last_cta) return;
    __threadfence();
    if (mine) {
      v = 0.0f;
      for (uint32_t s = 0; s < splits; ++s)
        v += __ldcg(sp.partials + (group_at + s) * slot + j * gemm_skinny_max_rows + r);
    }
  }
  if (mine && n < p.n) {
    if (p.bias) v += dev::bf(p.bias[n]);
    if (p.y_fp32) {
      static_cast<float*>(p.y)[static_cast<uint64_t>(r) * p.ldy + n] = v;
    } else {
      static_cast<uint16_t*>(p.y)[static_cast<uint64_t>(r) * p.ldy + n] = dev::to_bf(v);
    }
  }
}

/// Slices of k for variant 2 (1 = no split): enough CTAs for sk2_target_ctas_per_sm per SM, at
/// most sk2_max_splits, each slice at least sk2_min_slice_chunks, and the workspace must hold
/// the partials. slice_chunks is a multiple of 8 chunks (128 bytes).
uint32_t skinny_splits(uint32_t groups, uint32_t chunks, uint32_t sms, uint64_t partial_floats,
                       uint32_t tickets, uint32_t& slice_chunks) {
  slice_chunks = chunks;
  const uint64_t target = uint64_t{sms} * sk2_target_ctas_per_sm;
  if (groups >= target || groups > tickets) return 1;
  uint64_t splits = (target + groups - 1) / groups;
  splits = std::min<uint64_t>(splits, sk2_max_splits);
  splits = std::min<uint64_t>(splits, chunks / sk2_min_slice_chunks);
  while (splits > 1 && uint64_t{groups} * splits * sk2_rows * gemm_skinny_max_rows > partial_floats)
    --splits;
  if (splits <= 1) return 1;
  slice_chunks = static_cast<uint32_t>((chunks + splits - 1) / splits + 7) / 8 * 8;
  return (chunks + slice_chunks - 1) / slice_chunks;
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

// Unset or "0": 0; "1", "2": that variant; anything else -1 (run() refuses the skinny path).
int skinny_variant_from_env() {
  const char* v = std::getenv("DUET_GEMM_SKINNY_VARIANT");
  if (!v || !*v || std::strcmp(v, "0") == 0) return 0;
  if (std::strcmp(v, "1") == 0) return 1;
  if (std::strcmp(v, "2") == 0) return 2;
  return -1;
}

template <int rows, int threads, int unroll, bool split>
kstatus launch_skinny(const gemm_params& p, dim3 grid, const skinny_split& sp,
                      cudaStream_t stream) {
  if (p.x_swiglu) {
    DUET_KCHECK(launch(skinny_kernel<rows, threads, unroll, 1, true, split>, grid, dim3(threads), 0,
                       stream, p, sp));
  } else if (p.m == 1) {
    DUET_KCHECK(launch(skinny_kernel<rows, threads, unroll, 1, false, split>, grid, dim3(threads),
                       0, stream, p, sp));
  } else {
    DUET_KCHECK(launch(skinny_kernel<rows, threads, unroll, gemm_skinny_max_rows, false, split>,
                       grid, dim3(threads), 0, stream, p, sp));
  }
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
  // Skinny variant 2 (split-k): tickets zeroed at init and left zero by every launch, partials.
  uint32_t* split_tickets = nullptr;
  float* split_partials = nullptr;
  uint32_t split_ticket_count = 0;
  uint64_t split_partial_floats = 0;
  uint32_t sms = 0;

  ~impl() {
    for (auto& [key, pl] : plans) {
      if (pl.desc) cublasLtMatmulDescDestroy(pl.desc);
      if (pl.a) cublasLtMatrixLayoutDestroy(pl.a);
      if (pl.b) cublasLtMatrixLayoutDestroy(pl.b);
      if (pl.d) cublasLtMatrixLayoutDestroy(pl.d);
    }
    if (workspace) cudaFree(workspace);
    if (split_tickets) cudaFree(split_tickets);
    if (split_partials) cudaFree(split_partials);
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

int gemm_skinny_variant() {
  static const int variant = skinny_variant_from_env();
  return variant;
}

gemm_runner::gemm_runner() : impl_(std::make_unique<impl>()) {}
gemm_runner::~gemm_runner() = default;

kstatus gemm_runner::init(uint64_t workspace_bytes) {
  DUET_LT(cublasLtCreate(&impl_->handle));
  DUET_KCHECK(cudaMalloc(&impl_->workspace, workspace_bytes));
  impl_->workspace_bytes = workspace_bytes;
  // Variant 2 splits only grids under sk2_target_ctas_per_sm CTAs per SM: fewer row groups
  // than that, and (splits <= target / groups + 1) fewer than twice that many (group, slice)
  // partials.
  int device = 0, sms = 0;
  DUET_KCHECK(cudaGetDevice(&device));
  DUET_KCHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  impl_->sms = static_cast<uint32_t>(sms);
  impl_->split_ticket_count = impl_->sms * sk2_target_ctas_per_sm;
  impl_->split_partial_floats =
      uint64_t{2} * impl_->split_ticket_count * sk2_rows * gemm_skinny_max_rows;
  DUET_KCHECK(cudaMalloc(&impl_->split_tickets, uint64_t{impl_->split_ticket_count} * 4));
  DUET_KCHECK(cudaMalloc(&impl_->split_partials, impl_->split_partial_floats * 4));
  // Zeroed on a private stream and waited for, so they are zero before any stream's first launch
  // (no legacy-stream memset or device sync: another thread may be capturing a graph).
  cudaStream_t zero = nullptr;
  DUET_KCHECK(cudaStreamCreateWithFlags(&zero, cudaStreamNonBlocking));
  cudaError_t zeroed =
      cudaMemsetAsync(impl_->split_tickets, 0, uint64_t{impl_->split_ticket_count} * 4, zero);
  if (zeroed == cudaSuccess) zeroed = cudaStreamSynchronize(zero);
  cudaStreamDestroy(zero);
  if (zeroed != cudaSuccess) {  // no split without zeroed tickets
    cudaFree(impl_->split_tickets);
    impl_->split_tickets = nullptr;
  }
  DUET_KCHECK(zeroed);
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
    DUET_KREQUIRE(!p.x_swiglu || p.m == 1, "gemm: SwiGLU input takes one row");
    const int variant = p.skinny_variant < 0 ? gemm_skinny_variant() : p.skinny_variant;
    const skinny_split none{};
    switch (variant) {
      case 0:
        return launch_skinny<sk_rows, sk_threads, sk_unroll, false>(
            p, dim3((p.n + sk_rows - 1) / sk_rows), none, stream);
      case 1:
        return launch_skinny<sk1_rows, sk1_threads, sk1_unroll, false>(
            p, dim3((p.n + sk1_rows - 1) / sk1_rows), none, stream);
      case 2: {
        const uint32_t groups = (p.n + sk2_rows - 1) / sk2_rows;
        skinny_split sp;
        sp.partials = impl_->split_partials;
        sp.tickets = impl_->split_tickets;
        // Without init() (no workspace) no split: variant 0's kernel.
        const uint32_t splits =
            sp.tickets ? skinny_splits(groups, p.k / 8, impl_->sms, impl_->split_partial_floats,
                                       impl_->split_ticket_count, sp.slice_chunks)
                       : 1;
        if (splits == 1) {
          return launch_skinny<sk_rows, sk_threads, sk_unroll, false>(
              p, dim3((p.n + sk_rows - 1) / sk_rows), none, stream);
        }
        return launch_skinny<sk2_rows, sk2_threads, sk2_unroll, true>(p, dim3(groups, splits), sp,
                                                                      stream);
      }
      default:
        return kstatus{cudaErrorInvalidValue,
                       "gemm: skinny variant must be 0, 1 or 2 (gemm_params::skinny_variant, "
                       "DUET_GEMM_SKINNY_VARIANT)",
                       __FILE__, __LINE__};
    }
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
