#include <cublasLt.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>
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

using plan_key = std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, bool, bool, bool>;

struct plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the algorithms tuning times (or timed)
  bool tuned = false;
};

// Rows up to which a GEMM reads its weight once per call from HBM, as decode does: each layer's
// weights are evicted from L2 by the other layers' before the next step comes back to them.
constexpr uint32_t weight_streaming_max_rows = 256;

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

// DUET_GEMM_TUNE: "0" keeps the heuristic's first choice; "hot" times the heuristic's candidates
// three times back to back on one weight (duet's rule before 2026-12-06); anything else (the
// default) times GEMMs of up to weight_streaming_max_rows rows with their weight evicted from L2
// before each run, as a decode step reads it. (Split-k variants of the heuristic's candidates,
// timed this way on an H100 on 2026-12-06, won nothing: docs/cuda-engine.md.)
enum class tune_mode : uint8_t { off, hot, cold };

tune_mode tune_mode_from_env() {
  const char* v = std::getenv("DUET_GEMM_TUNE");
  if (v && std::strcmp(v, "0") == 0) return tune_mode::off;
  if (v && std::strcmp(v, "hot") == 0) return tune_mode::hot;
  return tune_mode::cold;
}

tune_mode tuning() {
  static const tune_mode mode = tune_mode_from_env();
  return mode;
}

// DUET_GEMM_TUNE_ORDER=seq: each candidate's runs one after another, their mean kept (the rule
// before 2026-12-06, late); otherwise in rounds (tuning_trial_order): a prefill pass tunes while
// the card climbs to its power limit, and in candidate order the later ones ran on a hotter card.
bool tune_interleaved() {
  static const bool interleaved = [] {
    const char* v = std::getenv("DUET_GEMM_TUNE_ORDER");
    return !(v && std::strcmp(v, "seq") == 0);
  }();
  return interleaved;
}

// Shapes worth timing: decode buckets (powers of two up to 32, then multiples of 32;
// runtime/decode_buckets.hpp) and full prefill passes (multiples of 64). Other shapes keep the
// heuristic's first choice, since a chunk's odd tail would otherwise pay for a tuning pass of its
// own in the middle of serving.
bool worth_tuning(uint32_t m) {
  if (m % 64 == 0) return true;
  return tuning() == tune_mode::cold && m <= weight_streaming_max_rows &&
         ((m & (m - 1)) == 0 || m % 32 == 0);
}

