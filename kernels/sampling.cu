#include <cfloat>

#include "kernels/device_util.cuh"
#include "kernels/launch.cuh"
#include "kernels/sampling.cuh"
#include "kernels/sampling_common.hpp"

namespace duet::kernels {

namespace {

using sampling_detail::key_of;
using sampling_detail::mass_of;

constexpr int threads = 1024;
constexpr int warps = threads / 32;
constexpr int top_cap = 256;  // candidates gathered for the top-N list

struct shared_state {
  unsigned long long hist[256];
  float f[warps];
  float g[warps];
  int i[warps];
  double d[warps];
  unsigned long long u[warps];
  uint32_t selected;
  bool found;
  int cand_count;
  int cand_id[top_cap];
  float cand_val[top_cap];
  int token;
};

// (max, sum of exp, first argmax) of the raw logits.
struct max_sum {
  float m;
  float s;
  int idx;
};

__device__ uint64_t block_sum_u64(uint64_t v, shared_state& sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.u[threadIdx.x >> 5] = v;
  __syncthreads();
  uint64_t total = 0;
  for (int w = 0; w < warps; ++w) total += sh.u[w];
  return total;
}

// The largest key K with weight(keys >= K) >= target, among keys >= min_key (weights: 1 each, or
// the fixed-point mass of the scaled logit). found = false when the whole weight is under target.
__device__ uint32_t radix_select(const float* row, uint32_t vocab, float inv_t, float vmax,
                                 bool weighted, uint32_t min_key, uint64_t target, shared_state& sh,
                                 bool& found) {
  uint32_t prefix = 0, mask = 0;
  uint64_t above = 0;
  const int lane = threadIdx.x & 31;
  for (int shift = 24; shift >= 0; shift -= 8) {
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += threads) sh.hist[b] = 0;
    __syncthreads();
    for (uint32_t base = 0; base < vocab; base += threads) {
      const uint32_t i = base + threadIdx.x;
      uint32_t digit = 256, w = 0;
      if (i < vocab) {
        const float v = row[i] * inv_t;
        const uint32_t key = key_of(v);
        if (v == v && key >= min_key && (key & mask) == prefix) {
          digit = (key >> shift) & 255u;
          w = weighted ? mass_of(v, vmax) : 1u;
        }
      }
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      const uint32_t sum = __reduce_add_sync(peers, w);
      if (digit < 256 && lane == __ffs(peers) - 1)
        atomicAdd(&sh.hist[digit], static_cast<unsigned long long>(sum));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds digits 255 - 8l .. 248 - 8l (descending).
      uint64_t part = 0;
      for (int j = 0; j < 8; ++j) part += sh.hist[255 - 8 * lane - j];
      uint64_t incl = part;
      for (int o = 1; o < 32; o <<= 1) {
        const uint64_t n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
      }
      const bool crosses = above + incl >= target;
      const unsigned ballot = __ballot_sync(0xffffffffu, crosses);
      if (lane == 0) sh.found = ballot != 0;
      if (ballot != 0 && lane == __ffs(ballot) - 1) {
        uint64_t cum = above + incl - part;
        for (int j = 0; j < 8; ++j) {
          const uint32_t dgt = 255 - 8 * lane - j;
          if (cum + sh.hist[dgt] >= target) {
            sh.selected = dgt;
            sh.u[0] = cum;
            break;
          }
          cum += sh.hist[dgt];
        }
      }
    }
    __syncthreads();
    if (!sh.found) {
      found = false;
      return min_key;
    }
    above = sh.u[0];
    prefix |= sh.selected << shift;
    mask |= 255u << shift;
  }
  found = true;
  return prefix;
}

// Split row statistics (sample_params::stats): CTA (split, row) reads logits [split * span,
// (split + 1) * span) of its row once, two float4 per thread held in registers, and writes their
// (max, first argmax, sum of exponentials below that max); sample_kernel merges a row's splits.
// A 128K-vocabulary row then takes a wave of small CTAs instead of two passes of one CTA
// (ncu at batch 1 on an H100: 27 us for the single-CTA passes).
constexpr int stat_threads = 256;
constexpr uint32_t stat_span = stat_threads * 8;

__host__ __device__ constexpr uint32_t stat_splits(uint32_t vocab) {
  return (vocab + stat_span - 1) / stat_span;
}

struct row_stat {
  float m;
  float s;
  int32_t idx;
  int32_t pad;
};

__device__ __forceinline__ bool better(float m1, int i1, float m2, int i2) {
  return m2 > m1 || (m2 == m1 && i2 >= 0 && (i1 < 0 || i2 < i1));
}

/// The exponential of v below the maximum m: an infinite maximum counts once per equal value.
__device__ __forceinline__ float below(float v, float m) { return v == m ? 1.0f : __expf(v - m); }

__global__ void __launch_bounds__(stat_threads) row_stats_kernel(sample_params p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  __shared__ float sm[stat_threads / 32], ss[stat_threads / 32];
  __shared__ int si[stat_threads / 32];
  const uint32_t rowi = blockIdx.y, begin = blockIdx.x * stat_span;
  const uint32_t end = min(p.vocab, begin + stat_span);
  const float* row = p.logits + static_cast<uint64_t>(rowi) * p.ld;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool vec4 = p.ld % 4 == 0 && reinterpret_cast<uintptr_t>(p.logits) % 16 == 0;
  // Ids begin + 4 tid + 1024 j + e; past the row: NaN, which neither the max nor the sum takes.
  float v[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const uint32_t i = begin + 4 * tid + (stat_span / 2) * j;
    if (vec4 && i + 3 < end) {
      const float4 f = *reinterpret_cast<const float4*>(row + i);
      v[j][0] = f.x, v[j][1] = f.y, v[j][2] = f.z, v[j][3] = f.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[j][e] = i + e < end ? row[i + e] : __int_as_float(0x7fffffff);
    }
  }
  float mx = -INFINITY;
  int arg = -1;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (v[j][e] > mx) {  // ids rise within a thread: the first of equal values stays
        mx = v[j][e];
        arg = static_cast<int>(begin + 4 * tid + (stat_span / 2) * j + e);
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, arg, o);
    if (better(mx, arg, m2, i2)) mx = m2, arg = i2;
  }
  if (lane == 0) sm[warp] = mx, si[warp] = arg;
  __syncthreads();
  mx = -INFINITY, arg = -1;
#pragma unroll
  for (int w = 0; w < stat_threads / 32; ++w) {
    if (better(mx, arg, sm[w], si[w])) mx = sm[w], arg = si[w];
  }
  float sum = 0.0f;
  if (mx != -INFINITY) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (v[j][e] == v[j][e]) sum += below(v[j][e], mx);
      }
    }
  }
  sum = dev::warp_sum(sum);
  if (lane == 0) ss[warp] = sum;
  __syncthreads();
  if (tid == 0) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < stat_threads / 32; ++w) total += ss[w];
    row_stat* out = static_cast<row_stat*>(p.stats) + static_cast<uint64_t>(rowi) * gridDim.x +
                    blockIdx.x;
    *out = row_stat{mx, total, arg, 0};
  }
}

