#include "kernels/attention_wgmma.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

#include "kernels/attention_tile.cuh"
#include "kernels/device_util.cuh"
#include "kernels/launch.cuh"

// Flash attention with both GEMMs on wgmma (FlashAttention-3's core): a CTA's two consumer
// warpgroups own 128 packed (token, query head) rows of one KV head, 64 each, and walk the keys in
// tiles of 128. S = Q K^T reads Q and K from shared memory (both K-major); O += P V takes P from
// registers (the accumulator of S, rounded to bf16, is already in the A-fragment layout) and V
// from shared memory (N-major, wgmma transposes it). Tiles are stored 128B-swizzled, the layout
// the descriptors name, in three stages, so tiles j + 1 and j + 2 load while tile j is computed
// (224 KiB of shared memory, one CTA per SM). Two ways to load them:
//   variant 4: every consumer thread copies its share with cp.async, and the whole CTA meets at a
//     barrier per tile;
//   variant 5: a ninth warp is the producer: it copies whole KV blocks with TMA (one
//     cp.async.bulk.tensor per block half, swizzled by the copy engine) onto a "full" mbarrier per
//     stage and refills a stage when all eight consumer warps have arrived on its "empty" one, so
//     the two warpgroups never wait for each other and drift into overlapping one's softmax with
//     the other's GEMMs;
//   variant 6: variant 5 with the warpgroups taking turns to issue their S GEMMs (named barriers),
//     so that one's softmax overlaps the other's GEMM by construction.

