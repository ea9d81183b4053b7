#include <cfloat>

#include "kernels/attention.cuh"
#include "kernels/attention_tile.cuh"
#include "kernels/attention_wgmma.cuh"
#include "kernels/device_util.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {

namespace {

constexpr int head_dim = 128;
constexpr float log2e = 1.4426950408889634f;

// --------------------------------------------------------------------------- shared tile math
//
// A warp owns 16 query rows. Fragment layouts (mma.m16n8k16): lane = 4 g + t; an accumulator
// tile c[4] of 16 x 8 holds (row g, cols 2t, 2t+1) in c[0..1] and (row g + 8, same cols) in
// c[2..3].

/// s[NT] (16 rows x 8 NT keys) = q (16 x 128, A fragments) . K^T, K rows (keys) swizzled in smem.
template <int NT>
__device__ __forceinline__ void qk_tile(float (&s)[NT][4], const uint32_t (&qf)[8][4],
                                        const uint16_t* k_smem, int lane) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
    for (int nn = 0; nn < NT / 2; ++nn) {
      uint32_t b[4];
      dev::ldsm_x4(b, k_smem + dev::swz(nn * 16 + ((lane >> 4) & 1) * 8 + (lane & 7),
                                        kk * 2 + ((lane >> 3) & 1)));
      dev::mma_bf16(s[2 * nn], qf[kk], b[0], b[1]);
      dev::mma_bf16(s[2 * nn + 1], qf[kk], b[2], b[3]);
    }
  }
}

/// Online softmax update of rows g and g + 8: s becomes the probabilities (unnormalised), o and l
/// are rescaled to the new running maximum m (kept in raw score units).
template <int NT>
__device__ __forceinline__ void softmax_update(float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                               float (&o)[16][4], float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m[r], tile::row_max(s, r));
    const float base = m_new == -INFINITY ? 0.0f : m_new * scale_log2;
    const float alpha = exp2f(m[r] * scale_log2 - base);
    m[r] = m_new;
    l[r] *= alpha;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      o[nt][2 * r] *= alpha;
      o[nt][2 * r + 1] *= alpha;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * r] = exp2f(fmaf(s[nt][2 * r], scale_log2, -base));
      s[nt][2 * r + 1] = exp2f(fmaf(s[nt][2 * r + 1], scale_log2, -base));
      l[r] += s[nt][2 * r] + s[nt][2 * r + 1];
    }
  }
}

/// o (16 x 128) += p (16 x 8 NT, from the accumulators of softmax_update) . V, V rows swizzled in
/// smem.
template <int NT>
__device__ __forceinline__ void pv_tile(float (&o)[16][4], const float (&s)[NT][4],
                                        const uint16_t* v_smem, int lane) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    const uint32_t a[4] = {dev::pack(s[2 * kk][0], s[2 * kk][1]),
                           dev::pack(s[2 * kk][2], s[2 * kk][3]),
                           dev::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           dev::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int dn = 0; dn < 8; ++dn) {
      uint32_t b[4];
      dev::ldsm_x4_t(b, v_smem + dev::swz(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                          dn * 2 + ((lane >> 4) & 1)));
      dev::mma_bf16(o[2 * dn], a, b[0], b[1]);
      dev::mma_bf16(o[2 * dn + 1], a, b[2], b[3]);
    }
  }
}

/// Copies `keys` K or V rows (16 chunks of 16 bytes each) of (layer, kv_head) starting at key
/// `key0` into swizzled smem; keys at or past `key_end` become zeros. `lanes` threads take part.
__device__ __forceinline__ void load_kv_rows(uint16_t* dst, const kv_pool_view& kv,
                                             const int32_t* table, uint32_t layer, uint32_t kv_sel,
                                             uint32_t kv_head, int key0, int keys, int key_end,
                                             int lane, int lanes) {
  for (int i = lane; i < keys * 16; i += lanes) {
    const int r = i >> 4, c = i & 15;
    const int key = key0 + r;
    const bool valid = key < key_end;
    const uint16_t* src = kv.pool;
    if (valid) {
      const uint32_t block = static_cast<uint32_t>(table[key / static_cast<int>(kv.block_tokens)]);
      const uint32_t slot = static_cast<uint32_t>(key) % kv.block_tokens;
      src = kv.pool + static_cast<uint64_t>(block) * kv.block_elems +
            kv.offset(layer, kv_sel, kv_head, slot) + c * 8;
    }
    dev::cp_async16(dst + dev::swz(r, c), src, valid);
  }
}

/// Copies the chunks of parity `par` (chunks 2 i + par) of row `row` of a K or V tile, a thread
/// pair covering the row: each 16-byte copy of a warp then has its sector's other half copied by
/// the lane beside it, so L2 serves whole 32-byte sectors (one half-row per thread read each sector
/// twice and kept L2 60-68 % busy at 220 TFLOP/s, ncu on the H200). The key's (block, slot) were
/// resolved by the caller, once per tile; an invalid key gives zeros.
__device__ __forceinline__ void load_half_row(uint16_t* dst, const kv_pool_view& kv, uint32_t layer,
                                              uint32_t kv_sel, uint32_t kv_head, int32_t block,
                                              uint32_t slot, int row, int par, bool valid) {
  const uint16_t* src = kv.pool;
  if (valid) {
    src = kv.pool + static_cast<uint64_t>(block) * kv.block_elems +
          kv.offset(layer, kv_sel, kv_head, slot);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = 2 * i + par;
    dev::cp_async16(dst + dev::swz(row, c), valid ? src + c * 8 : src, valid);
  }
}

// ----------------------------------------------------------------------------------- prefill

