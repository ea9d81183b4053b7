#include <algorithm>

#include "kernels/decode_layers.cuh"
#include "kernels/device_util.cuh"

namespace duet::kernels {

namespace {

constexpr int dl_threads = 512, dl_warps = dl_threads / 32;
constexpr int dl_loads = 16;  // 16-byte weight loads per lane in flight
constexpr int head_dim = 128, half_dim = head_dim / 2;
constexpr int pv_keys = 8;  // values loaded at once per lane in the attention's P·V
constexpr uint32_t sync_header_words = 32;  // word 0: the grid barrier; merge counters after
// A barrier not reached within seconds means a CTA is lost: fail the launch instead of hanging.
constexpr uint32_t spin_limit = 1u << 26;

__host__ __device__ uint64_t sync_bytes(uint32_t layers, uint32_t kv_heads) {
  return ((uint64_t{sync_header_words} + uint64_t{layers} * kv_heads) * 4 + 255) & ~uint64_t{255};
}

uint32_t vector_floats(const decode_layers_params& p) {
  return std::max({p.hidden, p.heads * head_dim, p.ffn});
}

// Splits of a KV head's keys (a CTA each); the last CTA merges them in shared memory.
constexpr uint32_t max_splits = 16;
__host__ __device__ inline uint32_t attention_splits(uint32_t ctas, uint32_t kv_heads) {
  return ctas / kv_heads < max_splits ? ctas / kv_heads : max_splits;
}

uint32_t attention_floats(uint32_t group) {
  // queries, the new K and V, per-warp maxima and sums, per-warp outputs; the merge of the
  // splits' (max, sum, output) rows
  const uint32_t stage = group * head_dim + 2 * head_dim + 2 * dl_warps * group + dl_warps * group * head_dim;
  return std::max(stage, max_splits * group * (head_dim + 2));
}

size_t smem_bytes(const decode_layers_params& p) {
  return size_t{std::max(vector_floats(p), attention_floats(p.heads / p.kv_heads))} * 4;
}

// ------------------------------------------------------------------------- grid barrier

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__device__ __forceinline__ void grid_arrive(unsigned* counter, uint64_t* trace) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (trace) *trace = now_ns();
    __threadfence();
    atomicAdd(counter, 1u);
  }
}

__device__ __forceinline__ void grid_wait(unsigned* counter, unsigned target, uint32_t poll_ns,
                                          uint64_t* trace) {
  if (threadIdx.x == 0) {
    uint32_t spins = 0;
    unsigned seen = 0;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
      if (seen >= target) break;
      if (++spins > spin_limit) __trap();
      __nanosleep(poll_ns);
    }
    __threadfence();
    if (trace) *trace = now_ns();
  }
  __syncthreads();
}

// --------------------------------------------------------------------------------- GEMV

/// The step's one row, read once per launch.
struct step_row {
  int len;   // keys to attend, the new one last
  int pos;   // RoPE position, clamped to the tables
  int slot;  // pool slot of the new key and value
};

struct gemv_job {
  const uint16_t* w;
  const uint16_t* bias;
  uint16_t* y;
  uint32_t n, k;
};

__device__ __forceinline__ uint32_t global_warp() {
  return blockIdx.x * dl_warps + threadIdx.x / 32;
}

__device__ __forceinline__ void load_batch(const uint4* row, uint32_t chunks, uint32_t base,
                                           uint4 (&v)[dl_loads]) {
  const uint32_t lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < dl_loads; ++u) {
    const uint32_t c = base + lane + 32u * u;
    v[u] = c < chunks ? __ldcs(row + c) : make_uint4(0, 0, 0, 0);
  }
}

/// The first batch of this warp's first row: issued before a barrier, it is in flight while the
/// CTA waits for the stage that the GEMV's input comes from.
__device__ __forceinline__ void gemv_prefetch(const gemv_job& j, uint4 (&v)[dl_loads]) {
  const uint32_t row = global_warp();
  if (row < j.n)
    load_batch(reinterpret_cast<const uint4*>(j.w + uint64_t{row} * j.k), j.k / 8, 0, v);
}