namespace duet::kernels {

namespace {

constexpr int head_dim = 128;
constexpr int cta_rows = 128;   // two warpgroups of 64 rows, one wgmma M each
constexpr int tile_keys = 128;  // keys per K/V tile: the N of S
constexpr int consumer_threads = 256;
constexpr int producer_threads = 32;  // variant 5's producer warp
constexpr int q_bytes = cta_rows * head_dim * 2;    // 32 KiB
constexpr int kv_bytes = tile_keys * head_dim * 2;  // K or V tile: 32 KiB
constexpr int stage_bytes = 2 * kv_bytes;
constexpr int stages = 3;
constexpr int barrier_bytes = 2 * stages * 8;  // variant 5: full[stages], empty[stages]
// + 1 KiB to align the tiles to 1024 bytes (the swizzle atom).
constexpr int wgmma_smem = 1024 + q_bytes + stages * stage_bytes + barrier_bytes;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr float log2e = 1.4426950408889634f;
constexpr int wg_rows = 64;                  // rows per warpgroup
constexpr int half_bytes = tile_keys * 128;  // one 64-column half of a K or V tile

/// Byte offset of 16-byte chunk c (0..15) of row r in a tile of `rows` rows of 128 bf16, stored
/// as two 64-column halves of 128-byte rows with the 128B swizzle (chunk c % 8 of row r at
/// c % 8 ^ r % 8 within its row): what a swizzle-128B descriptor reads and a swizzle-128B TMA
/// copy writes. Halves and 8-row groups sit on 1024-byte boundaries.
__device__ __forceinline__ uint32_t sw128(int rows, int r, int c) {
  return static_cast<uint32_t>((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

/// A wgmma shared-memory descriptor, swizzle 128B: start address, leading and stride byte
/// offsets (PTX ISA "Matrix Descriptor Format").
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 |
         static_cast<uint64_t>(sbo >> 4) << 32 | 1ull << 62;
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
/// Makes this thread's generic-proxy writes to shared memory (cp.async) visible to wgmma.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/// Pins registers a wgmma reads or writes asynchronously: the compiler may not move or reuse
/// them across this point (CUTLASS's warpgroup_fence_operand).
__device__ __forceinline__ void fence_regs(float (&d)[16][4]) {
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}
__device__ __forceinline__ void fence_regs(uint32_t (&a)[8][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// mbarriers and TMA (variant 5).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
/// Spins until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_again:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_again;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
/// TMA: the box at (column c0, row c1) of the tensor `map` into shared memory at dst, completing
/// its bytes on mbarrier `bar`.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The 64 fp32 accumulator registers of a m64n128 wgmma: the PTX operand list and the asm outputs.
#define DUET_WGMMA_D_REGS \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DUET_WGMMA_D_OUTS(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
  "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
  "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
  "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
  "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
  "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
  "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
  "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
  "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
  "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
  "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
  "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
  "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
  "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])

/// d (64 x 128, fp32) = (scale_d ? d : 0) + A . B: A (64 x 16) and B (16 x 128) read from shared
/// memory through descriptors, both K-major.
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[16][4], uint64_t desc_a,
                                                    uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DUET_WGMMA_D_REGS
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : DUET_WGMMA_D_OUTS(d)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

/// d (64 x 128, fp32) += A . B: A (64 x 16) in registers (each warp's 16 rows as mma.m16n8k16 A
/// fragments), B (16 x 128) read from shared memory through a descriptor, MN-major (transposed).
__device__ __forceinline__ void wgmma_rs_m64n128k16_tb(float (&d)[16][4], const uint32_t (&a)[4],
                                                       uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" DUET_WGMMA_D_REGS
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : DUET_WGMMA_D_OUTS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

#undef DUET_WGMMA_D_OUTS
#undef DUET_WGMMA_D_REGS

/// What a CTA works on: 128 packed rows of one sequence and KV head (row v = token v / packed,
/// head v % packed), the longest tiles first.
struct cta_work {
  int packed, head0, row_begin, vrows, v0, start, kv_len;
  uint32_t kv_head;
  const int32_t* table;

  /// False when the grid's x over-covers this sequence.
  __device__ __forceinline__ bool init(const prefill_attention_params& p) {
    const int seq = blockIdx.z;
    packed = static_cast<int>(p.heads / p.kv_heads);
    kv_head = blockIdx.y;
    head0 = static_cast<int>(kv_head) * packed;
    row_begin = p.seq_rows[seq];
    const int rows = p.seq_rows[seq + 1] - row_begin;
    vrows = rows * packed;
    const int tiles = (vrows + cta_rows - 1) / cta_rows;
    if (static_cast<int>(blockIdx.x) >= tiles) return false;
    v0 = (tiles - 1 - static_cast<int>(blockIdx.x)) * cta_rows;
    start = p.seq_start[seq];
    kv_len = start + min((v0 + cta_rows - 1) / packed + 1, rows);
    table = p.block_table + p.seq_table[seq];
    return true;
  }
  [[nodiscard]] __device__ __forceinline__ int n_tiles() const {
    return (kv_len + tile_keys - 1) / tile_keys;
  }
};

/// Q rows of the CTA into swizzled shared memory by the 256 consumer threads, a thread pair a
/// row, this thread its chunks of parity tid & 1: every warp copy then reads whole 32-byte
/// sectors (load_half_row in attention.cu).
__device__ __forceinline__ void load_q(const prefill_attention_params& p, const cta_work& w,
                                       uint32_t q_s, int tid) {
  const int row = tid >> 1, par = tid & 1;
  const int v = w.v0 + row;
  const bool valid = v < w.vrows;
  const uint16_t* src = valid ? p.q + static_cast<uint64_t>(w.row_begin + v / w.packed) * p.q_stride +
                                    (w.head0 + v % w.packed) * head_dim
                              : p.q;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = 2 * i + par;
    cp_async16(q_s + sw128(cta_rows, row, c), valid ? src + c * 8 : src, valid);
  }
}

/// One consumer warpgroup's running state: its 64 rows of O, maxima and sums, as each thread
/// holds them (rows g and g + 8 of its warp's 16).
struct wg_rows_state {
  float o[16][4] = {};
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  int pos[2];       // positions of this thread's two rows
  int first, last;  // positions of the warpgroup's first and last rows
  int v0;           // its first CTA row
  bool has_rows;    // some of its rows are real (not padding past the sequence)

  __device__ __forceinline__ void init(const cta_work& w, int wg, int warp, int lane) {
    v0 = w.v0 + wg * wg_rows;
    for (int r = 0; r < 2; ++r) pos[r] = w.start + (v0 + warp * 16 + (lane >> 2) + r * 8) / w.packed;
    first = w.start + v0 / w.packed;
    last = w.start + (v0 + wg_rows - 1) / w.packed;
    has_rows = v0 < w.vrows;
  }
  /// Warpgroup-uniform: some key of the tile at key0 lies at or before some real row.
  [[nodiscard]] __device__ __forceinline__ bool needs(int key0) const {
    return has_rows && key0 <= last;
  }
};

/// Named barriers 1 and 2 order the two warpgroups' S GEMMs (variant 6): a warpgroup syncs on its
/// own before issuing and arrives on the other's once issued, so one's S GEMM runs while the
/// other does its softmax (FlashAttention-3's ping-pong).
__device__ __forceinline__ void turn_wait(int wg) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + wg), "n"(consumer_threads) : "memory");
}
__device__ __forceinline__ void turn_pass(int wg) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(2 - wg), "n"(consumer_threads) : "memory");
}

/// One K/V tile's flash-attention step for a warpgroup: S = Q K^T, causal mask, online softmax,
/// O += P V. q_wg, k_t, v_t: shared addresses of the warpgroup's Q rows and the tile's K and V.
/// pass_turn: after issuing S, hand the tensor cores' turn to the other warpgroup (variant 6).
__device__ __forceinline__ void tile_step(wg_rows_state& st, uint32_t q_wg, uint32_t k_t,
                                          uint32_t v_t, int key0, int t, float scale_log2,
                                          bool pass_turn = false, int wg = 0) {
  float s[16][4] = {};
  fence_regs(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {  // 16 columns of the head a step; halves of 64 columns
    const uint32_t col = static_cast<uint32_t>((kk >> 2) * 16384 + (kk & 3) * 32);
    wgmma_ss_m64n128k16(s, smem_desc(q_wg + col, 16, 1024), smem_desc(k_t + col, 16, 1024), kk);
  }
  wgmma_commit();
  if (pass_turn) turn_pass(wg);
  wgmma_wait_all();
  fence_regs(s);
  if (key0 + tile_keys - 1 > st.first) {  // some key lies after some row: mask
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (key0 + nt * 8 + 2 * t + (e & 1) > st.pos[e >> 1]) s[nt][e] = -INFINITY;
      }
    }
  }
  tile::softmax_update_lazy<16>(s, st.m, st.l, st.o, scale_log2);
  uint32_t a[8][4];
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    a[kk][0] = dev::pack(s[2 * kk][0], s[2 * kk][1]);
    a[kk][1] = dev::pack(s[2 * kk][2], s[2 * kk][3]);
    a[kk][2] = dev::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[kk][3] = dev::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
  fence_regs(st.o);
  fence_regs(a);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)  // 16 keys a step: V rows 16 kk.., both 64-column halves
    wgmma_rs_m64n128k16_tb(st.o, a[kk], smem_desc(v_t + kk * 2048, half_bytes, 1024));
  wgmma_commit();
  wgmma_wait_all();
  fence_regs(st.o);
  fence_regs(a);
}

