// The narrow GEMM: y = x . w^T for 2..64 rows of x (decode batches), bound by reading w once.
//
// cuBLASLt at m = 64 reads the Llama-8B weights at 1.6-3.6 TB/s on the H200 (docs/cuda-engine.md):
// its tiles are cut for large m, so the narrow shapes (n = 4,096 or 6,144) make too few CTAs to
// keep enough bytes in flight. Here a CTA takes 128 rows of w and streams them through shared
// memory (cp.async, four stages of 64 k) with the matching slice of x, and tensor cores
// (mma.sync m16n8k16, w as the A operand, x as B) form the 128 x m tile. Narrow n is split along
// k over up to 8 CTAs of one thread-block cluster, which add their fp32 partial tiles through
// distributed shared memory: no workspace, no second kernel.
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "kernels/device_util.cuh"
#include "kernels/gemm.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {

namespace {

namespace cg = cooperative_groups;

constexpr int nw_rows = 128;  // rows of w per CTA, 16 per warp
constexpr int nw_threads = 256;
constexpr int nw_max_splits = 8;  // the portable cluster size
constexpr int nw_pad = 4;         // floats after each row of the partial tile (bank spread)
constexpr size_t nw_smem_budget = 112 * 1024;  // two CTAs per SM

// Rows of CH chunks of 16 bytes (8 bf16 each), chunk c of row r stored at chunk c ^ (r & 7), so
// ldmatrix over 8 rows of one logical chunk touches 8 distinct bank groups.
template <int CH>
__device__ __forceinline__ int swz_rows(int row, int chunk) {
  return row * CH * 8 + ((chunk ^ (row & 7)) << 3);
}

// x rows staged per stage: at least 16, the rows one ldmatrix.x4 covers for two n8 tiles.
template <int MT>
constexpr int x_rows() {
  return MT < 2 ? 16 : 8 * MT;
}

template <int MT, int CH>
constexpr size_t stage_bytes() {
  return size_t{nw_rows + x_rows<MT>()} * CH * 16;
}

// As many stages as two CTAs per SM leave room for: the bytes in flight set the bandwidth.
template <int MT, int CH>
constexpr int stages() {
  return static_cast<int>(std::min<size_t>(8, nw_smem_budget / stage_bytes<MT, CH>()));
}

static_assert(stages<8, 16>() >= 2, "the pipeline needs two stages");

template <int MT, int CH>
constexpr size_t narrow_smem_bytes() {
  const size_t pipeline = stages<MT, CH>() * stage_bytes<MT, CH>();
  const size_t partial = size_t{x_rows<MT>()} * (nw_rows + nw_pad) * 4;
  return std::max(pipeline, partial);
}

struct k_range {
  uint32_t first, count;  // in tiles of CH * 8
};

// MT n8 tiles of x rows: m <= 8 * MT.
template <int MT, int CH>
__global__ void __launch_bounds__(nw_threads, 2)
    narrow_kernel(gemm_params p, uint32_t per_split, bool rotate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint16_t smem[];
  constexpr int XR = x_rows<MT>();
  constexpr int nw_k = CH * 8, nw_stages = stages<MT, CH>();
  constexpr int stage_elems = (nw_rows + XR) * nw_k;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t n0 = blockIdx.x * nw_rows;
  const uint32_t k_tiles = (p.k + nw_k - 1) / nw_k;
  const k_range kr{blockIdx.y * per_split, min(per_split, k_tiles - blockIdx.y * per_split)};

  auto w_stage = [&](int s) { return smem + s * stage_elems; };
  auto x_stage = [&](int s) { return smem + s * stage_elems + nw_rows * nw_k; };
  // Each CTA starts at its own place along its k range, so the CTAs reading the same x slice
  // at one time are few (x is shared by all of them, and one L2 slice holds each line).
  const uint32_t rot = rotate && kr.count ? blockIdx.x % kr.count : 0;
  auto tile_at = [&](uint32_t t) {
    const uint32_t i = t + rot;
    return kr.first + (i < kr.count ? i : i - kr.count);
  };
  // 128 rows x CH chunks of w; rows past n and k past its end read as 0.
  auto load_w = [&](int s, uint32_t tile) {
    const int chunk = tid % CH;
    const uint32_t kc = tile * nw_k + chunk * 8;
#pragma unroll
    for (int i = 0; i < nw_rows * CH / nw_threads; ++i) {
      const int row = tid / CH + i * (nw_threads / CH);
      const uint32_t n = n0 + row;
      const bool valid = n < p.n && kc < p.k;
      dev::cp_async16(w_stage(s) + swz_rows<CH>(row, chunk),
                      p.w + (valid ? static_cast<uint64_t>(n) * p.k + kc : 0), valid);
    }
  };
  auto load_x = [&](int s, uint32_t tile) {
    for (int c = tid; c < XR * CH; c += nw_threads) {
      const int row = c / CH, chunk = c % CH;
      const uint32_t kc = tile * nw_k + chunk * 8;
      const bool valid = static_cast<uint32_t>(row) < p.m && kc < p.k;
      dev::cp_async16(x_stage(s) + swz_rows<CH>(row, chunk),
                      p.x + (valid ? static_cast<uint64_t>(row) * p.ldx + kc : 0), valid);
    }
  };

  // Weights no earlier kernel writes start streaming before the wait for the previous kernel
  // (PDL); x, which the kernel before wrote, only after it. The first commit group then holds
  // all of the early weight loads, which only makes the first wait stricter.
  if (p.w_static) {
    for (int s = 0; s < nw_stages - 1; ++s)
      if (static_cast<uint32_t>(s) < kr.count) load_w(s, tile_at(s));
  }
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  for (int s = 0; s < nw_stages - 1; ++s) {
    if (static_cast<uint32_t>(s) < kr.count) {
      if (!p.w_static) load_w(s, tile_at(s));
      load_x(s, tile_at(s));
    }
    dev::cp_async_commit();
  }

  float acc[MT][4] = {};
  for (uint32_t t = 0; t < kr.count; ++t) {
    dev::cp_async_wait<nw_stages - 2>();
    __syncthreads();
    const uint32_t next = t + nw_stages - 1;
    if (next < kr.count) {
      load_w(next % nw_stages, tile_at(next));
      load_x(next % nw_stages, tile_at(next));
    }
    dev::cp_async_commit();
    const uint16_t* ws = w_stage(t % nw_stages);
    const uint16_t* xs = x_stage(t % nw_stages);
#pragma unroll
    for (int kk = 0; kk < nw_k / 16; ++kk) {
      uint32_t a[4];
      dev::ldsm_x4(a, ws + swz_rows<CH>(warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                        2 * kk + (lane >> 4)));
#pragma unroll
      for (int np = 0; np < (MT + 1) / 2; ++np) {
        uint32_t b[4];
        dev::ldsm_x4(b, xs + swz_rows<CH>(np * 16 + (lane & 7) + (lane >> 4) * 8,
                                          2 * kk + ((lane >> 3) & 1)));
        dev::mma_bf16(acc[2 * np], a, b[0], b[1]);
        if (2 * np + 1 < MT) dev::mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }
  dev::cp_async_wait<0>();
  __syncthreads();

  // The fp32 partial tile, x row-major: part[r][j] for w row n0 + j.
  float* part = reinterpret_cast<float*>(smem);
  constexpr int ld = nw_rows + nw_pad;
#pragma unroll
  for (int j = 0; j < MT; ++j) {
    const int r = 8 * j + (lane & 3) * 2, row = warp * 16 + (lane >> 2);
    part[r * ld + row] = acc[j][0];
    part[(r + 1) * ld + row] = acc[j][1];
    part[r * ld + row + 8] = acc[j][2];
    part[(r + 1) * ld + row + 8] = acc[j][3];
  }
  const int splits = static_cast<int>(gridDim.y);
  cg::cluster_group cluster = cg::this_cluster();
  if (splits > 1) {
    cluster.sync();
  } else {
    __syncthreads();
  }
  // CTA `rank` of the cluster sums every CTA's partial for its share of the tile's outputs.
  const int rank = splits > 1 ? static_cast<int>(cluster.block_rank()) : 0;
  const int outputs = static_cast<int>(p.m) * nw_rows;
  for (int o = rank * nw_threads + tid; o < outputs; o += splits * nw_threads) {
    const int r = o / nw_rows, j = o % nw_rows;
    const uint32_t n = n0 + j;
    if (n >= p.n) continue;
    float v = 0.0f;
    for (int q = 0; q < splits; ++q) {
      const float* peer = splits > 1 ? cluster.map_shared_rank(part, q) : part;
      v += peer[r * ld + j];
    }
    if (p.bias) v += dev::bf(p.bias[n]);
    if (p.y_fp32) {
      static_cast<float*>(p.y)[static_cast<uint64_t>(r) * p.ldy + n] = v;
    } else {
      static_cast<uint16_t*>(p.y)[static_cast<uint64_t>(r) * p.ldy + n] = dev::to_bf(v);
    }
  }
  // No CTA leaves while another may still read its shared memory.
  if (splits > 1) cluster.sync();
#endif
}

// Splits along k so that the grid makes about two CTAs per SM, at most nw_max_splits, every
// split non-empty.
uint32_t narrow_splits(uint32_t n_tiles, uint32_t k_tiles, int sms) {
  const double want = 2.0 * sms / n_tiles;
  uint32_t splits = static_cast<uint32_t>(std::clamp(want + 0.5, 1.0, double{nw_max_splits}));
  splits = std::min(splits, k_tiles);
  const uint32_t per = (k_tiles + splits - 1) / splits;
  return (k_tiles + per - 1) / per;
}

constexpr int max_devices = 64;

// The SM count of each device, and the shared-memory opt-in of each instantiation on it, set
// once: launches inside decode graphs stay cheap on the host.
template <int MT, int CH>
kstatus prepare_device(int device, int& sms) {
  static std::once_flag once[max_devices];
  static int sm_count[max_devices];
  static cudaError_t status[max_devices];
  std::call_once(once[device], [&] {
    status[device] =
        cudaDeviceGetAttribute(&sm_count[device], cudaDevAttrMultiProcessorCount, device);
    if (status[device] == cudaSuccess) {
      status[device] =
          cudaFuncSetAttribute(narrow_kernel<MT, CH>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(narrow_smem_bytes<MT, CH>()));
    }
  });
  sms = sm_count[device];
  DUET_KCHECK(status[device]);
  return {};
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

template <int MT, int CH>
kstatus launch_narrow(const gemm_params& p, cudaStream_t stream) {
  int device = 0, sms = 0;
  DUET_KCHECK(cudaGetDevice(&device));
  DUET_KREQUIRE(device >= 0 && device < max_devices, "gemm: device index out of range");
  const kstatus prepared = prepare_device<MT, CH>(device, sms);
  if (!prepared.ok()) return prepared;
  constexpr size_t smem = narrow_smem_bytes<MT, CH>();
  const uint32_t n_tiles = (p.n + nw_rows - 1) / nw_rows;
  const uint32_t k_tiles = (p.k + CH * 8 - 1) / (CH * 8);
  const uint32_t splits = narrow_splits(n_tiles, k_tiles, sms);
  const uint32_t per_split = (k_tiles + splits - 1) / splits;
  static const bool rotate = env_int("DUET_GEMM_NARROW_ROT", 1) != 0;

  cudaLaunchConfig_t config{};
  config.gridDim = dim3(n_tiles, splits);
  config.blockDim = dim3(nw_threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = 1;
  attribute[0].val.clusterDim.y = splits;
  attribute[0].val.clusterDim.z = 1;
  attribute[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl_enabled() ? 2 : 1;
  DUET_KCHECK(cudaLaunchKernelEx(&config, narrow_kernel<MT, CH>, p, per_split, rotate));
  return {};
}

template <int MT>
kstatus launch_narrow_rows(const gemm_params& p, cudaStream_t stream) {
  static const int chunks = env_int("DUET_GEMM_NARROW_CH", 8);
  if (chunks == 16) return launch_narrow<MT, 16>(p, stream);
  return launch_narrow<MT, 8>(p, stream);
}

}  // namespace

bool gemm_narrow_supported() {
  static const bool supported = [] {
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
      return false;
    return major >= 9;
  }();
  return supported;
}

kstatus gemm_narrow(const gemm_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(p.m >= 1 && p.m <= gemm_narrow_max_rows,
                "gemm: the narrow path takes 1 to gemm_narrow_max_rows rows");
  DUET_KREQUIRE(!p.x_swiglu, "gemm: the narrow path takes no SwiGLU input");
  DUET_KREQUIRE(p.n <= 65535u * nw_rows, "gemm: n too large for the narrow path");
  DUET_KREQUIRE(gemm_narrow_supported(), "gemm: the narrow path needs compute capability 9.0");
  if (p.m <= 8) return launch_narrow_rows<1>(p, stream);
  if (p.m <= 16) return launch_narrow_rows<2>(p, stream);
  if (p.m <= 32) return launch_narrow_rows<4>(p, stream);
  return launch_narrow_rows<8>(p, stream);
}

}  // namespace duet::kernels