constexpr int pf_rows = 64;  // query rows per CTA (4 warps x 16)
constexpr int pf_keys = 64;  // keys per tile
constexpr int pf_threads = 128;
constexpr int pf_smem = (pf_rows + 2 * pf_keys) * head_dim * 2;  // Q, K, V tiles: 48 KiB

__global__ void __launch_bounds__(pf_threads) prefill_kernel(prefill_attention_params p) {
  dev::pdl_wait();
  extern __shared__ __align__(128) uint16_t smem[];
  uint16_t* q_s = smem;
  uint16_t* k_s = q_s + pf_rows * head_dim;
  uint16_t* v_s = k_s + pf_keys * head_dim;

  const int seq = blockIdx.z, head = blockIdx.y;
  const int row_begin = p.seq_rows[seq];
  const int rows = p.seq_rows[seq + 1] - row_begin;
  const int tiles = (rows + pf_rows - 1) / pf_rows;
  if (static_cast<int>(blockIdx.x) >= tiles) return;
  const int m0 = (tiles - 1 - static_cast<int>(blockIdx.x)) * pf_rows;  // longest tiles first
  const int pos0 = p.seq_start[seq] + m0;                         // position of the tile's row 0
  const int kv_len = p.seq_start[seq] + min(m0 + pf_rows, rows);  // keys the tile needs
  const uint32_t kv_head = head / (p.heads / p.kv_heads);
  const int32_t* table = p.block_table + p.seq_table[seq];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int i = tid; i < pf_rows * 16; i += pf_threads) {
    const int r = i >> 4, c = i & 15;
    const bool valid = m0 + r < rows;
    const uint16_t* src = valid ? p.q + static_cast<uint64_t>(row_begin + m0 + r) * p.q_stride +
                                      head * head_dim + c * 8
                                : p.q;
    dev::cp_async16(q_s + dev::swz(r, c), src, valid);
  }
  load_kv_rows(k_s, p.kv, table, p.layer, 0, kv_head, 0, pf_keys, kv_len, tid, pf_threads);
  dev::cp_async_commit();

  const float scale_log2 = p.scale * log2e;
  float o[16][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t qf[8][4];
  const int g = lane >> 2, t = lane & 3;
  const int n_tiles = (kv_len + pf_keys - 1) / pf_keys;
  for (int j = 0; j < n_tiles; ++j) {
    dev::cp_async_wait<0>();
    __syncthreads();  // K_j (and Q) visible; every warp is done with V_{j-1}
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        dev::ldsm_x4(qf[kk], q_s + dev::swz(warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                            kk * 2 + ((lane >> 4) & 1)));
      }
    }
    load_kv_rows(v_s, p.kv, table, p.layer, 1, kv_head, j * pf_keys, pf_keys, kv_len, tid,
                 pf_threads);
    dev::cp_async_commit();

    float s[8][4];
    qk_tile<8>(s, qf, k_s, lane);
    if (j * pf_keys + pf_keys - 1 > pos0) {  // some key of the tile lies after some row: mask
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = j * pf_keys + nt * 8 + 2 * t + (e & 1);
          const int pos = pos0 + warp * 16 + g + (e >> 1) * 8;
          if (key > pos) s[nt][e] = -INFINITY;
        }
      }
    }
    softmax_update<8>(s, m, l, o, scale_log2);

    dev::cp_async_wait<0>();
    __syncthreads();  // V_j visible; every warp is done with K_j
    if (j + 1 < n_tiles) {
      load_kv_rows(k_s, p.kv, table, p.layer, 0, kv_head, (j + 1) * pf_keys, pf_keys, kv_len, tid,
                   pf_threads);
      dev::cp_async_commit();
    }
    pv_tile<8>(o, s, v_s, lane);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int row = m0 + warp * 16 + g + r * 8;
    if (row >= rows) continue;
    uint16_t* dst =
        p.out + static_cast<uint64_t>(row_begin + row) * p.out_stride + head * head_dim + 2 * t;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      *reinterpret_cast<uint32_t*>(dst + nt * 8) =
          dev::pack(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
    }
  }
}

// Variant 2 (the default before variant 0 below): K and V tiles double-buffered, so tile j + 1
// streams in during all of tile j's math; each thread loads half of one row per tile and resolves
// that row's page once, one tile ahead. Variant 1 (prefill_kernel above) is the first,
// single-buffered version.
constexpr int pf2_smem =
    (pf_rows + 4 * pf_keys) * head_dim * 2;  // Q + two stages of K and V: 80 KiB