// Reads a buffer twice L2's size so that whatever it held before (a weight just timed) is gone.
__global__ void l2_evict_kernel(const uint4* __restrict__ buf, uint64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint4 v = buf[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads; the value is never read
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

  kstatus plan_for(const gemm_params& p, plan*& out) {
    DUET_KREQUIRE(handle, "gemm: runner not initialised");
    const plan_key key{p.m, p.n, p.k, p.ldx, p.ldy, p.y_fp32, p.bias != nullptr, p.accumulate};
    auto it = plans.find(key);
    if (it == plans.end()) {
      plan pl;
      const uint32_t bucket = gemm_plan_rows(p.m);
      const kstatus made = bucket != p.m ? derive_plan(p, bucket, pl) : make_plan(p, pl);
      if (!made.ok()) return made;
      it = plans.emplace(key, pl).first;
    }
    out = &it->second;
    return {};
  }

  // A shape between buckets runs its bucket's algorithm (tuned, when the bucket has run): asking
  // cuBLASLt's heuristic for every new prompt length cost a prefill step 10-20 ms on the host
  // in serving (docs/cuda-engine.md). Falls back to the heuristic when cuBLASLt refuses it.
  kstatus derive_plan(const gemm_params& p, uint32_t bucket, plan& pl) {
    gemm_params q = p;
    q.m = bucket;
    plan* base = nullptr;
    const kstatus got = plan_for(q, base);
    if (!got.ok()) return got;
    const kstatus made = make_layouts(p, pl);
    if (!made.ok()) return made;
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(handle, pl.desc, pl.a, pl.b, pl.d, pl.d, &base->algo, &check) ==
            CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= workspace_bytes) {
      pl.algo = base->algo;
      pl.candidates = {base->algo};
      pl.tuned = true;
      return {};
    }
    destroy(pl);
    pl = plan{};
    return make_plan(p, pl);
  }

  static void destroy(plan& pl) {
    if (pl.desc) cublasLtMatmulDescDestroy(pl.desc);
    if (pl.a) cublasLtMatrixLayoutDestroy(pl.a);
    if (pl.b) cublasLtMatrixLayoutDestroy(pl.b);
    if (pl.d) cublasLtMatrixLayoutDestroy(pl.d);
  }

  // Column-major view: D^T [n, m] = op(W as col-major [k, n])^T . X^T (col-major [k, m]).
  kstatus make_layouts(const gemm_params& p, plan& pl) {
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
    return {};
  }

  kstatus make_plan(const gemm_params& p, plan& pl) {
    const kstatus made = make_layouts(p, pl);
    if (!made.ok()) return made;
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
    for (int i = 0; i < found; ++i) pl.candidates.push_back(results[i].algo);
    pl.tuned = pl.candidates.size() < 2 || tuning() == tune_mode::off || !worth_tuning(p.m);
    return {};
  }

  /// D = x . w^T (+ bias) (+ y with accumulate) into `out`, p.y when null (tuning's trial runs of
  /// an accumulating GEMM go to a scratch copy).
  kstatus matmul(const gemm_params& p, const plan& pl, const cublasLtMatmulAlgo_t& algo,
                 cudaStream_t stream, void* out = nullptr) {
    const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
    if (p.bias) {
      DUET_LT(cublasLtMatmulDescSetAttribute(pl.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                             sizeof(p.bias)));
    }
    DUET_LT(cublasLtMatmul(handle, pl.desc, &alpha, p.w, pl.a, p.x, pl.b, &beta, p.y, pl.d,
                           out ? out : p.y, pl.d, &algo, workspace, workspace_bytes, stream));
    return {};
  }

  // Keeps the fastest candidate. Each runs once untimed first, then 5 timed runs in rounds
  // (tune_interleaved; in a row: 3, or 5 with L2 evicted). A decode-sized GEMM (cold tuning) runs each after L2 is refilled with
  // other data, as it runs in a step; a larger one right after the run before, as a prefill pass
  // runs them.
  kstatus tune(const gemm_params& p, plan& pl, cudaStream_t stream) {
    // An accumulating GEMM's trials read y and write a scratch copy of it: y must be added to once.
    void* scratch = nullptr;
    if (p.accumulate) {
      const uint64_t bytes = (uint64_t{p.m - 1} * p.ldy + p.n) * (p.y_fp32 ? 4 : 2);
      if (cudaMallocAsync(&scratch, bytes, stream) != cudaSuccess) {
        (void)cudaGetLastError();
        if (log_enabled())
          std::fprintf(stderr, "gemm tune m=%u: no memory for an accumulating GEMM's trials\n", p.m);
        pl.tuned = true;  // the heuristic's first choice
        return {};
      }
    }
    void* evict = nullptr;
    uint64_t evict_bytes = 0;
    if (tuning() == tune_mode::cold && p.m <= weight_streaming_max_rows) {
      int device = 0, l2 = 0;
      DUET_KCHECK(cudaGetDevice(&device));
      DUET_KCHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
      evict_bytes = 2 * static_cast<uint64_t>(l2);
      // Stream-ordered, so that tuning during serving stalls no other stream on the device.
      if (cudaMallocAsync(&evict, evict_bytes, stream) != cudaSuccess) {
        (void)cudaGetLastError();
        evict = nullptr;
        if (log_enabled())
          std::fprintf(stderr, "gemm tune m=%u: no memory to evict L2, timing back to back\n",
                       p.m);
      }
    }
    const std::size_t count = pl.candidates.size();
    std::vector<char> usable(count, 0);
    for (std::size_t i = 0; i < count; ++i)  // untimed: each algorithm's first run
      usable[i] = matmul(p, pl, pl.candidates[i], stream, scratch).ok();
    const bool interleaved = tune_interleaved();
    const uint32_t runs = interleaved || evict ? 5 : 3;
    std::vector<cudaEvent_t> marks(2 * runs * count, nullptr);
    for (cudaEvent_t& e : marks) DUET_KCHECK(cudaEventCreate(&e));
    auto mark = [&](std::size_t i, uint32_t r, int end) -> cudaEvent_t& {
      return marks[(i * runs + r) * 2 + end];
    };
    for (const tuning_trial& t : tuning_trial_order(static_cast<uint32_t>(count), runs, interleaved)) {
      if (!usable[t.candidate]) continue;
      if (evict) {
        l2_evict_kernel<<<512, 256, 0, stream>>>(static_cast<const uint4*>(evict),
                                                 evict_bytes / 16, static_cast<uint32_t*>(evict));
      }
      cudaEventRecord(mark(t.candidate, t.round, 0), stream);
      if (!matmul(p, pl, pl.candidates[t.candidate], stream, scratch).ok()) usable[t.candidate] = 0;
      cudaEventRecord(mark(t.candidate, t.round, 1), stream);
    }
    const bool synced = cudaStreamSynchronize(stream) == cudaSuccess;
    float best = 1e30f, first = 0;
    int best_index = -1;
    cublasLtMatmulAlgo_t best_algo = pl.algo;
    for (std::size_t i = 0; i < count && synced; ++i) {
      if (!usable[i]) continue;
      std::vector<float> times(runs);
      for (uint32_t r = 0; r < runs; ++r)
        cudaEventElapsedTime(&times[r], mark(i, r, 0), mark(i, r, 1));
      const float ms = tuning_trial_time(std::move(times), interleaved);
      if (i == 0) first = ms;
      if (ms < best) {
        best = ms;
        best_algo = pl.candidates[i];
        best_index = static_cast<int>(i);
      }
    }
    for (cudaEvent_t& e : marks) cudaEventDestroy(e);
    if (evict) cudaFreeAsync(evict, stream);
    if (scratch) cudaFreeAsync(scratch, stream);
    if (log_enabled()) {
      std::fprintf(stderr,
                   "gemm tune m=%u n=%u k=%u: %zu candidates, %s, heuristic's first %.3f ms, kept "
                   "#%d %.3f ms (%s)\n",
                   p.m, p.n, p.k, pl.candidates.size(), evict ? "L2 evicted" : "back to back",
                   first, best_index, best, describe(best_algo).c_str());
    }
    pl.algo = best_algo;
    pl.tuned = true;
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

kstatus gemm_runner::candidates(const gemm_params& p, std::size_t& count) {
  plan* pl = nullptr;
  DUET_KREQUIRE(!p.x_swiglu, "gemm: cuBLASLt takes no SwiGLU input");
  const kstatus got = impl_->plan_for(p, pl);
  if (!got.ok()) return got;
  count = pl->candidates.size();
  return {};
}

kstatus gemm_runner::run_candidate(const gemm_params& p, std::size_t index, cudaStream_t stream) {
  plan* pl = nullptr;
  const kstatus got = impl_->plan_for(p, pl);
  if (!got.ok()) return got;
  DUET_KREQUIRE(index < pl->candidates.size(), "gemm: no such candidate");
  return impl_->matmul(p, *pl, pl->candidates[index], stream);
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
    path = (p.x_swiglu || (p.m == 1 && !p.accumulate && gemm_skinny_enabled()))
               ? gemm_path::skinny
               : gemm_path::cublaslt;
  }
  if (path == gemm_path::skinny) {
    DUET_KREQUIRE(!p.accumulate, "gemm: the skinny path does not accumulate into y");
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
  plan* pl = nullptr;
  const kstatus got = impl_->plan_for(p, pl);
  if (!got.ok()) return got;
  if (!pl->tuned) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    DUET_KCHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing == cudaStreamCaptureStatusNone) {
      const kstatus tuned = impl_->tune(p, *pl, stream);
      if (!tuned.ok()) return tuned;
    }
  }
  return impl_->matmul(p, *pl, pl->algo, stream);
}

}  // namespace duet::kernels