/// O / l of this thread's two rows to p.out.
__device__ __forceinline__ void store_rows(const prefill_attention_params& p, const cta_work& w,
                                           const wg_rows_state& st, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = st.l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int v = st.v0 + warp * 16 + g + r * 8;
    if (v >= w.vrows) continue;
    uint16_t* dst = p.out + static_cast<uint64_t>(w.row_begin + v / w.packed) * p.out_stride +
                    (w.head0 + v % w.packed) * head_dim + 2 * t;
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) {
      *reinterpret_cast<uint32_t*>(dst + nt * 8) =
          dev::pack(st.o[nt][2 * r] * inv, st.o[nt][2 * r + 1] * inv);
    }
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

__global__ void __launch_bounds__(consumer_threads, 1)
    prefill_kernel_wgmma(prefill_attention_params p) {
  dev::pdl_wait();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t q_s = (dev::smem_addr(smem_raw) + 1023) & ~1023u;  // shared-window addresses
  const uint32_t kv_s = q_s + q_bytes;  // stage s: K at kv_s + s stage_bytes, V kv_bytes after
  cta_work w;
  if (!w.init(p)) return;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int row = tid >> 1, par = tid & 1;  // as load_q: a thread pair per K/V row
  const int bt = static_cast<int>(p.kv.block_tokens);
  auto block_of = [&](int key) { return key < w.kv_len ? w.table[key / bt] : 0; };
  auto load_tile = [&](int j, int32_t block) {
    const int key = j * tile_keys + row;
    const bool valid = key < w.kv_len;
    const uint32_t stage = kv_s + static_cast<uint32_t>(j % stages) * stage_bytes;
#pragma unroll
    for (uint32_t sel = 0; sel < 2; ++sel) {
      const uint16_t* src =
          valid ? p.kv.pool + static_cast<uint64_t>(block) * p.kv.block_elems +
                      p.kv.offset(p.layer, sel, w.kv_head, static_cast<uint32_t>(key % bt))
                : p.kv.pool;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = 2 * i + par;
        cp_async16(stage + sel * kv_bytes + sw128(tile_keys, row, c), valid ? src + c * 8 : src,
                   valid);
      }
    }
  };

  // One cp.async group per tile, empty past the last, so that before tile j's math exactly two
  // later groups may still be in flight.
  load_q(p, w, q_s, tid);
  const int n_tiles = w.n_tiles();
  load_tile(0, block_of(row));  // with Q
  dev::cp_async_commit();
  if (n_tiles > 1) load_tile(1, block_of(tile_keys + row));
  dev::cp_async_commit();
  int32_t block_next = block_of(2 * tile_keys + row);

  const float scale_log2 = p.scale * log2e;
  wg_rows_state st;
  st.init(w, wg, warp, lane);
  const uint32_t q_wg = q_s + static_cast<uint32_t>(wg * wg_rows * 128);
  for (int j = 0; j < n_tiles; ++j) {
    if (j + 2 < n_tiles) {
      load_tile(j + 2, block_next);
      block_next = block_of((j + 3) * tile_keys + row);
    }
    dev::cp_async_commit();
    dev::cp_async_wait<2>();
    fence_proxy_async();
    __syncthreads();  // tile j (and Q) visible to every warpgroup's wgmma
    const int key0 = j * tile_keys;
    const uint32_t k_t = kv_s + static_cast<uint32_t>(j % stages) * stage_bytes;
    if (st.needs(key0)) tile_step(st, q_wg, k_t, k_t + kv_bytes, key0, lane & 3, scale_log2);
    __syncthreads();  // both warpgroups are done with this stage before iteration j + 1 refills it
  }
  store_rows(p, w, st, warp, lane);