/// (max, sum of exponentials, first argmax) of a row from its splits' statistics.
__device__ max_sum merge_row_stats(const sample_params& p, uint32_t rowi, shared_state& sh) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t splits = stat_splits(p.vocab);
  const row_stat* st = static_cast<const row_stat*>(p.stats) + static_cast<uint64_t>(rowi) * splits;
  row_stat mine{-INFINITY, 0.0f, -1, 0};
  for (uint32_t i = tid; i < splits; i += threads) {
    const row_stat r = st[i];
    if (better(mine.m, mine.idx, r.m, r.idx)) {
      mine.s = r.s + (mine.m == -INFINITY ? 0.0f : mine.s * below(mine.m, r.m));
      mine.m = r.m, mine.idx = r.idx;
    } else if (r.m != -INFINITY) {
      mine.s += r.s * below(r.m, mine.m);
    }
  }
  float mx = mine.m;
  int arg = mine.idx;
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, arg, o);
    if (better(mx, arg, m2, i2)) mx = m2, arg = i2;
  }
  if (lane == 0) sh.f[warp] = mx, sh.i[warp] = arg;
  __syncthreads();
  max_sum all{-INFINITY, 0.0f, -1};
  for (int w = 0; w < warps; ++w) {
    if (better(all.m, all.idx, sh.f[w], sh.i[w])) all.m = sh.f[w], all.idx = sh.i[w];
  }
  float sum = all.m == -INFINITY || mine.m == -INFINITY ? 0.0f : mine.s * below(mine.m, all.m);
  sum = dev::warp_sum(sum);
  if (lane == 0) sh.g[warp] = sum;
  __syncthreads();
  for (int w = 0; w < warps; ++w) all.s += sh.g[w];
  return all;
}