__global__ void __launch_bounds__(pf_threads) prefill_kernel_v2(prefill_attention_params p) {
  dev::pdl_wait();
  extern __shared__ __align__(128) uint16_t smem[];
  constexpr int tile = pf_keys * head_dim;
  uint16_t* q_s = smem;
  uint16_t* kv_s = q_s + pf_rows * head_dim;  // stage s: K at kv_s + 2 s tile, V right after

  const int seq = blockIdx.z, head = blockIdx.y;
  const int row_begin = p.seq_rows[seq];
  const int rows = p.seq_rows[seq + 1] - row_begin;
  const int tiles = (rows + pf_rows - 1) / pf_rows;
  if (static_cast<int>(blockIdx.x) >= tiles) return;
  const int m0 = (tiles - 1 - static_cast<int>(blockIdx.x)) * pf_rows;  // longest tiles first
  const int pos0 = p.seq_start[seq] + m0;
  const int kv_len = p.seq_start[seq] + min(m0 + pf_rows, rows);
  const uint32_t kv_head = head / (p.heads / p.kv_heads);
  const int32_t* table = p.block_table + p.seq_table[seq];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int row = tid >> 1, half = tid & 1;  // this thread's share of every tile
  const int bt = static_cast<int>(p.kv.block_tokens);
  auto block_of = [&](int key) { return key < kv_len ? table[key / bt] : 0; };
  auto load_tile = [&](int j, int32_t block) {
    const int key = j * pf_keys + row;
    const bool valid = key < kv_len;
    uint16_t* st = kv_s + (j & 1) * 2 * tile;
    load_half_row(st, p.kv, p.layer, 0, kv_head, block, static_cast<uint32_t>(key % bt), row, half,
                  valid);
    load_half_row(st + tile, p.kv, p.layer, 1, kv_head, block, static_cast<uint32_t>(key % bt), row,
                  half, valid);
  };

  {
    const bool valid = m0 + row < rows;
    const uint16_t* src = valid ? p.q + static_cast<uint64_t>(row_begin + m0 + row) * p.q_stride +
                                      head * head_dim + half * 64
                                : p.q;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      dev::cp_async16(q_s + dev::swz(row, half * 8 + i), valid ? src + i * 8 : src, valid);
  }
  const int n_tiles = (kv_len + pf_keys - 1) / pf_keys;
  load_tile(0, block_of(row));
  dev::cp_async_commit();
  int32_t block_next = block_of(pf_keys + row);

  const float scale_log2 = p.scale * log2e;
  float o[16][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t qf[8][4];
  const int g = lane >> 2, t = lane & 3;
  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      load_tile(j + 1, block_next);
      dev::cp_async_commit();
      block_next = block_of((j + 2) * pf_keys + row);
      dev::cp_async_wait<1>();
    } else {
      dev::cp_async_wait<0>();
    }
    __syncthreads();  // tile j (and Q) visible to every warp
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        dev::ldsm_x4(qf[kk], q_s + dev::swz(warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                            kk * 2 + ((lane >> 4) & 1)));
      }
    }
    const uint16_t* k_s = kv_s + (j & 1) * 2 * tile;
    float s[8][4];
    qk_tile<8>(s, qf, k_s, lane);
    if (j * pf_keys + pf_keys - 1 > pos0) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = j * pf_keys + nt * 8 + 2 * t + (e & 1);
          const int pos = pos0 + warp * 16 + g + (e >> 1) * 8;
          if (key > pos) s[nt][e] = -INFINITY;
        }
      }
    }
    softmax_update<8>(s, m, l, o, scale_log2);
    pv_tile<8>(o, s, k_s + tile, lane);
    __syncthreads();  // every warp is done with this stage before iteration j + 1 refills it
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int out_row = m0 + warp * 16 + g + r * 8;
    if (out_row >= rows) continue;
    uint16_t* dst =
        p.out + static_cast<uint64_t>(row_begin + out_row) * p.out_stride + head * head_dim + 2 * t;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      *reinterpret_cast<uint32_t*>(dst + nt * 8) =
          dev::pack(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
    }
  }
}

// Variants 0 (default) and 3: FlashAttention-2's shape. 128 query rows per CTA, 32 per warp (two
// 16-row m-tiles), so every K or V fragment read from shared memory feeds two mma instead of one (the
// 64-row kernels above spend one ldmatrix.x4 per two mma, which saturates shared memory as much as
// the tensor cores). O and S of both m-tiles live in registers; Q fragments are re-read from
// shared memory per k-step. A warp skips the key tiles that lie wholly after its rows.
constexpr int pf3_rows = 128;  // query rows per CTA (4 warps x 32)
constexpr int pf3_smem =
    (pf3_rows + 4 * pf_keys) * head_dim * 2;  // Q + two stages of K and V: 96 KiB

/// s[MT][NT] (MT 16-row m-tiles x 8 NT keys) = q . K^T, the A fragments of q read from swizzled
/// smem rows q_row0 .. q_row0 + 16 MT - 1, K rows swizzled in smem.
template <int MT, int NT>
__device__ __forceinline__ void qk_tile_smem_q(float (&s)[MT][NT][4], const uint16_t* q_smem,
                                               int q_row0, const uint16_t* k_smem, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    uint32_t qa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      dev::ldsm_x4(qa[mt], q_smem + dev::swz(q_row0 + mt * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                             kk * 2 + ((lane >> 4) & 1)));
    }
#pragma unroll
    for (int nn = 0; nn < NT / 2; ++nn) {
      uint32_t b[4];
      dev::ldsm_x4(b, k_smem + dev::swz(nn * 16 + ((lane >> 4) & 1) * 8 + (lane & 7),
                                        kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        dev::mma_bf16(s[mt][2 * nn], qa[mt], b[0], b[1]);
        dev::mma_bf16(s[mt][2 * nn + 1], qa[mt], b[2], b[3]);
      }
    }
  }
}