/// Bytes [from, from + bytes) of this warp's rows (its rows one after another) asked into L2. At a
/// barrier, a CTA that finished its stage early keeps the memory busy with the next stage's
/// weights while the others finish theirs; during the attention (latency-bound) the o GEMV's.
__device__ __forceinline__ void gemv_prefetch_l2(const gemv_job& j, uint32_t from, uint32_t bytes) {
  const uint64_t row_bytes = uint64_t{j.k} * 2;
  const uint32_t lane = threadIdx.x & 31, warps = gridDim.x * dl_warps;
  for (uint32_t line = lane; line < bytes / 128; line += 32) {
    const uint64_t at = from + uint64_t{line} * 128;
    const uint64_t row = global_warp() + (at / row_bytes) * warps;
    if (row >= j.n) break;
    const char* address = reinterpret_cast<const char*>(j.w) + row * row_bytes + at % row_bytes;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(address));
  }
}

/// The register batch of the warp's first row, then the next l2_bytes after it into L2.
__device__ __forceinline__ void gemv_prefetch_both(const gemv_job& j, uint4 (&v)[dl_loads],
                                                   uint32_t l2_bytes) {
  gemv_prefetch(j, v);
  const uint32_t batch = 32u * dl_loads * 16;
  gemv_prefetch_l2(j, j.k * 2 < batch ? j.k * 2 : batch, l2_bytes);
}

/// y = W x for rows global_warp(), + every warp of the grid, ...; x in shared memory as floats,
/// `v` holding the prefetched batch. Lane l sums chunks l + 32 i into acc[i % 8]: those are the
/// chunks of the skinny GEMM's thread (i % 8) * 32 + l, in its order, and the eight warp sums
/// add up in its order, so the bits are the skinny kernel's.
__device__ void gemv_run(const gemv_job& j, const float* xs, uint4 (&v)[dl_loads]) {
  const uint32_t lane = threadIdx.x & 31, chunks = j.k / 8, warps = gridDim.x * dl_warps;
  const float4* x4 = reinterpret_cast<const float4*>(xs);
  bool prefetched = true;
  for (uint32_t row = global_warp(); row < j.n; row += warps) {
    const uint4* wr = reinterpret_cast<const uint4*>(j.w + uint64_t{row} * j.k);
    float acc[8] = {};
    for (uint32_t base = 0; base < chunks; base += 32 * dl_loads) {
      if (!prefetched) load_batch(wr, chunks, base, v);
      prefetched = false;
#pragma unroll
      for (int u = 0; u < dl_loads; ++u) {
        const uint32_t c = base + lane + 32u * u;
        if (c < chunks) {
          float w[8];
          dev::unpack8(v[u], w);
          const float4 a = x4[2 * c], b = x4[2 * c + 1];
          const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u % 8] = fmaf(x[i], w[i], acc[u % 8]);
        }
      }
    }
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += dev::warp_sum(acc[i]);
    if (lane == 0) {
      if (j.bias) sum += dev::bf(j.bias[row]);
      j.y[row] = dev::to_bf(sum);
    }
  }
}

// ---------------------------------------------------------------------- vector stages

/// xs = in (zeros when null; + delta, rounded to bf16), this CTA's share of it written to residual_out, then
/// xs = rbf(weight * rbf(x / rms)): add_rmsnorm's arithmetic, its sums in its order (thread
/// t < 256 takes chunks t, t + 256, ...; the eight warps' sums in order).
__device__ void norm_stage(const uint16_t* in, const uint16_t* delta, uint16_t* residual_out,
                           const uint16_t* weight, uint32_t hidden, float eps, float* xs,
                           float* partial) {
  const uint32_t tid = threadIdx.x, chunks = hidden / 8;
  if (tid < 256) {
    float sumsq = 0.0f;
    for (uint32_t c = tid; c < chunks; c += 256) {
      float x[8];
      dev::unpack8(in ? __ldcg(reinterpret_cast<const uint4*>(in) + c) : make_uint4(0, 0, 0, 0), x);
      if (delta) {
        float d[8];
        dev::unpack8(__ldcg(reinterpret_cast<const uint4*>(delta) + c), d);
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = dev::rbf(x[i] + d[i]);
      }
      if (residual_out && c % gridDim.x == blockIdx.x)
        reinterpret_cast<uint4*>(residual_out)[c] = dev::pack8(x);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        sumsq = fmaf(x[i], x[i], sumsq);
        xs[c * 8 + i] = x[i];
      }
    }
    sumsq = dev::warp_sum(sumsq);
    if (tid % 32 == 0) partial[tid / 32] = sumsq;
  }
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < 8; ++w) total += partial[w];
  const float inv = rsqrtf(total / static_cast<float>(hidden) + eps);
  for (uint32_t c = tid; c < chunks; c += dl_threads) {
    float w[8];
    dev::unpack8(reinterpret_cast<const uint4*>(weight)[c], w);
#pragma unroll
    for (int i = 0; i < 8; ++i) xs[c * 8 + i] = dev::rbf(w[i] * dev::rbf(xs[c * 8 + i] * inv));
  }
  __syncthreads();
}