/// (max, sum of exponentials, first argmax) of a row in two passes of the whole CTA: the maximum
/// and its first id, then the sum of exponentials below it, 16-byte loads where rows are 16-byte
/// aligned (ncu: an online (max, sum) merge with an exponential per logit took 66 us for one
/// 128K-vocab row).
__device__ max_sum scan_row(const sample_params& p, const float* row, shared_state& sh) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool vec4 = p.ld % 4 == 0 && reinterpret_cast<uintptr_t>(p.logits) % 16 == 0;
  const uint32_t vec_end = vec4 ? p.vocab / 4 * 4 : 0;
  float mx = -INFINITY;
  int arg = -1;
  auto take_max = [&](float v, uint32_t i) {
    if (v > mx) {  // NaN never is; ids rise within a thread, so the first of equal values stays
      mx = v;
      arg = static_cast<int>(i);
    }
  };
  for (uint32_t i = tid * 4; i < vec_end; i += threads * 4) {
    const float4 v = *reinterpret_cast<const float4*>(row + i);
    take_max(v.x, i);
    take_max(v.y, i + 1);
    take_max(v.z, i + 2);
    take_max(v.w, i + 3);
  }
  for (uint32_t i = vec_end + tid; i < p.vocab; i += threads) take_max(row[i], i);
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, arg, o);
    if (better(mx, arg, m2, i2)) mx = m2, arg = i2;
  }
  if (lane == 0) {
    sh.f[warp] = mx;
    sh.i[warp] = arg;
  }
  __syncthreads();
  max_sum all{-INFINITY, 0.0f, -1};
  for (int w = 0; w < warps; ++w) {
    if (better(all.m, all.idx, sh.f[w], sh.i[w])) all.m = sh.f[w], all.idx = sh.i[w];
  }
  float sum = 0.0f;
  if (all.m != -INFINITY) {
    auto add = [&](float v) {
      if (v == v) sum += below(v, all.m);
    };
    for (uint32_t i = tid * 4; i < vec_end; i += threads * 4) {
      const float4 v = *reinterpret_cast<const float4*>(row + i);
      add(v.x), add(v.y), add(v.z), add(v.w);
    }
    for (uint32_t i = vec_end + tid; i < p.vocab; i += threads) add(row[i]);
  }
  sum = dev::warp_sum(sum);
  if (lane == 0) sh.g[warp] = sum;
  __syncthreads();
  for (int w = 0; w < warps; ++w) all.s += sh.g[w];
  return all;
}