/// o[MT] (MT m-tiles x 128) += p[MT] (from softmax_update) . V: each V fragment feeds MT mma pairs.
template <int MT, int NT>
__device__ __forceinline__ void pv_tile_mt(float (&o)[MT][16][4], const float (&s)[MT][NT][4],
                                           const uint16_t* v_smem, int lane) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a[mt][0] = dev::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      a[mt][1] = dev::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      a[mt][2] = dev::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      a[mt][3] = dev::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dn = 0; dn < 8; ++dn) {
      uint32_t b[4];
      dev::ldsm_x4_t(b, v_smem + dev::swz(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                          dn * 2 + ((lane >> 4) & 1)));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        dev::mma_bf16(o[mt][2 * dn], a[mt], b[0], b[1]);
        dev::mma_bf16(o[mt][2 * dn + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

/// The CTA's 128 rows are (token, query head) pairs of one KV head's group, row v = token
/// v / group, head v % group, so the K/V tiles it stages serve every query head that reads them
/// (GQA: a quarter of the shared-memory fills for the 8B shape's group of 4; 204 against 187
/// TFLOP/s with 128 tokens of one head per CTA, 8K on the H200).
template <int Sub>
__global__ void __launch_bounds__(pf_threads, 2) prefill_kernel_v3(prefill_attention_params p) {
  dev::pdl_wait();
  extern __shared__ __align__(128) uint16_t smem[];
  constexpr int tile = pf_keys * head_dim;
  constexpr int MT = 2;  // m-tiles per warp
  uint16_t* q_s = smem;
  uint16_t* kv_s = q_s + pf3_rows * head_dim;  // stage s: K at kv_s + 2 s tile, V right after

  const int seq = blockIdx.z;
  const int packed = static_cast<int>(p.heads / p.kv_heads);  // query heads per token (group)
  const uint32_t kv_head = blockIdx.y;
  const int head0 = static_cast<int>(kv_head) * packed;
  const int row_begin = p.seq_rows[seq];
  const int rows = p.seq_rows[seq + 1] - row_begin;
  const int vrows = rows * packed;  // the CTA rows of this sequence and KV head
  const int tiles = (vrows + pf3_rows - 1) / pf3_rows;
  if (static_cast<int>(blockIdx.x) >= tiles) return;
  const int v0 = (tiles - 1 - static_cast<int>(blockIdx.x)) * pf3_rows;  // longest tiles first
  const int start = p.seq_start[seq];
  const int kv_len = start + min((v0 + pf3_rows - 1) / packed + 1, rows);
  const int32_t* table = p.block_table + p.seq_table[seq];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int row = tid >> 1, half = tid & 1;  // this thread's share of every K/V tile
  const int bt = static_cast<int>(p.kv.block_tokens);
  auto block_of = [&](int key) { return key < kv_len ? table[key / bt] : 0; };
  auto load_tile = [&](int j, int32_t block) {
    const int key = j * pf_keys + row;
    const bool valid = key < kv_len;
    uint16_t* st = kv_s + (j & 1) * 2 * tile;
    load_half_row(st, p.kv, p.layer, 0, kv_head, block, static_cast<uint32_t>(key % bt), row, half,
                  valid);
    load_half_row(st + tile, p.kv, p.layer, 1, kv_head, block, static_cast<uint32_t>(key % bt), row,
                  half, valid);
  };

  {  // Q: thread tid loads CTA row tid (16 chunks of 16 bytes)
    const int v = v0 + tid;
    const bool valid = v < vrows;
    const uint16_t* src = valid ? p.q + static_cast<uint64_t>(row_begin + v / packed) * p.q_stride +
                                      (head0 + v % packed) * head_dim
                                : p.q;
#pragma unroll
    for (int c = 0; c < 16; ++c)
      dev::cp_async16(q_s + dev::swz(tid, c), valid ? src + c * 8 : src, valid);
  }
  const int n_tiles = (kv_len + pf_keys - 1) / pf_keys;
  load_tile(0, block_of(row));
  dev::cp_async_commit();
  int32_t block_next = block_of(pf_keys + row);

  const float scale_log2 = p.scale * log2e;
  float o[MT][16][4] = {};
  float m[MT][2], l[MT][2];
  int pos[MT][2];  // positions of this thread's rows g and g + 8 of each m-tile
  const int g = lane >> 2, t = lane & 3;
  const int wv0 = v0 + warp * 16 * MT;  // this warp's first CTA row
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[mt][r] = -INFINITY;
      l[mt][r] = 0.0f;
      pos[mt][r] = start + (wv0 + mt * 16 + g + r * 8) / packed;
    }
  }
  const int warp_first = start + wv0 / packed;                 // its rows' first position
  const int warp_last = start + (wv0 + 16 * MT - 1) / packed;  // and last
  const bool warp_has_rows = wv0 < vrows;
  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) {
      load_tile(j + 1, block_next);
      dev::cp_async_commit();
      block_next = block_of((j + 2) * pf_keys + row);
      dev::cp_async_wait<1>();
    } else {
      dev::cp_async_wait<0>();
    }
    __syncthreads();  // tile j (and Q) visible to every warp
    // The tile in sub-tiles of Sub keys, one softmax step each. Sub = 64 (variant 0) reads each
    // Q fragment once per tile but spills 20 bytes; Sub = 32 (variant 3) fits the register file
    // and re-reads Q per sub-tile. 64 measured faster on the H200 (223 vs 204 TFLOP/s, 8K).
#pragma unroll
    for (int sub = 0; sub < pf_keys / Sub; ++sub) {
      const int key0 = j * pf_keys + sub * Sub;
      // Every key after every row of this warp, or the warp holds only padding rows: nothing to do.
      if (key0 > warp_last || !warp_has_rows) continue;
      const uint16_t* k_s = kv_s + (j & 1) * 2 * tile + sub * Sub * head_dim;
      float s[MT][Sub / 8][4];
      qk_tile_smem_q<MT, Sub / 8>(s, q_s, warp * 16 * MT, k_s, lane);
      if (key0 + Sub - 1 > warp_first) {  // some key lies after some row: mask
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int nt = 0; nt < Sub / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int key = key0 + nt * 8 + 2 * t + (e & 1);
              if (key > pos[mt][e >> 1]) s[mt][nt][e] = -INFINITY;
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        tile::softmax_update_lazy<Sub / 8>(s[mt], m[mt], l[mt], o[mt], scale_log2);
      pv_tile_mt<MT, Sub / 8>(o, s, k_s + tile, lane);
    }
    __syncthreads();  // every warp is done with this stage before iteration j + 1 refills it
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const int v = wv0 + mt * 16 + g + r * 8;
      if (v >= vrows) continue;
      uint16_t* dst = p.out + static_cast<uint64_t>(row_begin + v / packed) * p.out_stride +
                      (head0 + v % packed) * head_dim + 2 * t;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        *reinterpret_cast<uint32_t*>(dst + nt * 8) =
            dev::pack(o[mt][nt][2 * r] * inv, o[mt][nt][2 * r + 1] * inv);
      }
    }
  }
}