#else
  __trap();  // built for sm_90a only (kernels/cuda.cmake)
#endif
}

/// Variants 5 and 6 (PingPong): warps 0-7 consume, warp 8 produces with TMA. kv_map views the
/// pool as rows of 128 bf16 (row = block * block_elems / 128 + ((layer * 2 + K/V) * kv_heads +
/// kv_head) * block_tokens + slot), boxes of 64 columns by block_tokens rows, swizzle 128B.
template <bool PingPong>
__global__ void __launch_bounds__(consumer_threads + producer_threads, 1)
    prefill_kernel_wgmma_tma(prefill_attention_params p, const __grid_constant__ CUtensorMap kv_map) {
  dev::pdl_wait();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t q_s = (dev::smem_addr(smem_raw) + 1023) & ~1023u;
  const uint32_t kv_s = q_s + q_bytes;
  const uint32_t full = kv_s + stages * stage_bytes;  // mbarrier of stage s at full + 8 s
  const uint32_t empty = full + stages * 8;
  cta_work w;
  if (!w.init(p)) return;
  const int tid = threadIdx.x, lane = tid & 31;
  const int n_tiles = w.n_tiles();
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full + 8 * s, 1);                       // the producer's expect_tx arrival
      mbar_init(empty + 8 * s, consumer_threads / 32);  // one arrival per consumer warp
    }
    mbar_init_fence();
  }
  if (tid < consumer_threads) load_q(p, w, q_s, tid);
  dev::cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();  // Q and the barriers ready

  if (tid >= consumer_threads) {  // the producer warp
    const int bt = static_cast<int>(p.kv.block_tokens);
    const int tile_blocks = tile_keys / bt;  // <= 16 (block_tokens >= 8)
    const int last_block = (w.kv_len - 1) / bt;
    const int rows_per_block = static_cast<int>(p.kv.block_elems / head_dim);
    auto block_at = [&](int j) {  // this lane's block of tile j; past the sequence, its first
      const int b = j * tile_blocks + lane;
      return lane < tile_blocks ? w.table[b <= last_block ? b : 0] : 0;
    };
    int32_t block = block_at(0);
    for (int j = 0; j < n_tiles; ++j) {
      const int s = j % stages;
      if (j >= stages) mbar_wait(empty + 8 * s, static_cast<uint32_t>((j / stages - 1) & 1));
      if (lane == 0) mbar_arrive_expect_tx(full + 8 * s, stage_bytes);
      __syncwarp();
      const int32_t next = j + 1 < n_tiles ? block_at(j + 1) : 0;
      if (lane < tile_blocks) {
        const uint32_t dst = kv_s + static_cast<uint32_t>(s * stage_bytes + lane * bt * 128);
#pragma unroll
        for (int sel = 0; sel < 2; ++sel) {
          const int r0 = block * rows_per_block +
                         ((static_cast<int>(p.layer) * 2 + sel) * static_cast<int>(p.kv.kv_heads) +
                          static_cast<int>(w.kv_head)) *
                             bt;
          tma_load_2d(dst + sel * kv_bytes, &kv_map, 0, r0, full + 8 * s);
          tma_load_2d(dst + sel * kv_bytes + half_bytes, &kv_map, 64, r0, full + 8 * s);
        }
      }
      block = next;
    }
    return;
  }

  const int wg = tid >> 7, warp = (tid >> 5) & 3;
  const float scale_log2 = p.scale * log2e;
  wg_rows_state st;
  st.init(w, wg, warp, lane);
  const uint32_t q_wg = q_s + static_cast<uint32_t>(wg * wg_rows * 128);
  // Ping-pong: warpgroup 0 takes the first turn. Every tile is a turn for both (a warpgroup
  // past its rows only passes it on), and warpgroup 1 passes none after the last tile, so both
  // barriers end complete.
  if (PingPong && wg == 1) turn_pass(wg);
  for (int j = 0; j < n_tiles; ++j) {
    const int s = j % stages;
    mbar_wait(full + 8 * s, static_cast<uint32_t>((j / stages) & 1));
    const int key0 = j * tile_keys;
    const uint32_t k_t = kv_s + static_cast<uint32_t>(s * stage_bytes);
    const bool pass = PingPong && (wg == 0 || j + 1 < n_tiles);
    if (PingPong) turn_wait(wg);
    if (st.needs(key0)) {
      tile_step(st, q_wg, k_t, k_t + kv_bytes, key0, lane & 3, scale_log2, pass, wg);
    } else if (pass) {
      turn_pass(wg);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * s);  // this warp is done reading stage s
  }
  store_rows(p, w, st, warp, lane);