__global__ void __launch_bounds__(threads) sample_kernel(sample_params p) {
  dev::pdl_wait();
  __shared__ shared_state sh;
  const uint32_t rowi = blockIdx.x;
  const float* row = p.logits + static_cast<uint64_t>(rowi) * p.ld;
  const sample_row rq = p.requests[rowi];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // 1. max, sum of exp and argmax of the raw logits.
  const max_sum all = p.stats ? merge_row_stats(p, rowi, sh) : scan_row(p, row, sh);
  const float lse = all.m + logf(all.s);
  int token = max(all.idx, 0);

  // 2. Filtered draw.
  if (rq.temperature > 0.0f) {
    const float inv_t = 1.0f / rq.temperature;
    const float vmax = all.m * inv_t;
    uint32_t min_key = 0;
    bool found = false;
    if (rq.top_k > 0 && static_cast<uint32_t>(rq.top_k) < p.vocab) {
      const uint32_t k = radix_select(row, p.vocab, inv_t, vmax, false, 0,
                                      static_cast<uint64_t>(rq.top_k), sh, found);
      if (found) min_key = k;
    }
    if (rq.top_p < 1.0f) {
      uint64_t total = 0;
      for (uint32_t i = tid; i < p.vocab; i += threads) {
        const float v = row[i] * inv_t;
        if (v == v && key_of(v) >= min_key) total += mass_of(v, vmax);
      }
      total = block_sum_u64(total, sh);
      const double tp = rq.top_p > 0.0f ? static_cast<double>(rq.top_p) : 0.0;
      uint64_t target = static_cast<uint64_t>(tp * static_cast<double>(total));
      if (target == 0) target = 1;  // at least the top token
      const uint32_t k = radix_select(row, p.vocab, inv_t, vmax, true, min_key, target, sh, found);
      if (found) min_key = k;
    }
    const double log_min_p = rq.min_p > 0.0f ? log(static_cast<double>(rq.min_p)) : -INFINITY;
    // Deterministic id-order scan: thread t owns ids [t * per, (t + 1) * per).
    const uint32_t per = (p.vocab + threads - 1) / threads;
    const uint32_t begin = min(p.vocab, tid * per), end = min(p.vocab, begin + per);
    auto kept = [&](uint32_t i, double& w) {
      const float v = row[i] * inv_t;
      if (!(v == v) || key_of(v) < min_key) return false;
      const double rel = static_cast<double>(v) - static_cast<double>(vmax);
      if (rel < log_min_p) return false;
      w = exp(rel);
      return true;
    };
    double mine = 0.0;
    int last_kept = -1;
    for (uint32_t i = begin; i < end; ++i) {
      double w;
      if (kept(i, w)) {
        mine += w;
        last_kept = static_cast<int>(i);
      }
    }
    // Exclusive scan of the per-thread sums, in thread order.
    double incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
      const double n = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += n;
    }
    int last = last_kept;
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    __syncthreads();
    if (lane == 31) sh.d[warp] = incl;
    if (lane == 0) sh.i[warp] = last;
    __syncthreads();
    double before = 0.0, total = 0.0;
    int last_all = -1;
    for (int w = 0; w < warps; ++w) {
      if (w < warp) before += sh.d[w];
      total += sh.d[w];
      last_all = max(last_all, sh.i[w]);
    }
    const double excl = before + incl - mine;
    const double target = rq.uniform * total;
    if (tid == 0) sh.token = last_all >= 0 ? last_all : token;
    __syncthreads();
    if (mine > 0.0 && excl <= target && target < excl + mine) {
      double cum = excl;
      for (uint32_t i = begin; i < end; ++i) {
        double w;
        if (kept(i, w)) {
          cum += w;
          if (cum > target) {
            sh.token = static_cast<int>(i);
            break;
          }
        }
      }
    }
    __syncthreads();
    token = sh.token;
  }
  if (tid == 0) {
    p.tokens[rowi] = token;
    p.logprobs[rowi] = row[token] - lse;
  }

  // 3. Top-N log-probabilities.
  const uint32_t n_top = min(min(rq.top_logprobs, p.max_top), min(p.vocab, sampling_max_top));
  if (n_top == 0) return;
  bool found = false;
  const uint32_t kth = radix_select(row, p.vocab, 1.0f, all.m, false, 0, n_top, sh, found);
  if (tid == 0) sh.cand_count = 0;
  __syncthreads();
  for (uint32_t i = tid; i < p.vocab; i += threads) {
    const float v = row[i];
    if (v == v && key_of(v) >= kth) {
      const int at = atomicAdd(&sh.cand_count, 1);
      if (at < top_cap) {
        sh.cand_id[at] = static_cast<int>(i);
        sh.cand_val[at] = v;
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    const int n = min(sh.cand_count, top_cap);
    for (int a = 1; a < n; ++a) {  // insertion sort: value descending, id ascending
      const int id = sh.cand_id[a];
      const float v = sh.cand_val[a];
      int b = a - 1;
      while (b >= 0 && (sh.cand_val[b] < v || (sh.cand_val[b] == v && sh.cand_id[b] > id))) {
        sh.cand_id[b + 1] = sh.cand_id[b];
        sh.cand_val[b + 1] = sh.cand_val[b];
        --b;
      }
      sh.cand_id[b + 1] = id;
      sh.cand_val[b + 1] = v;
    }
    for (uint32_t j = 0; j < p.max_top; ++j) {
      const bool have = j < n_top && static_cast<int>(j) < n;
      p.top_ids[static_cast<uint64_t>(rowi) * p.max_top + j] = have ? sh.cand_id[j] : -1;
      p.top_logprobs[static_cast<uint64_t>(rowi) * p.max_top + j] =
          have ? sh.cand_val[j] - lse : -INFINITY;
    }
  }
}

}  // namespace

uint32_t sample_stat_splits(uint32_t vocab) { return stat_splits(vocab); }

uint64_t sample_stats_bytes(uint32_t rows, uint32_t vocab) {
  return uint64_t{rows} * sample_stat_splits(vocab) * sizeof(row_stat);
}

kstatus sample_tokens(const sample_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(p.logits && p.requests && p.tokens && p.logprobs, "sample_tokens: null pointer");
  DUET_KREQUIRE(p.vocab > 0 && p.ld >= p.vocab, "sample_tokens: bad vocab or ld");
  DUET_KREQUIRE(p.max_top <= sampling_max_top, "sample_tokens: max_top over sampling_max_top");
  DUET_KREQUIRE(p.max_top == 0 || (p.top_ids && p.top_logprobs),
                "sample_tokens: top-N outputs missing");
  DUET_KREQUIRE(p.rows <= 65535 || !p.stats, "sample_tokens: over 65535 rows with split statistics");
  if (p.rows == 0) return {};
  if (p.stats) {
    DUET_KCHECK(launch(row_stats_kernel, dim3(stat_splits(p.vocab), p.rows),
                       dim3(stat_threads), 0, stream, p));
  }
  DUET_KCHECK(launch(sample_kernel, dim3(p.rows), dim3(threads), 0, stream, p));
  return {};
}

}  // namespace duet::kernels