// ------------------------------------------------------------------------------------ decode

constexpr int dc_keys = 32;  // keys per warp tile
constexpr int dc_warps = 4;
constexpr int dc_threads = dc_warps * 32;
constexpr int dc_smem = dc_warps * 2 * dc_keys * head_dim * 2;  // K and V tile per warp: 64 KiB

struct decode_workspace {
  uint32_t* counters;  // [batch, kv_heads]
  float* partial_o;    // [batch, heads, max_splits, 128]
  float* partial_ml;   // [batch, heads, max_splits, 2]
};

__host__ __device__ inline uint64_t align256(uint64_t v) {
  return (v + 255) / 256 * 256;
}

// The counters come first, sized for the batch the workspace was made for: they keep their place
// whatever the batch of a launch, so a counter is never where a smaller batch's partials were
// written (counters must read zero when a launch starts).
__host__ __device__ inline decode_workspace carve(void* base, const decode_attention_params& p) {
  const uint32_t counter_rows = p.workspace_batch > 0 ? p.workspace_batch : p.batch;
  char* at = static_cast<char*>(base);
  decode_workspace w;
  w.counters = reinterpret_cast<uint32_t*>(at);
  at += align256(uint64_t{counter_rows} * p.kv_heads * 4);
  w.partial_o = reinterpret_cast<float*>(at);
  at += align256(uint64_t{p.batch} * p.heads * p.max_splits * head_dim * 4);
  w.partial_ml = reinterpret_cast<float*>(at);
  return w;
}

/// The split of a sequence of `len` keys: `chunk` keys per CTA (a multiple of the warp tile of
/// `tile_keys`), `splits` CTAs.
__device__ __forceinline__ void split_of(int len, const decode_attention_params& p, int tile_keys,
                                         int& chunk, int& splits) {
  const int min_keys = max(static_cast<int>(p.split_min_keys), 1);
  int want = min(static_cast<int>(p.max_splits), (len + min_keys - 1) / min_keys);
  want = max(want, 1);
  chunk = ((len + want - 1) / want + tile_keys - 1) / tile_keys * tile_keys;
  splits = (len + chunk - 1) / chunk;
}

/// The query rows of sequence b's GQA group of kv_head as mma A fragments, read straight from
/// global memory (rows >= group: 0); g, t: the lane's row group and column pair.
__device__ __forceinline__ void load_query_fragments(uint32_t (&qf)[8][4],
                                                     const decode_attention_params& p, int b,
                                                     int kv_head, int group, int g, int t) {
  const uint16_t* qrow = p.q + static_cast<uint64_t>(b) * p.q_stride +
                         static_cast<uint64_t>(kv_head) * group * head_dim;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
    for (int ri = 0; ri < 4; ++ri) {
      const int row = g + (ri & 1) * 8, col = kk * 16 + 2 * t + (ri >> 1) * 8;
      qf[kk][ri] =
          row < group ? *reinterpret_cast<const uint32_t*>(qrow + row * head_dim + col) : 0u;
    }
  }
}