#else
  __trap();  // built for sm_90a only (kernels/cuda.cmake)
#endif
}

/// cuTensorMapEncodeTiled from the driver, found once (the runtime does not link libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

bool prefill_attention_wgmma_available() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return false;
  return major == 9 && minor == 0;
}

kstatus prefill_attention_wgmma(const prefill_attention_params& p, cudaStream_t stream) {
  DUET_KREQUIRE(prefill_attention_wgmma_available(),
                "prefill_attention: variants 4 to 6 (wgmma) need a compute capability 9.0 GPU");
  const uint32_t vrows = p.max_seq_rows * (p.heads / p.kv_heads);
  const dim3 grid((vrows + cta_rows - 1) / cta_rows, p.kv_heads, p.seqs);
  if (p.variant == 4) {
    DUET_KCHECK(cudaFuncSetAttribute(prefill_kernel_wgmma,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, wgmma_smem));
    DUET_KCHECK(launch(prefill_kernel_wgmma, grid, dim3(consumer_threads), wgmma_smem, stream, p));
    return {};
  }
  const uint32_t bt = p.kv.block_tokens;
  DUET_KREQUIRE(bt >= 8 && bt <= 128 && (bt & (bt - 1)) == 0,
                "prefill_attention: variants 5 and 6 need block_tokens a power of two from 8 to 128");
  DUET_KREQUIRE(p.kv.blocks > 0, "prefill_attention: variants 5 and 6 need kv.blocks (the pool's size)");
  const uint64_t pool_rows = uint64_t{p.kv.blocks} * (p.kv.block_elems / head_dim);
  DUET_KREQUIRE(pool_rows < (1ull << 31), "prefill_attention: pool over 2^31 rows of 128");
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  DUET_KREQUIRE(encode != nullptr, "prefill_attention: the driver has no cuTensorMapEncodeTiled");
  CUtensorMap map{};
  const cuuint64_t dims[2] = {head_dim, pool_rows};
  const cuuint64_t strides[1] = {head_dim * 2};  // bytes from one row to the next
  const cuuint32_t box[2] = {64, bt};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult made = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, p.kv.pool, dims, strides,
                               box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DUET_KREQUIRE(made == CUDA_SUCCESS, "prefill_attention: cuTensorMapEncodeTiled refused the pool");
  auto* kernel = p.variant == 6 ? prefill_kernel_wgmma_tma<true> : prefill_kernel_wgmma_tma<false>;
  DUET_KCHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, wgmma_smem));
  DUET_KCHECK(launch(kernel, grid, dim3(consumer_threads + producer_threads), wgmma_smem, stream,
                     p, map));
  return {};
}

}  // namespace duet::kernels