__device__ void load_vector(const uint16_t* in, uint32_t n, float* xs) {
  for (uint32_t c = threadIdx.x; c < n / 8; c += dl_threads) {
    float x[8];
    dev::unpack8(__ldcg(reinterpret_cast<const uint4*>(in) + c), x);
#pragma unroll
    for (int i = 0; i < 8; ++i) xs[c * 8 + i] = x[i];
  }
  __syncthreads();
}

/// xs = SwiGLU of gate_up ([gate, up]), rounded as the skinny kernel's SwiGLU input rounds it.
__device__ void load_swiglu(const uint16_t* gate_up, uint32_t ffn, float* xs) {
  const uint4* g4 = reinterpret_cast<const uint4*>(gate_up);
  const uint4* u4 = reinterpret_cast<const uint4*>(gate_up + ffn);
  for (uint32_t c = threadIdx.x; c < ffn / 8; c += dl_threads) {
    float g[8], u[8];
    dev::unpack8(__ldcg(g4 + c), g);
    dev::unpack8(__ldcg(u4 + c), u);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      xs[c * 8 + i] = dev::rbf(dev::rbf(g[i] / (1.0f + __expf(-g[i]))) * u[i]);
  }
  __syncthreads();
}

// --------------------------------------------------------------------------- attention

/// The keys and values of this CTA's split of the attention (all but the new key, which the QKV
/// GEMV makes) asked into L2 while the CTA waits for the QKV GEMV: they do not depend on it.
__device__ void attention_prefetch(const decode_layers_params& p, uint32_t layer, const step_row& row) {
  const uint32_t splits = attention_splits(gridDim.x, p.kv_heads);
  const uint32_t g = blockIdx.x % p.kv_heads, s = blockIdx.x / p.kv_heads;
  if (s >= splits) return;
  const int len = row.len;
  const int chunk = max(16, (len + static_cast<int>(splits) - 1) / static_cast<int>(splits));
  const int k0 = static_cast<int>(s) * chunk, k1 = min(len - 1, k0 + chunk);
  const int bt = static_cast<int>(p.kv.block_tokens);
  // Four 128-byte lines a key: two of K, two of V.
  for (int t = static_cast<int>(threadIdx.x); t < 4 * (k1 - k0); t += dl_threads) {
    const int key = k0 + t / 4, line = t % 4;
    const uint16_t* at = p.kv.pool + static_cast<uint64_t>(p.block_table[key / bt]) * p.kv.block_elems +
                         p.kv.offset(layer, line / 2, g, static_cast<uint32_t>(key % bt)) +
                         (line % 2) * 64;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(at));
  }
}