/// The end of a decode CTA: merges its four warps' (m, l, o) through shared memory, writes the
/// result (one split) or its partial (several), and the last CTA of the (sequence, KV head) to
/// finish merges every split's partial into the output.
__device__ __forceinline__ void decode_finish(const decode_attention_params& p, uint16_t* smem,
                                              const float (&o)[16][4], const float (&m)[2],
                                              const float (&l)[2], int b, int kv_head, int split,
                                              int splits, float scale_log2) {
  __shared__ bool last_cta;
  const int group = p.heads / p.kv_heads;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  __syncthreads();  // every warp is done with its tiles: the shared memory is reused
  float* so = reinterpret_cast<float*>(smem);  // [warp][16 rows][128]
  float* sm = so + dc_warps * 16 * head_dim;   // [warp][16]
  float* sl = sm + dc_warps * 16;              // [warp][16]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = g + r * 8;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      so[(warp * 16 + row) * head_dim + nt * 8 + 2 * t] = o[nt][2 * r];
      so[(warp * 16 + row) * head_dim + nt * 8 + 2 * t + 1] = o[nt][2 * r + 1];
    }
    if (t == 0) {
      sm[warp * 16 + row] = m[r];
      sl[warp * 16 + row] = sum;
    }
  }
  __syncthreads();
  const decode_workspace ws = carve(p.workspace, p);
  const int d = tid;  // 128 threads, one dimension each
  for (int r = 0; r < group; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < dc_warps; ++w) mx = fmaxf(mx, sm[w * 16 + r]);
    float sum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < dc_warps; ++w) {
      const float f =
          sm[w * 16 + r] == -INFINITY ? 0.0f : exp2f((sm[w * 16 + r] - mx) * scale_log2);
      sum += sl[w * 16 + r] * f;
      acc += so[(w * 16 + r) * head_dim + d] * f;
    }
    const int h = kv_head * group + r;
    if (splits == 1) {
      p.out[static_cast<uint64_t>(b) * p.out_stride + h * head_dim + d] = dev::to_bf(acc / sum);
    } else {
      const uint64_t at = (static_cast<uint64_t>(b) * p.heads + h) * p.max_splits + split;
      ws.partial_o[at * head_dim + d] = acc;
      if (d == 0) {
        ws.partial_ml[at * 2] = mx;
        ws.partial_ml[at * 2 + 1] = sum;
      }
    }
  }
  if (splits == 1) return;

  __threadfence();
  __syncthreads();
  if (tid == 0) {
    uint32_t* counter = ws.counters + static_cast<uint64_t>(b) * p.kv_heads + kv_head;
    const uint32_t before = atomicAdd(counter, 1u);
    last_cta = before == static_cast<uint32_t>(splits - 1);
    if (last_cta) atomicExch(counter, 0u);
  }
  __syncthreads();
  if (!last_cta) return;
  __threadfence();
  // Every split's (m, l) of the group into shared memory first, then one pass per row.
  float* ml = so;  // [group][splits][2]
  for (int i = tid; i < group * splits; i += dc_threads) {
    const int r = i / splits, s = i % splits;
    const uint64_t at =
        (static_cast<uint64_t>(b) * p.heads + kv_head * group + r) * p.max_splits + s;
    ml[i * 2] = __ldcg(ws.partial_ml + at * 2);
    ml[i * 2 + 1] = __ldcg(ws.partial_ml + at * 2 + 1);
  }
  __syncthreads();
  for (int r = 0; r < group; ++r) {
    const int h = kv_head * group + r;
    const uint64_t at0 = (static_cast<uint64_t>(b) * p.heads + h) * p.max_splits;
    const float* mlr = ml + r * splits * 2;
    float mx = -INFINITY;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, mlr[s * 2]);
    float sum = 0.0f, acc = 0.0f;
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float f = exp2f((mlr[s * 2] - mx) * scale_log2);
      sum += mlr[s * 2 + 1] * f;
      acc += __ldcg(ws.partial_o + (at0 + s) * head_dim + d) * f;
    }
    p.out[static_cast<uint64_t>(b) * p.out_stride + h * head_dim + d] = dev::to_bf(acc / sum);
  }
}

__global__ void __launch_bounds__(dc_threads) decode_kernel(decode_attention_params p) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  extern __shared__ __align__(128) uint16_t smem[];
  const int b = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x;
  const int group = p.heads / p.kv_heads;
  const int len = p.seq_lens[b];
  if (len <= 0) {  // nothing to attend: zeros (the precondition asks for len >= 1)
    if (split == 0) {
      for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) {
        p.out[static_cast<uint64_t>(b) * p.out_stride + (kv_head * group) * head_dim + i] = 0;
      }
    }
    return;
  }
  int chunk, splits;
  split_of(len, p, dc_keys, chunk, splits);
  if (split >= splits) return;
  const int k_begin = split * chunk, k_end = min(len, k_begin + chunk);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int32_t* table = p.block_table + p.seq_table[b];
  const float scale_log2 = p.scale * log2e;

  uint32_t qf[8][4];
  load_query_fragments(qf, p, b, kv_head, group, g, t);

  float o[16][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint16_t* k_w = smem + warp * 2 * dc_keys * head_dim;
  uint16_t* v_w = k_w + dc_keys * head_dim;
  for (int key0 = k_begin + warp * dc_keys; key0 < k_end; key0 += dc_warps * dc_keys) {
    load_kv_rows(k_w, p.kv, table, p.layer, 0, kv_head, key0, dc_keys, k_end, lane, 32);
    load_kv_rows(v_w, p.kv, table, p.layer, 1, kv_head, key0, dc_keys, k_end, lane, 32);
    dev::cp_async_commit();
    dev::cp_async_wait<0>();
    __syncwarp();
    float s[4][4];
    qk_tile<4>(s, qf, k_w, lane);
    if (key0 + dc_keys > k_end) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (key0 + nt * 8 + 2 * t + (e & 1) >= k_end) s[nt][e] = -INFINITY;
        }
      }
    }
    softmax_update<4>(s, m, l, o, scale_log2);
    pv_tile<4>(o, s, v_w, lane);
    __syncwarp();
  }

  decode_finish(p, smem, o, m, l, b, kv_head, split, splits, scale_log2);
}

// Variant 0 (default): each warp streams 16-key tiles (one page at block_tokens 16) through two
// shared-memory stages, so the next tile loads while this one is computed; each half-warp copies
// whole rows. Where a page holds whole tiles (block_tokens a multiple of 16: `page_tiles`), a tile
// is one contiguous 4 KiB run of K and one of V: one page-table read per tile, and every lane's
// eight rows sit at fixed offsets from one address (ncu at batch 256: resolving a page and a
// slot per row by division was most of the 1,160 instructions a warp issued per tile, and kept
// the kernel issue-bound at 68 % of DRAM bandwidth). Otherwise each lane resolves its rows' pages
// one tile ahead. The first tile is requested before the wait for the kernel before (PDL): the
// lengths and page tables were uploaded before the step, and every key but the newest, which
// the RoPE kernel just before appends, was written by earlier steps. Probabilities are taken
// against a running maximum that moves only when a row's grows by more than 2^8
// (softmax_update_lazy): O is rescaled a few times per sequence instead of once per tile.
// Variant 1 (decode_kernel above) is the first, single-buffered version.
constexpr int dc2_keys = 16;
constexpr int dc2_smem =
    dc_warps * 2 * 2 * dc2_keys * head_dim * 2;  // warps x stages x (K, V): 64 KiB

template <bool page_tiles>
__global__ void __launch_bounds__(dc_threads, decode_attention_ctas_per_sm)
    decode_kernel_v2(decode_attention_params p) {
  extern __shared__ __align__(128) uint16_t smem[];
  const int b = blockIdx.z, kv_head = blockIdx.y, split = blockIdx.x;
  const int group = p.heads / p.kv_heads;
  const int len = p.seq_lens[b];
  if (len <= 0) {
    dev::pdl_wait();
    dev::pdl_launch_dependents();
    if (split == 0) {
      for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) {
        p.out[static_cast<uint64_t>(b) * p.out_stride + (kv_head * group) * head_dim + i] = 0;
      }
    }
    return;
  }
  int chunk, splits;
  split_of(len, p, dc2_keys, chunk, splits);
  if (split >= splits) return;
  const int k_begin = split * chunk, k_end = min(len, k_begin + chunk);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int32_t* table = p.block_table + p.seq_table[b];
  const float scale_log2 = p.scale * log2e;
  const int bt = static_cast<int>(p.kv.block_tokens);

  constexpr int tile = dc2_keys * head_dim;
  constexpr int rows_per_lane = dc2_keys * 16 / 32;  // 16-byte chunks of the tile per lane: 8
  uint16_t* wbuf = smem + warp * 4 * tile;  // stage s: K at wbuf + 2 s tile, V right after
  // Lane l copies chunk l % 16 of rows l / 16, l / 16 + 2, ...: the 16 lanes of a half-warp copy
  // one whole 256-byte row, so each request covers whole 32-byte sectors (half a row per lane
  // asked for every sector twice, and ncu showed L2 at 83 % with DRAM at 42 %).
  const int crow = lane >> 4, cchunk = lane & 15;
  const uint64_t v_delta = uint64_t{p.kv.kv_heads} * p.kv.block_tokens * head_dim;  // K -> V
  // The pages of the next tile: one per tile (page_tiles), else one per row of this lane.
  int32_t blk[page_tiles ? 1 : rows_per_lane];
  auto pages_of = [&](int key0) {
    if constexpr (page_tiles) {
      blk[0] = key0 < k_end ? table[key0 / bt] : 0;
    } else {
#pragma unroll
      for (int it = 0; it < rows_per_lane; ++it) {
        const int key = key0 + crow + 2 * it;
        blk[it] = key < k_end ? table[key / bt] : 0;
      }
    }
  };
  auto load_tile = [&](int stage, int key0) {
    uint16_t* st = wbuf + stage * 2 * tile;
    if constexpr (page_tiles) {
      const uint16_t* src = p.kv.pool + static_cast<uint64_t>(blk[0]) * p.kv.block_elems +
                            p.kv.offset(p.layer, 0, kv_head, static_cast<uint32_t>(key0 % bt)) +
                            crow * head_dim + cchunk * 8;
#pragma unroll
      for (int it = 0; it < rows_per_lane; ++it) {
        const int r = crow + 2 * it;
        const bool valid = key0 + r < k_end;
        const uint16_t* row = valid ? src + 2 * it * head_dim : p.kv.pool;
        dev::cp_async16(st + dev::swz(r, cchunk), row, valid);
        dev::cp_async16(st + tile + dev::swz(r, cchunk), valid ? row + v_delta : row, valid);
      }
    } else {
#pragma unroll
      for (int it = 0; it < rows_per_lane; ++it) {
        const int r = crow + 2 * it, key = key0 + r;
        const bool valid = key < k_end;
        const uint16_t* src =
            valid
                ? p.kv.pool + static_cast<uint64_t>(blk[it]) * p.kv.block_elems +
                      p.kv.offset(p.layer, 0, kv_head, static_cast<uint32_t>(key % bt)) + cchunk * 8
                : p.kv.pool;
        dev::cp_async16(st + dev::swz(r, cchunk), src, valid);
        dev::cp_async16(st + tile + dev::swz(r, cchunk), valid ? src + v_delta : src, valid);
      }
    }
  };
  constexpr int step = dc_warps * dc2_keys;
  int key0 = k_begin + warp * dc2_keys;
  // A first tile without the newest key (len - 1) streams in while the kernel before finishes.
  const bool early = key0 < k_end && key0 + dc2_keys <= len - 1;
  if (key0 < k_end) pages_of(key0);
  if (early) {
    load_tile(0, key0);
    dev::cp_async_commit();
  }
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  if (key0 < k_end && !early) {
    load_tile(0, key0);
    dev::cp_async_commit();
  }
  pages_of(key0 + step);

  uint32_t qf[8][4];
  load_query_fragments(qf, p, b, kv_head, group, g, t);

  float o[16][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  for (int i = 0; key0 < k_end; ++i, key0 += step) {
    if (key0 + step < k_end) {
      load_tile((i + 1) & 1, key0 + step);
      dev::cp_async_commit();
      pages_of(key0 + 2 * step);
      dev::cp_async_wait<1>();
    } else {
      dev::cp_async_wait<0>();
    }
    __syncwarp();
    const uint16_t* k_w = wbuf + (i & 1) * 2 * tile;
    float s[2][4];
    qk_tile<2>(s, qf, k_w, lane);
    if (key0 + dc2_keys > k_end) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (key0 + nt * 8 + 2 * t + (e & 1) >= k_end) s[nt][e] = -INFINITY;
        }
      }
    }
    tile::softmax_update_lazy<2>(s, m, l, o, scale_log2);
    pv_tile<2>(o, s, k_w + tile, lane);
    __syncwarp();  // this stage is refilled next iteration
  }
  decode_finish(p, smem, o, m, l, b, kv_head, split, splits, scale_log2);
}

}  // namespace