/// One (KV head, split of the keys) per CTA: RoPE on the group's queries (and on the new key,
/// appended to the pool with its value, by the CTA whose split holds it), an fp32 online softmax
/// per warp over tiles of keys, the warps merged in shared memory, the split's (max, sum,
/// output) written to `partials`; the last CTA of the KV head merges the splits into attn.
template <int G>
__device__ void attention_stage(const decode_layers_params& p, uint32_t layer, const step_row& row,
                                float* sm, unsigned* counters, float* partials, int* last_flag) {
  const uint32_t group = p.heads / p.kv_heads, splits = attention_splits(gridDim.x, p.kv_heads);
  const uint32_t g = blockIdx.x % p.kv_heads, s = blockIdx.x / p.kv_heads;
  if (s >= splits) return;
  const int len = row.len, newest = len - 1;
  const int chunk = max(16, (len + static_cast<int>(splits) - 1) / static_cast<int>(splits));
  const int used = (len + chunk - 1) / chunk;
  if (static_cast<int>(s) >= used) return;
  const int k0 = static_cast<int>(s) * chunk, k1 = min(len, k0 + chunk);
  const bool holds_newest = k1 == len;

  float* qs = sm;                           // [group][128]
  float* kn = qs + group * head_dim;        // the new key, rotated
  float* vn = kn + head_dim;                // the new value
  float* wm = vn + head_dim;                // [warps][group]
  float* wl = wm + dl_warps * group;        // [warps][group]
  float* wo = wl + dl_warps * group;        // [warps][group][128]
  const uint32_t tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  const int pos = row.pos;
  const float* cs = p.rope_cos + static_cast<uint64_t>(pos) * half_dim;
  const float* sn = p.rope_sin + static_cast<uint64_t>(pos) * half_dim;
  const uint32_t rotated = (group + (holds_newest ? 1 : 0)) * half_dim;
  for (uint32_t t = tid; t < rotated; t += dl_threads) {
    const uint32_t hh = t / half_dim, i = t % half_dim;
    const uint32_t head = hh < group ? g * group + hh : p.heads + g;
    const float a = dev::bf(__ldcg(p.qkv + head * head_dim + i));
    const float b = dev::bf(__ldcg(p.qkv + head * head_dim + half_dim + i));
    const float c = dev::rbf(cs[i]), sv = dev::rbf(sn[i]);
    float* dst = hh < group ? qs + hh * head_dim : kn;
    // rope_kernel_vec8's rounding steps
    dst[i] = dev::rbf(dev::rbf(a * c) + dev::rbf(-b * sv));
    dst[i + half_dim] = dev::rbf(dev::rbf(b * c) + dev::rbf(a * sv));
  }
  if (holds_newest) {
    for (uint32_t d = tid; d < head_dim; d += dl_threads)
      vn[d] = dev::bf(__ldcg(p.qkv + (p.heads + p.kv_heads + g) * head_dim + d));
  }
  __syncthreads();
  const int bt = static_cast<int>(p.kv.block_tokens);
  if (holds_newest && row.slot >= 0) {
    const int32_t slot = row.slot;
    uint16_t* block = p.kv.pool + static_cast<uint64_t>(slot / bt) * p.kv.block_elems;
    const uint32_t within = static_cast<uint32_t>(slot % bt);
    for (uint32_t d = tid; d < head_dim; d += dl_threads) {
      block[p.kv.offset(layer, 0, g, within) + d] = dev::to_bf(kn[d]);
      block[p.kv.offset(layer, 1, g, within) + d] = dev::to_bf(vn[d]);
    }
  }

  float m[G], l[G], o[G][4];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
    o[h][0] = o[h][1] = o[h][2] = o[h][3] = 0.0f;
  }
  // Keys spread over every warp: a warp takes tiles of up to 32 keys (lane = key for Q·K).
  const int per_warp = min(32, (k1 - k0 + dl_warps - 1) / dl_warps);
  for (int base = k0 + static_cast<int>(warp) * per_warp; base < k1;
       base += dl_warps * per_warp) {
    const int keys = min(per_warp, k1 - base);
    const int key = base + static_cast<int>(lane);
    const bool valid = static_cast<int>(lane) < keys;
    int32_t blk = 0;
    float sc[G];
#pragma unroll
    for (int h = 0; h < G; ++h) sc[h] = 0.0f;
    if (valid && key != newest) {
      blk = p.block_table[key / bt];
      const uint4* kr = reinterpret_cast<const uint4*>(
          p.kv.pool + static_cast<uint64_t>(blk) * p.kv.block_elems +
          p.kv.offset(layer, 0, g, static_cast<uint32_t>(key % bt)));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint4 kv4[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) kv4[c] = __ldcg(kr + half * 8 + c);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          float kf[8];
          dev::unpack8(kv4[c], kf);
#pragma unroll
          for (int h = 0; h < G; ++h) {
            if (h < static_cast<int>(group)) {
              const float* q = qs + h * head_dim + (half * 8 + c) * 8;
#pragma unroll
              for (int i = 0; i < 8; ++i) sc[h] = fmaf(q[i], kf[i], sc[h]);
            }
          }
        }
      }
    } else if (valid) {
      for (int d = 0; d < head_dim; ++d) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
          if (h < static_cast<int>(group)) sc[h] = fmaf(qs[h * head_dim + d], kn[d], sc[h]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      if (h < static_cast<int>(group)) {
        const float sv = valid ? sc[h] * p.scale : -INFINITY;
        const float mn = fmaxf(m[h], dev::warp_max(sv));
        const float alpha = __expf(m[h] - mn);
        const float pr = valid ? __expf(sv - mn) : 0.0f;
        l[h] = l[h] * alpha + dev::warp_sum(pr);
#pragma unroll
        for (int e = 0; e < 4; ++e) o[h][e] *= alpha;
        m[h] = mn;
        sc[h] = pr;
      }
    }
    // P·V: lane owns dimensions 4 lane .. 4 lane + 3; the values of pv_keys keys load together.
    for (int jb = 0; jb < keys; jb += pv_keys) {
      uint2 raw[pv_keys];  // bf16 pairs: held packed until used
#pragma unroll
      for (int q = 0; q < pv_keys; ++q) {
        const int jj = jb + q;
        const int32_t bj = __shfl_sync(0xffffffffu, blk, jj & 31);
        if (jj < keys && base + jj != newest) {
          raw[q] = __ldcg(reinterpret_cast<const uint2*>(
              p.kv.pool + static_cast<uint64_t>(bj) * p.kv.block_elems +
              p.kv.offset(layer, 1, g, static_cast<uint32_t>((base + jj) % bt)) + 4 * lane));
        } else if (jj < keys) {
          raw[q] = make_uint2(dev::pack(vn[4 * lane], vn[4 * lane + 1]),
                              dev::pack(vn[4 * lane + 2], vn[4 * lane + 3]));
        } else {
          raw[q] = make_uint2(0, 0);
        }
      }
#pragma unroll
      for (int q = 0; q < pv_keys; ++q) {
        const float vv[4] = {dev::lo(raw[q].x), dev::hi(raw[q].x), dev::lo(raw[q].y),
                             dev::hi(raw[q].y)};
#pragma unroll
        for (int h = 0; h < G; ++h) {
          if (h < static_cast<int>(group)) {
            const float pj = __shfl_sync(0xffffffffu, sc[h], (jb + q) & 31);
#pragma unroll
            for (int e = 0; e < 4; ++e) o[h][e] = fmaf(pj, vv[e], o[h][e]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (h < static_cast<int>(group)) {
      if (lane == 0) {
        wm[warp * group + h] = m[h];
        wl[warp * group + h] = l[h];
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) wo[(warp * group + h) * head_dim + 4 * lane + e] = o[h][e];
    }
  }
  __syncthreads();
  float* mine = partials + (static_cast<uint64_t>(g) * splits + s) * group * (head_dim + 2);
  for (uint32_t t = tid; t < group * head_dim; t += dl_threads) {
    const uint32_t h = t / head_dim, d = t % head_dim;
    float mx = -INFINITY;
    for (int w = 0; w < dl_warps; ++w) mx = fmaxf(mx, wm[w * group + h]);
    float sum = 0.0f, out = 0.0f;
    for (int w = 0; w < dl_warps; ++w) {
      const float f = __expf(wm[w * group + h] - mx);
      sum += wl[w * group + h] * f;
      out += wo[(w * group + h) * head_dim + d] * f;
    }
    float* row = mine + h * (head_dim + 2);
    if (d == 0) {
      row[0] = mx;
      row[1] = sum;
    }
    row[2 + d] = out;
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    *last_flag = atomicAdd(counters + layer * p.kv_heads + g, 1u) == static_cast<unsigned>(used - 1);
  }
  __syncthreads();
  if (!*last_flag) return;
  __threadfence();
  // Every split's rows into shared memory at once (one round trip), then merged from there.
  const float* first = partials + static_cast<uint64_t>(g) * splits * group * (head_dim + 2);
  const uint32_t words = static_cast<uint32_t>(used) * group * (head_dim + 2);
  for (uint32_t t = tid; t < words; t += dl_threads) sm[t] = __ldcg(first + t);
  __syncthreads();
  for (uint32_t t = tid; t < group * head_dim; t += dl_threads) {
    const uint32_t h = t / head_dim, d = t % head_dim;
    float mx = -INFINITY;
    for (int sp = 0; sp < used; ++sp) mx = fmaxf(mx, sm[(sp * group + h) * (head_dim + 2)]);
    float sum = 0.0f, out = 0.0f;
    for (int sp = 0; sp < used; ++sp) {
      const float* r = sm + (sp * group + h) * (head_dim + 2);
      const float f = __expf(r[0] - mx);
      sum += r[1] * f;
      out += r[2 + d] * f;
    }
    p.attn[(g * group + h) * head_dim + d] = dev::to_bf(out / sum);
  }
}

// ------------------------------------------------------------------------------ kernel

template <int G>
__global__ void __launch_bounds__(dl_threads, 1) decode_layers_kernel(decode_layers_params p) {
  extern __shared__ __align__(16) float sm[];
  __shared__ float norm_partial[8];
  __shared__ int last_flag;
  float* xs = sm;
  auto* sync = static_cast<unsigned*>(p.workspace);
  unsigned* bar = sync;
  unsigned* counters = sync + sync_header_words;
  auto* partials = reinterpret_cast<float*>(static_cast<char*>(p.workspace) +
                                            sync_bytes(p.layer_count, p.kv_heads));
  const unsigned ctas = gridDim.x;
  unsigned passed = 0;
  if (p.trace && threadIdx.x == 0)
    p.trace[2ull * decode_layers_barriers(p.layer_count) * ctas + blockIdx.x] = now_ns();
  auto barrier_then = [&](auto&& before_wait) {
    uint64_t* arrival = p.trace ? p.trace + (2ull * passed) * ctas + blockIdx.x : nullptr;
    grid_arrive(bar, arrival);
    before_wait();
    grid_wait(bar, ++passed * ctas, p.poll_ns, arrival ? arrival + ctas : nullptr);
  };
  const uint32_t hidden = p.hidden, q_dim = p.heads * head_dim;
  const uint32_t qkv_dim = q_dim + 2 * p.kv_heads * head_dim;
  int cur = 0;  // residual(cur) holds the residual stream; the other one takes the next sum
  auto residual = [&](int i) { return p.residual + (i ? hidden : 0); };
  uint4 v[dl_loads];
  step_row row;
  row.len = *p.seq_len;
  row.pos = max(0, min(*p.position, static_cast<int>(p.rope_positions) - 1));
  row.slot = *p.slot;
  const uint32_t l2 = p.l2_prefetch_bytes;

  // Layer weights are read where used (not held in registers across the stages).
  const decode_layer_weights* layers = p.layers;
  gemv_prefetch(gemv_job{layers[0].qkv, layers[0].qkv_bias, p.qkv, qkv_dim, hidden}, v);
  {
    const int32_t token = *p.token;
    const bool valid = token >= 0 && static_cast<uint32_t>(token) < p.vocab;
    // An id outside the vocabulary embeds as zeros, as embedding_gather does.
    const uint16_t* row = p.embedding + static_cast<uint64_t>(valid ? token : 0) * hidden;
    norm_stage(valid ? row : nullptr, nullptr, residual(0), layers[0].input_norm, hidden, p.eps,
               xs, norm_partial);
  }
  gemv_run(gemv_job{layers[0].qkv, layers[0].qkv_bias, p.qkv, qkv_dim, hidden}, xs, v);
  for (uint32_t layer = 0; layer < p.layer_count; ++layer) {
    const decode_layer_weights& w = layers[layer];
    const gemv_job o{w.o, w.o_bias, p.delta, hidden, q_dim};
    const gemv_job gate_up{w.gate_up, nullptr, p.gate_up, 2 * p.ffn, hidden};
    const gemv_job down{w.down, nullptr, p.delta, hidden, p.ffn};
    barrier_then([&] {
      attention_prefetch(p, layer, row);
      // The attention leaves the memory nearly idle: the o GEMV's weights come into L2 meanwhile.
      if (l2) gemv_prefetch_l2(o, 0, 4 * 32u * dl_loads * 16);
    });
    attention_stage<G>(p, layer, row, sm, counters, partials, &last_flag);
    barrier_then([&] {
      gemv_prefetch(o, v);
      gemv_prefetch_l2(gate_up, 0, l2);
    });
    load_vector(p.attn, q_dim, xs);
    gemv_run(o, xs, v);
    barrier_then([&] { gemv_prefetch_both(gate_up, v, l2); });
    norm_stage(residual(cur), p.delta, residual(cur ^ 1), w.post_norm, hidden, p.eps, xs,
               norm_partial);
    cur ^= 1;
    gemv_run(gate_up, xs, v);
    barrier_then([&] { gemv_prefetch_both(down, v, l2); });
    load_swiglu(p.gate_up, p.ffn, xs);
    gemv_run(down, xs, v);
    if (layer + 1 == p.layer_count) break;
    const decode_layer_weights& next = layers[layer + 1];
    const gemv_job qkv{next.qkv, next.qkv_bias, p.qkv, qkv_dim, hidden};
    barrier_then([&] { gemv_prefetch_both(qkv, v, l2); });
    norm_stage(residual(cur), p.delta, residual(cur ^ 1), next.input_norm, hidden, p.eps, xs,
               norm_partial);
    cur ^= 1;
    gemv_run(qkv, xs, v);
  }
  barrier_then([] {});
  if (blockIdx.x != 0) return;
  norm_stage(residual(cur), p.delta, nullptr, p.final_norm, hidden, p.eps, xs, norm_partial);
  for (uint32_t c = threadIdx.x; c < hidden / 8; c += dl_threads) {
    float y[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = xs[c * 8 + i];
    reinterpret_cast<uint4*>(p.out)[c] = dev::pack8(y);
  }
}

using kernel_fn = void (*)(decode_layers_params);

kernel_fn kernel_for(uint32_t group) {
  return group <= 4 ? decode_layers_kernel<4> : decode_layers_kernel<8>;
}

}  // namespace

bool decode_layers_supported(uint32_t hidden, uint32_t heads, uint32_t kv_heads, uint32_t head_dim,
                             uint32_t ffn) {
  return head_dim == 128 && kv_heads > 0 && heads % kv_heads == 0 &&
         heads / kv_heads <= decode_layers_max_group && hidden % 8 == 0 && hidden > 0 &&
         ffn % 8 == 0 && ffn > 0;
}

uint64_t decode_layers_workspace_bytes(uint32_t layers, uint32_t heads, uint32_t kv_heads,
                                       uint32_t ctas) {
  // (max, sum, output) per query head and split
  const uint64_t splits = kv_heads ? attention_splits(ctas, kv_heads) : 0;
  return sync_bytes(layers, kv_heads) + splits * heads * (head_dim + 2) * 4;
}

uint32_t decode_layers_ctas(const decode_layers_params& p, uint32_t sms) {
  if (!decode_layers_supported(p.hidden, p.heads, p.kv_heads, head_dim, p.ffn) || sms < p.kv_heads)
    return 0;
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const size_t smem = smem_bytes(p);
  if (smem + 8 * 4 + 4 > static_cast<size_t>(optin)) return 0;
  const kernel_fn kernel = kernel_for(p.heads / p.kv_heads);
  int blocks = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin - 64) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, dl_threads, smem) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return blocks >= 1 ? sms : 0;
}

kstatus decode_layers(const decode_layers_params& p, uint32_t ctas, cudaStream_t stream) {
  DUET_KREQUIRE(decode_layers_supported(p.hidden, p.heads, p.kv_heads, p.kv.head_dim, p.ffn),
                "decode_layers: unsupported shape (head_dim 128, at most 8 query heads per KV "
                "head, sizes multiples of 8)");
  DUET_KREQUIRE(p.layers && p.layer_count > 0 && p.embedding && p.final_norm && p.token &&
                    p.position && p.slot && p.seq_len && p.block_table && p.kv.pool &&
                    p.rope_cos && p.rope_sin && p.residual && p.qkv && p.attn && p.gate_up &&
                    p.delta && p.out && p.workspace,
                "decode_layers: null pointer");
  DUET_KREQUIRE(p.kv.kv_heads == p.kv_heads && p.kv.layers >= p.layer_count &&
                    p.kv.block_tokens > 0 && p.rope_positions > 0,
                "decode_layers: KV pool or RoPE tables do not match the model");
  DUET_KREQUIRE(ctas >= p.kv_heads, "decode_layers: fewer CTAs than KV heads");
  DUET_KCHECK(cudaMemsetAsync(p.workspace, 0, sync_bytes(p.layer_count, p.kv_heads), stream));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(dl_threads);
  config.dynamicSmemBytes = smem_bytes(p);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeCooperative;
  attribute[0].val.cooperative = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  DUET_KCHECK(cudaLaunchKernelEx(&config, kernel_for(p.heads / p.kv_heads), p));
  return {};
}

}  // namespace duet::kernels