kstatus prefill_attention(const prefill_attention_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(p.kv.head_dim == head_dim, "prefill_attention: head_dim must be 128");
  DUET_KREQUIRE(p.kv_heads > 0 && p.heads % p.kv_heads == 0 && p.kv_heads == p.kv.kv_heads,
                "prefill_attention: kv_heads must divide heads and match the pool");
  DUET_KREQUIRE(p.q_stride % 8 == 0 && p.out_stride % 8 == 0,
                "prefill_attention: strides must be multiples of 8");
  DUET_KREQUIRE(p.layer < p.kv.layers && p.kv.block_tokens > 0,
                "prefill_attention: bad layer or block size");
  DUET_KREQUIRE(
      p.q && p.out && p.kv.pool && p.block_table && p.seq_rows && p.seq_start && p.seq_table,
      "prefill_attention: null pointer");
  DUET_KREQUIRE(p.heads <= 65535 && p.seqs <= 65535,
                "prefill_attention: too many heads or sequences");
  if (p.seqs == 0 || p.max_seq_rows == 0) return {};
  DUET_KREQUIRE(p.variant <= 6, "prefill_attention: variant must be 0 to 6");
  DUET_KREQUIRE(uint64_t{p.max_seq_rows} * (p.heads / p.kv_heads) < (1u << 31),
                "prefill_attention: too many rows");
  const dim3 grid((p.max_seq_rows + pf_rows - 1) / pf_rows, p.heads, p.seqs);
  switch (p.variant) {
    case 4:
    case 5:
    case 6: return prefill_attention_wgmma(p, stream);
    case 0: {
      const uint32_t vrows = p.max_seq_rows * (p.heads / p.kv_heads);
      const dim3 grid0((vrows + pf3_rows - 1) / pf3_rows, p.kv_heads, p.seqs);
      DUET_KCHECK(cudaFuncSetAttribute(prefill_kernel_v3<64>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, pf3_smem));
      DUET_KCHECK(launch(prefill_kernel_v3<64>, grid0, dim3(pf_threads), pf3_smem, stream, p));
      break;
    }
    case 3: {
      const uint32_t vrows = p.max_seq_rows * (p.heads / p.kv_heads);
      const dim3 grid3((vrows + pf3_rows - 1) / pf3_rows, p.kv_heads, p.seqs);
      DUET_KCHECK(cudaFuncSetAttribute(prefill_kernel_v3<32>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, pf3_smem));
      DUET_KCHECK(launch(prefill_kernel_v3<32>, grid3, dim3(pf_threads), pf3_smem, stream, p));
      break;
    }
    case 1: DUET_KCHECK(launch(prefill_kernel, grid, dim3(pf_threads), pf_smem, stream, p)); break;
    default:
      DUET_KCHECK(cudaFuncSetAttribute(prefill_kernel_v2,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, pf2_smem));
      DUET_KCHECK(launch(prefill_kernel_v2, grid, dim3(pf_threads), pf2_smem, stream, p));
  }
  return {};
}

uint64_t decode_attention_workspace_bytes(uint32_t batch, uint32_t heads, uint32_t kv_heads,
                                          uint32_t max_splits) {
  return align256(uint64_t{batch} * kv_heads * 4) +
         align256(uint64_t{batch} * heads * max_splits * head_dim * 4) +
         align256(uint64_t{batch} * heads * max_splits * 2 * 4);
}

kstatus decode_attention(const decode_attention_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(p.kv.head_dim == head_dim, "decode_attention: head_dim must be 128");
  DUET_KREQUIRE(p.kv_heads > 0 && p.heads % p.kv_heads == 0 && p.kv_heads == p.kv.kv_heads,
                "decode_attention: kv_heads must divide heads and match the pool");
  DUET_KREQUIRE(p.heads / p.kv_heads <= 16, "decode_attention: at most 16 query heads per KV head");
  DUET_KREQUIRE(p.max_splits >= 1 && p.max_splits <= decode_attention_max_splits,
                "decode_attention: max_splits out of range");
  DUET_KREQUIRE(p.q_stride % 2 == 0, "decode_attention: q_stride must be even");
  DUET_KREQUIRE(p.layer < p.kv.layers && p.kv.block_tokens > 0,
                "decode_attention: bad layer or block size");
  DUET_KREQUIRE(
      p.q && p.out && p.kv.pool && p.block_table && p.seq_table && p.seq_lens && p.workspace,
      "decode_attention: null pointer");
  DUET_KREQUIRE(p.batch <= 65535, "decode_attention: batch over 65535");
  DUET_KREQUIRE(p.workspace_batch == 0 || p.batch <= p.workspace_batch,
                "decode_attention: batch over the workspace's workspace_batch");
  if (p.batch == 0) return {};
  // Variants 2 to 6 exist for prefill only; decode runs its default then.
  DUET_KREQUIRE(p.variant <= 6, "decode_attention: variant must be 0 to 6");
  const dim3 grid(p.max_splits, p.kv_heads, p.batch);
  if (p.variant == 1) {
    DUET_KCHECK(
        cudaFuncSetAttribute(decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dc_smem));
    DUET_KCHECK(launch(decode_kernel, grid, dim3(dc_threads), dc_smem, stream, p));
  } else {
    // Pages of whole 16-key tiles: one page lookup per tile.
    auto* kernel =
        p.kv.block_tokens % dc2_keys == 0 ? decode_kernel_v2<true> : decode_kernel_v2<false>;
    DUET_KCHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dc2_smem));
    DUET_KCHECK(launch(kernel, grid, dim3(dc_threads), dc2_smem, stream, p));
  }
  return {};
}

}  // namespace duet::kernels
