#include "runtime/cpu_engine.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numbers>
#include <string_view>
#include <stdexcept>

#include "runtime/gguf_model.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#define DUET_CPU_X86 1
#endif

// Numerics (docs/cpu-engine.md): every output element of a matrix product, every attention
// score and every weighted sum is computed by one fixed sequence of operations, whichever
// kernel variant (row/column tile) computes it and however rows are batched or split over
// threads. So chunked prefill, one-shot prefill and decode give bit-identical results.
// This file is compiled with -ffp-contract=off: only the explicit FMAs below are fused.

namespace duet {

namespace {

// ------------------------------------------------------------------------------------- kernels

// out[r * C + c] = dot(xr[r], wr[c]) over k elements, for an R x C tile.
using tile_fn = void (*)(const float* const* xr, const float* const* wr, std::size_t k, float* out);
// out[j] = dot(q, rows[j]) * scale for n contiguous rows of k floats (the dot as tile 1x1).
using scores_fn = void (*)(const float* q, const float* rows, std::size_t n, std::size_t k, float scale, float* out);
// out[d] += weights[j] * rows[j][d] for j = 0..n-1 in order (each step as one axpy).
using weighted_sum_fn = void (*)(float* out, const float* weights, const float* rows, std::size_t n, std::size_t k);

// ggml's 8-bit activation block (block_q8_0 without `s`, block_q8_1 with it): 32 values
// qs * d, s = d * sum(qs); d and s are fp16 values, held here as the floats they convert to
// (exactly), so the dot products do not convert them once per weight row.
struct q8_block {
  float d;
  float s;
  int8_t qs[32];
};
// Maximum activation rows per weight-row pass of the native block matmul (q_tile_fn).
constexpr int max_q_tile_rows = 8;
// out[r] = dot(one weight row of nb blocks of its ggml type, activation row x[r]) for r < R,
// the table's entry R - 1: the weight row's blocks are unpacked once for all R rows, and each
// out[r] is computed by exactly the operations of the one-row dot product (R = 1).
using q_tile_fn = void (*)(const std::byte* w, const q8_block* const* x, std::size_t nb, float* out);

struct kernel_table {
  tile_fn t24, t14, t21, t11;
  scores_fn scores;
  weighted_sum_fn weighted_sum;
  q_tile_fn q4_0[max_q_tile_rows], q4_1[max_q_tile_rows], q8_0[max_q_tile_rows];
  const char* name;
};

// ------------------------------------------------------------------- ggml blocks (native path)
//
// Transcriptions of ggml-cpu's AVX2 code at the llama.cpp commit docs/gguf.md names
// (quants.c: quantize_row_q8_0/q8_1, ggml_vec_dot_q4_0_q8_0, _q4_1_q8_1, _q8_0_q8_0): per
// block, the integer products of 4 consecutive elements are summed into lane l = j / 4 of 8
// float lanes (exact integers), each lane accumulates fma(d_w * d_x, lane sum, acc), the lanes
// are reduced by the tree of hsum_float_8, and Q4_1 adds sum over blocks of m * s after it.
// The generic kernels compute the same operations in the same order, so both give the same bits.

float fp16_to_float(uint16_t h) {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = ggml_fp16_to_fp32(static_cast<uint16_t>(i));
    return t;
  }();
  return table[h];
}

// float -> IEEE half, round to nearest even (as F16C's vcvtps2ph with rounding mode 0).
uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65536: inf
  if (ax < 0x38800000u) {  // below 2^-14: a half subnormal; scaling by 2^24 is exact
    float a;
    std::memcpy(&a, &ax, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

float round_to_fp16(float f) { return fp16_to_float(float_to_fp16(f)); }

uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// quantize_row_q8_0 / quantize_row_q8_1 (AVX2 version: round half to even), `nb` blocks.
void quantize_q8(const float* x, std::size_t nb, bool with_sum, q8_block* out) {
  for (std::size_t b = 0; b < nb; ++b) {
    const float* v = x + b * 32;
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(v[j]));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const auto q = static_cast<int32_t>(std::nearbyint(v[j] * id));
      out[b].qs[j] = static_cast<int8_t>(q);
      sum += q;
    }
    out[b].d = round_to_fp16(d);
    out[b].s = with_sum ? round_to_fp16(d * static_cast<float>(sum)) : 0.0f;
  }
}

inline float hsum8(const float* acc) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// Block layouts (docs/gguf.md): Q4_0 {d; qs[16]} 18 bytes, Q4_1 {d; m; qs[16]} 20, Q8_0 {d; qs[32]} 34.
// Element j < 16 of a 4-bit block is qs[j] & 15, element j + 16 is qs[j] >> 4.
inline int nibble(const std::byte* qs, int j) {
  const auto b = static_cast<uint8_t>(qs[j & 15]);
  return j < 16 ? (b & 15) : (b >> 4);
}

float dot_q4_0_generic(const std::byte* w, const q8_block* x, std::size_t nb) {
  float acc[8] = {};
  for (std::size_t b = 0; b < nb; ++b, w += 18) {
    const float d = fp16_to_float(load_u16(w)) * x[b].d;
    for (int l = 0; l < 8; ++l) {
      int32_t sum = 0;
      for (int j = 4 * l; j < 4 * l + 4; ++j) sum += (nibble(w + 2, j) - 8) * x[b].qs[j];
      acc[l] = std::fma(d, static_cast<float>(sum), acc[l]);
    }
  }
  return hsum8(acc);
}

float dot_q4_1_generic(const std::byte* w, const q8_block* x, std::size_t nb) {
  float acc[8] = {};
  float summs = 0.0f;
  for (std::size_t b = 0; b < nb; ++b, w += 20) {
    summs += fp16_to_float(load_u16(w + 2)) * x[b].s;  // exact product (11 x 11 bits)
    const float d = fp16_to_float(load_u16(w)) * x[b].d;
    for (int l = 0; l < 8; ++l) {
      int32_t sum = 0;
      for (int j = 4 * l; j < 4 * l + 4; ++j) sum += nibble(w + 4, j) * x[b].qs[j];
      acc[l] = std::fma(d, static_cast<float>(sum), acc[l]);
    }
  }
  return hsum8(acc) + summs;
}

float dot_q8_0_generic(const std::byte* w, const q8_block* x, std::size_t nb) {
  float acc[8] = {};
  for (std::size_t b = 0; b < nb; ++b, w += 34) {
    const float d = fp16_to_float(load_u16(w)) * x[b].d;
    const auto* qw = reinterpret_cast<const int8_t*>(w + 2);
    for (int l = 0; l < 8; ++l) {
      int32_t sum = 0;
      for (int j = 4 * l; j < 4 * l + 4; ++j) sum += qw[j] * x[b].qs[j];
      acc[l] = std::fma(d, static_cast<float>(sum), acc[l]);
    }
  }
  return hsum8(acc);
}

// The portable tiles: one dot product per activation row (the same operations as the AVX2 tiles).
template <float (*Dot)(const std::byte*, const q8_block*, std::size_t), int R>
void tile_q_generic(const std::byte* w, const q8_block* const* x, std::size_t nb, float* out) {
  for (int r = 0; r < R; ++r) out[r] = Dot(w, x[r], nb);
}

#ifdef DUET_CPU_X86
#define DUET_AVX2 __attribute__((target("avx2,fma,f16c")))
DUET_AVX2 inline float hsum8_avx2(__m256 x) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
DUET_AVX2 inline __m256i nibbles_avx2(const std::byte* qs) {
  const __m128i tmp = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set1_epi8(15), _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp));
}
// Sums of 4 consecutive products of unsigned a and signed b bytes, as 8 float lanes.
DUET_AVX2 inline __m256 sum4_us8_avx2(__m256i a, __m256i b) {
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}
DUET_AVX2 inline __m256 sum4_i8_avx2(__m256i a, __m256i b) {
  return sum4_us8_avx2(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}
DUET_AVX2 inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// The tiles: the weight row's block is loaded and unpacked once per block (and, for the signed
// types, its absolute values taken once: sum4_i8_avx2(qw, qx) = sum4_us8_avx2(|qw|, sign(qx, qw))),
// then every activation row does the rest of ggml's per-block operations on its own accumulator.
template <int R>
DUET_AVX2 void tile_q4_0_avx2(const std::byte* w, const q8_block* const* x, std::size_t nb, float* out) {
  __m256 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (std::size_t b = 0; b < nb; ++b, w += 18) {
    const float dw = h2f(load_u16(w));
    const __m256i qw = _mm256_sub_epi8(nibbles_avx2(w + 2), _mm256_set1_epi8(8));
    const __m256i aw = _mm256_sign_epi8(qw, qw);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const q8_block& xb = x[r][b];
      const __m256 d = _mm256_set1_ps(dw * xb.d);
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      acc[r] = _mm256_fmadd_ps(d, sum4_us8_avx2(aw, _mm256_sign_epi8(qx, qw)), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = hsum8_avx2(acc[r]);
}

template <int R>
DUET_AVX2 void tile_q4_1_avx2(const std::byte* w, const q8_block* const* x, std::size_t nb, float* out) {
  __m256 acc[R];
  float summs[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    summs[r] = 0.0f;
  }
  for (std::size_t b = 0; b < nb; ++b, w += 20) {
    const float dw = h2f(load_u16(w));
    const float mw = h2f(load_u16(w + 2));
    const __m256i qw = nibbles_avx2(w + 4);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const q8_block& xb = x[r][b];
      summs[r] += mw * xb.s;
      const __m256 d = _mm256_set1_ps(dw * xb.d);
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      acc[r] = _mm256_fmadd_ps(d, sum4_us8_avx2(qw, qx), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = hsum8_avx2(acc[r]) + summs[r];
}

template <int R>
DUET_AVX2 void tile_q8_0_avx2(const std::byte* w, const q8_block* const* x, std::size_t nb, float* out) {
  __m256 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (std::size_t b = 0; b < nb; ++b, w += 34) {
    const float dw = h2f(load_u16(w));
    const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    const __m256i aw = _mm256_sign_epi8(qw, qw);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const q8_block& xb = x[r][b];
      const __m256 d = _mm256_set1_ps(dw * xb.d);
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      acc[r] = _mm256_fmadd_ps(d, sum4_us8_avx2(aw, _mm256_sign_epi8(qx, qw)), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = hsum8_avx2(acc[r]);
}
#endif

// Generic kernels: 8 independent partial sums per output (lane l takes k = l mod 8), combined
// in a fixed tree, then the tail in order.
inline float finish_generic(const float* acc, const float* x, const float* w, std::size_t k8, std::size_t k) {
  float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
  for (std::size_t i = k8; i < k; ++i) s += x[i] * w[i];
  return s;
}

template <int R, int C>
void tile_generic(const float* const* xr, const float* const* wr, std::size_t k, float* out) {
  float acc[R][C][8] = {};
  const std::size_t k8 = k & ~std::size_t{7};
  for (std::size_t i = 0; i < k8; i += 8) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        for (int l = 0; l < 8; ++l) acc[r][c][l] += xr[r][i + l] * wr[c][i + l];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) out[r * C + c] = finish_generic(acc[r][c], xr[r], wr[c], k8, k);
  }
}

void scores_generic(const float* q, const float* rows, std::size_t n, std::size_t k, float scale, float* out) {
  for (std::size_t j = 0; j < n; ++j) {
    const float* row = rows + j * k;
    float dot;
    tile_generic<1, 1>(&q, &row, k, &dot);
    out[j] = dot * scale;
  }
}

void weighted_sum_generic(float* out, const float* weights, const float* rows, std::size_t n, std::size_t k) {
  for (std::size_t j = 0; j < n; ++j) {
    const float a = weights[j];
    const float* row = rows + j * k;
    for (std::size_t i = 0; i < k; ++i) out[i] += a * row[i];
  }
}

#ifdef DUET_CPU_X86
// AVX2 + FMA kernels: 8 lanes per __m256 accumulator, lane l takes k = l mod 8 (fused), then
// the same reduction tree as the generic kernels, then the tail with scalar FMAs.
__attribute__((target("avx2,fma"))) inline float finish_avx2(__m256 acc, const float* x, const float* w,
                                                            std::size_t k8, std::size_t k) {
  const __m128 lo = _mm256_castps256_ps128(acc);
  const __m128 hi = _mm256_extractf128_ps(acc, 1);
  __m128 s = _mm_add_ps(lo, hi);                   // (a0+a4, a1+a5, a2+a6, a3+a7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));          // ((a0+a4)+(a2+a6), (a1+a5)+(a3+a7), ..)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));   // lane0 + lane1
  float total = _mm_cvtss_f32(s);
  for (std::size_t i = k8; i < k; ++i) total = std::fma(x[i], w[i], total);
  return total;
}

template <int R, int C>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* const* xr, const float* const* wr, std::size_t k,
                                                   float* out) {
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  const std::size_t k8 = k & ~std::size_t{7};
  for (std::size_t i = 0; i < k8; i += 8) {
    __m256 wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(wr[c] + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(xr[r] + i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) out[r * C + c] = finish_avx2(acc[r][c], xr[r], wr[c], k8, k);
  }
}

__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, const float* rows, std::size_t n, std::size_t k,
                                                     float scale, float* out) {
  std::size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* r[4] = {rows + j * k, rows + (j + 1) * k, rows + (j + 2) * k, rows + (j + 3) * k};
    float dots[4];
    tile_avx2<1, 4>(&q, r, k, dots);
    for (int c = 0; c < 4; ++c) out[j + c] = dots[c] * scale;
  }
  for (; j < n; ++j) {
    const float* row = rows + j * k;
    float dot;
    tile_avx2<1, 1>(&q, &row, k, &dot);
    out[j] = dot * scale;
  }
}

__attribute__((target("avx2,fma"))) void weighted_sum_avx2(float* out, const float* weights, const float* rows,
                                                           std::size_t n, std::size_t k) {
  // Up to 64 outputs stay in registers while the rows stream by.
  const std::size_t k8 = k & ~std::size_t{7};
  for (std::size_t d0 = 0; d0 < k8; d0 += 64) {
    const std::size_t vectors = std::min<std::size_t>(8, (k8 - d0) / 8);
    __m256 acc[8];
#pragma GCC unroll 8
    for (std::size_t v = 0; v < 8; ++v) acc[v] = v < vectors ? _mm256_loadu_ps(out + d0 + 8 * v) : _mm256_setzero_ps();
    for (std::size_t j = 0; j < n; ++j) {
      const __m256 a = _mm256_set1_ps(weights[j]);
      const float* row = rows + j * k + d0;
#pragma GCC unroll 8
      for (std::size_t v = 0; v < 8; ++v) {
        if (v < vectors) acc[v] = _mm256_fmadd_ps(a, _mm256_loadu_ps(row + 8 * v), acc[v]);
      }
    }
#pragma GCC unroll 8
    for (std::size_t v = 0; v < 8; ++v) {
      if (v < vectors) _mm256_storeu_ps(out + d0 + 8 * v, acc[v]);
    }
  }
  for (std::size_t i = k8; i < k; ++i) {
    for (std::size_t j = 0; j < n; ++j) out[i] = std::fma(weights[j], rows[j * k + i], out[i]);
  }
}
#endif

const kernel_table& kernels() {
  static const kernel_table table = [] {
    // DUET_CPU_KERNELS=generic forces the portable kernels (tests run both paths).
    const char* forced = std::getenv("DUET_CPU_KERNELS");
    const bool generic_only = forced && std::string_view(forced) == "generic";
#ifdef DUET_CPU_X86
    __builtin_cpu_init();
    if (!generic_only && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      return kernel_table{tile_avx2<2, 4>,
                          tile_avx2<1, 4>,
                          tile_avx2<2, 1>,
                          tile_avx2<1, 1>,
                          scores_avx2,
                          weighted_sum_avx2,
                          {tile_q4_0_avx2<1>, tile_q4_0_avx2<2>, tile_q4_0_avx2<3>, tile_q4_0_avx2<4>,
                           tile_q4_0_avx2<5>, tile_q4_0_avx2<6>, tile_q4_0_avx2<7>, tile_q4_0_avx2<8>},
                          {tile_q4_1_avx2<1>, tile_q4_1_avx2<2>, tile_q4_1_avx2<3>, tile_q4_1_avx2<4>,
                           tile_q4_1_avx2<5>, tile_q4_1_avx2<6>, tile_q4_1_avx2<7>, tile_q4_1_avx2<8>},
                          {tile_q8_0_avx2<1>, tile_q8_0_avx2<2>, tile_q8_0_avx2<3>, tile_q8_0_avx2<4>,
                           tile_q8_0_avx2<5>, tile_q8_0_avx2<6>, tile_q8_0_avx2<7>, tile_q8_0_avx2<8>},
                          "avx2+fma"};
    }
#endif
    (void)generic_only;
    constexpr auto q4_0 = dot_q4_0_generic;
    constexpr auto q4_1 = dot_q4_1_generic;
    constexpr auto q8_0 = dot_q8_0_generic;
    return kernel_table{tile_generic<2, 4>,
                        tile_generic<1, 4>,
                        tile_generic<2, 1>,
                        tile_generic<1, 1>,
                        scores_generic,
                        weighted_sum_generic,
                        {tile_q_generic<q4_0, 1>, tile_q_generic<q4_0, 2>, tile_q_generic<q4_0, 3>,
                         tile_q_generic<q4_0, 4>, tile_q_generic<q4_0, 5>, tile_q_generic<q4_0, 6>,
                         tile_q_generic<q4_0, 7>, tile_q_generic<q4_0, 8>},
                        {tile_q_generic<q4_1, 1>, tile_q_generic<q4_1, 2>, tile_q_generic<q4_1, 3>,
                         tile_q_generic<q4_1, 4>, tile_q_generic<q4_1, 5>, tile_q_generic<q4_1, 6>,
                         tile_q_generic<q4_1, 7>, tile_q_generic<q4_1, 8>},
                        {tile_q_generic<q8_0, 1>, tile_q_generic<q8_0, 2>, tile_q_generic<q8_0, 3>,
                         tile_q_generic<q8_0, 4>, tile_q_generic<q8_0, 5>, tile_q_generic<q8_0, 6>,
                         tile_q_generic<q8_0, 7>, tile_q_generic<q8_0, 8>},
                        "generic"};
  }();
  return table;
}

// y[m][n] = dot(x[m], w[n]) + bias[n] for n in [n0, n1): x is [m, k] (row stride ldx), w is
// [N, k] row-major, y has row stride ldy.
struct matmul_args {
  const float* x;
  std::size_t ldx;
  const float* w;
  const float* bias;  // nullptr: none
  float* y;
  std::size_t ldy;
  std::size_t m;
  std::size_t k;
};

void matmul_block(const matmul_args& a, std::size_t n0, std::size_t n1) {
  const kernel_table& kt = kernels();
  constexpr std::size_t row_block = 32;  // rows of x kept hot while a block of w streams
  auto store = [&](std::size_t m, std::size_t n, float value) {
    a.y[m * a.ldy + n] = a.bias ? value + a.bias[n] : value;
  };
  for (std::size_t m0 = 0; m0 < a.m; m0 += row_block) {
    const std::size_t m1 = std::min(a.m, m0 + row_block);
    std::size_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      const float* wr[4] = {a.w + n * a.k, a.w + (n + 1) * a.k, a.w + (n + 2) * a.k, a.w + (n + 3) * a.k};
      std::size_t m = m0;
      for (; m + 2 <= m1; m += 2) {
        const float* xr[2] = {a.x + m * a.ldx, a.x + (m + 1) * a.ldx};
        float out[8];
        kt.t24(xr, wr, a.k, out);
        for (int r = 0; r < 2; ++r) {
          for (int c = 0; c < 4; ++c) store(m + r, n + c, out[r * 4 + c]);
        }
      }
      if (m < m1) {
        const float* xr[1] = {a.x + m * a.ldx};
        float out[4];
        kt.t14(xr, wr, a.k, out);
        for (int c = 0; c < 4; ++c) store(m, n + c, out[c]);
      }
    }
    for (; n < n1; ++n) {
      const float* wr[1] = {a.w + n * a.k};
      std::size_t m = m0;
      for (; m + 2 <= m1; m += 2) {
        const float* xr[2] = {a.x + m * a.ldx, a.x + (m + 1) * a.ldx};
        float out[2];
        kt.t21(xr, wr, a.k, out);
        store(m, n, out[0]);
        store(m + 1, n, out[1]);
      }
      if (m < m1) {
        const float* xr[1] = {a.x + m * a.ldx};
        float out;
        kt.t11(xr, wr, a.k, &out);
        store(m, n, out);
      }
    }
  }
}

// y = x w^T (+ bias), over the pool: tasks are blocks of 16 rows of w.
void matmul(worker_pool& pool, const float* x, std::size_t m, std::size_t k, const float* w, std::size_t n,
            const float* bias, float* y) {
  constexpr std::size_t col_block = 16;
  const matmul_args a{x, k, w, bias, y, n, m, k};
  const std::size_t tasks = (n + col_block - 1) / col_block;
  pool.run(tasks, [&](std::size_t t, unsigned) {
    matmul_block(a, t * col_block, std::min(n, (t + 1) * col_block));
  });
}

// Runs fn(row) for rows [0, rows), in parallel when the work is large enough to pay for it.
template <class F>
void for_rows(worker_pool& pool, std::size_t rows, std::size_t cost_per_row, F&& fn) {
  if (rows * cost_per_row < (1u << 16) || rows < 2) {
    for (std::size_t r = 0; r < rows; ++r) fn(r);
    return;
  }
  const std::size_t per_task = std::max<std::size_t>(1, (1u << 15) / std::max<std::size_t>(cost_per_row, 1));
  const std::size_t tasks = (rows + per_task - 1) / per_task;
  pool.run(tasks, [&](std::size_t t, unsigned) {
    for (std::size_t r = t * per_task; r < std::min(rows, (t + 1) * per_task); ++r) fn(r);
  });
}

// Native path: y = x w^T (+ bias) with w in a ggml block format. x's rows are first rounded to
// ggml's activation blocks (Q8_1 for Q4_1 weights, Q8_0 otherwise) in `quantized`, then every
// output is one dot product of a weight row and an activation row. Tasks are blocks of 16
// weight rows; each unpacks a weight row's blocks once for up to max_q_tile_rows activation rows
// (the tile kernels), as ggml's mul_mat blocks src1 rows, and streams its weight rows once for
// up to 32 activation rows. Each output is computed as by the one-row dot product, so the rows'
// grouping changes no bit.
void block_matmul(worker_pool& pool, const float* x, std::size_t m, std::size_t k, const ggml_matrix& w,
                  const float* bias, float* y, std::vector<std::byte>& quantized) {
  const kernel_table& kt = kernels();
  const std::size_t nb = k / 32;
  const std::size_t n = w.rows;
  quantized.resize(m * nb * sizeof(q8_block));
  auto* xq = reinterpret_cast<q8_block*>(quantized.data());
  const bool with_sum = w.type == ggml_type::q4_1;
  for_rows(pool, m, k, [&](std::size_t r) { quantize_q8(x + r * k, nb, with_sum, xq + r * nb); });
  const q_tile_fn* tiles = w.type == ggml_type::q4_0 ? kt.q4_0 : w.type == ggml_type::q4_1 ? kt.q4_1 : kt.q8_0;
  const std::size_t row_bytes = w.row_bytes();
  constexpr std::size_t col_block = 16;
  constexpr std::size_t row_block = 32;
  pool.run((n + col_block - 1) / col_block, [&](std::size_t t, unsigned) {
    const std::size_t n0 = t * col_block;
    const std::size_t n1 = std::min(n, n0 + col_block);
    for (std::size_t m0 = 0; m0 < m; m0 += row_block) {
      const std::size_t m1 = std::min(m, m0 + row_block);
      for (std::size_t c = n0; c < n1; ++c) {
        const std::byte* wr = w.data.data() + c * row_bytes;
        for (std::size_t r0 = m0; r0 < m1; r0 += max_q_tile_rows) {
          const auto rows = static_cast<int>(std::min<std::size_t>(max_q_tile_rows, m1 - r0));
          const q8_block* xr[max_q_tile_rows];
          for (int i = 0; i < rows; ++i) xr[i] = xq + (r0 + i) * nb;
          float out[max_q_tile_rows];
          tiles[rows - 1](wr, xr, nb, out);
          for (int i = 0; i < rows; ++i) y[(r0 + i) * n + c] = bias ? out[i] + bias[c] : out[i];
        }
      }
    }
  });
}

// Hugging Face LlamaRMSNorm in float32: x * rsqrt(mean(x^2) + eps), then * weight.
void rms_norm(const float* x, const float* weight, std::size_t n, float eps, float* out) {
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float variance = static_cast<float>(sum / static_cast<double>(n));
  const float inv = 1.0f / std::sqrt(variance + eps);
  for (std::size_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inv);
}

uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

}  // namespace

// ------------------------------------------------------------------------------ kv_block_layout

kv_block_layout kv_block_layout::make(uint32_t layers, uint32_t kv_heads, uint32_t head_dim, uint32_t block_tokens) {
  kv_block_layout l;
  l.layers = layers;
  l.kv_heads = kv_heads;
  l.head_dim = head_dim;
  l.block_tokens = block_tokens;
  l.block_bytes = round_up(2ull * layers * kv_heads * head_dim * block_tokens * sizeof(float), 256);
  return l;
}

// ---------------------------------------------------------------------------------------- RoPE

std::vector<float> rope_inv_freq(const transformer_config& c) {
  // transformers' _compute_default_rope_parameters, in float32 as torch evaluates it:
  // 1.0 / (base ** (arange(0, dim, 2).float() / dim)).
  const uint32_t dim = c.head_dim;
  const float base = static_cast<float>(c.rope_theta);
  std::vector<float> inv(dim / 2);
  for (uint32_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    const auto power = static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
    inv[i] = 1.0f / power;
  }
  if (!c.rope_scaling) return inv;
  // _compute_llama3_parameters, op by op in float32 (tensor-with-Python-scalar arithmetic
  // rounds the scalar to float32; `scalar / tensor` is reciprocal(tensor) * scalar).
  const rope_scaling_config& s = *c.rope_scaling;
  const auto factor = static_cast<float>(s.factor);
  const auto old_context = static_cast<float>(s.original_max_position_embeddings);
  const auto low_freq_wavelen = static_cast<float>(s.original_max_position_embeddings / s.low_freq_factor);
  const auto high_freq_wavelen = static_cast<float>(s.original_max_position_embeddings / s.high_freq_factor);
  const auto two_pi = static_cast<float>(2 * std::numbers::pi);
  const float high_minus_low = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  for (float& f : inv) {
    const float wavelen = (1.0f / f) * two_pi;
    float scaled = wavelen > low_freq_wavelen ? f / factor : f;
    const float smooth = ((1.0f / wavelen) * old_context - static_cast<float>(s.low_freq_factor)) / high_minus_low;
    const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (medium) scaled = smoothed;
    f = scaled;
  }
  return inv;
}

rope_table::rope_table(const transformer_config& config, uint32_t positions)
    : inv_freq_(rope_inv_freq(config)), positions_(positions), half_(config.head_dim / 2) {
  cos_.resize(std::size_t{positions} * half_);
  sin_.resize(std::size_t{positions} * half_);
  for (uint32_t p = 0; p < positions; ++p) {
    for (uint32_t i = 0; i < half_; ++i) {
      const float angle = inv_freq_[i] * static_cast<float>(p);
      cos_[std::size_t{p} * half_ + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin_[std::size_t{p} * half_ + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
}

void rope_table::apply(float* x, uint32_t position) const {
  const float* c = cos(position);
  const float* s = sin(position);
  for (uint32_t i = 0; i < half_; ++i) {
    const float a = x[i];
    const float b = x[i + half_];
    x[i] = a * c[i] + (-b) * s[i];
    x[i + half_] = b * c[i] + a * s[i];
  }
}

// ----------------------------------------------------------------------------------- attention

void paged_attention(const paged_attention_params& p, uint32_t token, uint32_t head, float* scratch) {
  const kv_block_layout& l = p.layout;
  const uint32_t hd = l.head_dim;
  const uint32_t kv_head = head / (p.heads / l.kv_heads);
  const uint32_t length = p.start + token + 1;
  const float* q = p.q + (std::size_t{token} * p.heads + head) * hd;
  float* out = p.out + (std::size_t{token} * p.heads + head) * hd;
  const uint64_t block_floats = l.block_floats();

  const kernel_table& kt = kernels();
  for (uint32_t j0 = 0, b = 0; j0 < length; j0 += l.block_tokens, ++b) {
    const float* keys = p.pool + p.block_table[b] * block_floats + l.offset(p.layer, 0, kv_head, 0);
    kt.scores(q, keys, std::min(l.block_tokens, length - j0), hd, p.scale, scratch + j0);
  }
  float max_score = -INFINITY;
  for (uint32_t j = 0; j < length; ++j) max_score = std::max(max_score, scratch[j]);
  float sum = 0;
  for (uint32_t j = 0; j < length; ++j) {
    scratch[j] = std::exp(scratch[j] - max_score);
    sum += scratch[j];
  }
  for (uint32_t j = 0; j < length; ++j) scratch[j] /= sum;
  if (p.fp16_probs) {
    for (uint32_t j = 0; j < length; ++j) scratch[j] = round_to_fp16(scratch[j]);
  }
  std::fill(out, out + hd, 0.0f);
  for (uint32_t j0 = 0, b = 0; j0 < length; j0 += l.block_tokens, ++b) {
    const float* values = p.pool + p.block_table[b] * block_floats + l.offset(p.layer, 1, kv_head, 0);
    kt.weighted_sum(out, scratch + j0, values, std::min(l.block_tokens, length - j0), hd);
  }
}

// --------------------------------------------------------------------------------- worker_pool

worker_pool::worker_pool(unsigned threads) {
  threads = std::max(1u, threads);
  for (unsigned i = 1; i < threads; ++i) threads_.emplace_back([this, i] { work(i); });
}

namespace {

// Busy-wait iterations before blocking: ~100 µs of pause instructions.
constexpr int spin_iterations = 4000;

inline void cpu_relax() {
#ifdef DUET_CPU_X86
  _mm_pause();
#endif
}

}  // namespace

worker_pool::~worker_pool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void worker_pool::run(std::size_t tasks, const std::function<void(std::size_t, unsigned)>& fn) {
  if (tasks == 0) return;
  if (threads_.empty() || tasks == 1) {
    for (std::size_t t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    job_ = &fn;
    tasks_ = tasks;
    next_ = 0;
    error_ = nullptr;
    busy_.store(static_cast<unsigned>(threads_.size()));
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  drain(0);
  for (int i = 0; i < spin_iterations && busy_.load() != 0; ++i) cpu_relax();
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return busy_.load() == 0; });
  job_ = nullptr;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void worker_pool::work(unsigned worker) {
  uint64_t seen = 0;
  while (true) {
    for (int i = 0; i < spin_iterations && !stop_.load() && generation_.load() == seen; ++i) cpu_relax();
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
      if (stop_) return;
      seen = generation_.load();
    }
    drain(worker);
    if (busy_.fetch_sub(1) == 1) {
      std::lock_guard lock(mutex_);
      done_.notify_one();
    }
  }
}

void worker_pool::drain(unsigned worker) {
  while (true) {
    const std::size_t task = next_.fetch_add(1);
    if (task >= tasks_) return;
    try {
      (*job_)(task, worker);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_.store(tasks_);  // hand out no more tasks
    }
  }
}

// ---------------------------------------------------------------------------------- cpu_engine

struct cpu_engine::row_group {
  std::size_t first_row = 0;
  uint32_t rows = 0;
  uint32_t start = 0;  // position of the first row
  std::span<const uint32_t> blocks;
};

namespace {

unsigned thread_count(uint32_t requested) {
  if (requested > 0) return requested;
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

cpu_engine::cpu_engine(std::shared_ptr<const model_weights> weights, cpu_engine_params params)
    : cpu_engine(std::move(weights), nullptr, std::move(params)) {}

cpu_engine::cpu_engine(std::shared_ptr<const gguf_native_model> model, cpu_engine_params params)
    : cpu_engine(model ? std::shared_ptr<const model_weights>(model, &model->weights) : nullptr, model,
                 std::move(params)) {}

cpu_engine::cpu_engine(std::shared_ptr<const model_weights> weights, std::shared_ptr<const gguf_native_model> native,
                       cpu_engine_params params)
    : weights_(std::move(weights)),
      native_(std::move(native)),
      params_(std::move(params)),
      layout_(),
      rope_(weights_ ? weights_->config : transformer_config{},
            weights_ ? std::min(params_.max_context, weights_->config.max_position_embeddings) : 0),
      pool_(thread_count(params_.threads)) {
  if (!weights_) throw std::invalid_argument("cpu_engine: no weights");
  if (native_) {
    native_->validate();
  } else {
    weights_->validate();
  }
  if (params_.kv_blocks == 0) throw std::invalid_argument("cpu_engine: kv_blocks must be positive");
  if (params_.block_tokens == 0) throw std::invalid_argument("cpu_engine: block_tokens must be positive");
  if (params_.max_context == 0) throw std::invalid_argument("cpu_engine: max_context must be positive");
  const transformer_config& c = weights_->config;
  layout_ = kv_block_layout::make(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, params_.block_tokens);
  allocate_pool();

  info_.engine = "cpu";
  info_.model = params_.served_name;
  info_.vocab_size = c.vocab_size;
  info_.max_context = rope_.positions();
  info_.block_tokens = params_.block_tokens;
  info_.block_bytes = layout_.block_bytes;
  // The native path's KV (fp16 values held in fp32) is laid out like the fp32 path's but
  // computed differently, so the two do not exchange blocks.
  info_.layout_hash = layout_hash(params_.served_name, native_ ? "f32-ggml" : "f32", c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                  params_.block_tokens);
  info_.eos_ids = c.eos_token_ids;
  scratch_.resize(pool_.size());
  samplers_.resize(pool_.size());
}

cpu_engine::~cpu_engine() = default;

namespace {

struct kv_memory {
  std::shared_ptr<void> owner;
  std::byte* base = nullptr;
  std::string shm_name;
};

/// Zero-filled memory for a pool: POSIX shared memory where /dev/shm has room, so other
/// processes can map it, else private pages.
kv_memory allocate_kv_memory(uint64_t bytes, uint32_t blocks) {
  kv_memory m;
  try {
    if (shm_region::fits(bytes)) {
      auto region = std::make_shared<shm_region>(bytes);
      m.base = region->data();
      m.shm_name = region->name();
      m.owner = std::move(region);
      return m;
    }
    static std::once_flag warned;
    std::call_once(warned, [&] {
      std::fprintf(stderr,
                   "duet: cpu engine: /dev/shm has no room for a %.0f MiB KV pool; pools stay private, so "
                   "handovers between processes use the stream path (give the container more /dev/shm to share)\n",
                   bytes / 1048576.0);
    });
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error(std::strerror(errno));
    m.base = static_cast<std::byte*>(p);
    m.owner = std::shared_ptr<void>(p, [bytes](void* q) { ::munmap(q, bytes); });
    return m;
  } catch (const std::exception& e) {
    throw std::runtime_error("cpu_engine: cannot allocate a KV pool of " + std::to_string(bytes) + " bytes (" +
                             std::to_string(blocks) + " blocks): " + e.what());
  }
}

}  // namespace

void cpu_engine::allocate_pool() {
  const uint64_t block_bytes = layout_.block_bytes;
  if (!params_.seat) {
    kv_total_blocks_ = params_.kv_blocks;
    kv_bytes_ = block_bytes * kv_total_blocks_;
    auto m = allocate_kv_memory(kv_bytes_, kv_total_blocks_);
    kv_memory_ = std::move(m.owner);
    kv_shm_name_ = std::move(m.shm_name);
    kv_ = reinterpret_cast<float*>(m.base);
    return;
  }
  shared_kv_pool& shared = *params_.seat.pool;
  std::lock_guard lock(shared.mutex);
  if (!shared.arena) {
    // The first member allocates for all: each keeps the blocks its actor's kv_blocks asks for.
    std::vector<uint32_t> blocks;
    uint64_t total = 0;
    for (const actor_config* a : shared.members) {
      blocks.push_back(a->kv_blocks);
      total += a->kv_blocks;
    }
    auto m = allocate_kv_memory(total * block_bytes, static_cast<uint32_t>(total));
    shared.memory = std::move(m.owner);
    shared.base = m.base;
    shared.bytes = total * block_bytes;
    shared.shm_name = std::move(m.shm_name);
    shared.arena = std::make_shared<kv_arena>(blocks);
  }
  if (shared.bytes != uint64_t{shared.arena->total_blocks()} * block_bytes) {
    throw std::runtime_error("cpu_engine: the shared KV pool was laid out for another model or block size");
  }
  kv_memory_ = shared.memory;
  kv_shm_name_ = shared.shm_name;
  kv_ = reinterpret_cast<float*>(shared.base);
  kv_bytes_ = shared.bytes;
  kv_total_blocks_ = shared.arena->total_blocks();
}

const char* cpu_engine::kernel_name() { return kernels().name; }

float* cpu_engine::block_ptr(uint32_t block) const { return kv_ + std::size_t{block} * layout_.block_floats(); }

std::span<const float> cpu_engine::last_logits(std::size_t i) const {
  if (i >= samples_.size()) throw std::out_of_range("cpu_engine::last_logits: no output " + std::to_string(i));
  return {logits_.data() + i * info_.vocab_size, info_.vocab_size};
}

void cpu_engine::check_blocks(std::span<const uint32_t> blocks, uint64_t positions, const char* what) const {
  const uint64_t needed = (positions + params_.block_tokens - 1) / params_.block_tokens;
  if (blocks.size() < needed) {
    throw std::invalid_argument(std::string("cpu_engine: ") + what + ": " + std::to_string(positions) +
                                " positions need " + std::to_string(needed) + " blocks, the block table has " +
                                std::to_string(blocks.size()));
  }
  for (uint64_t i = 0; i < needed; ++i) {
    if (blocks[i] >= kv_total_blocks_) {
      throw std::invalid_argument(std::string("cpu_engine: ") + what + ": block " + std::to_string(blocks[i]) +
                                  " is outside the pool of " + std::to_string(kv_total_blocks_));
    }
  }
}

void cpu_engine::linear(const float* x, std::size_t m, std::size_t k, const std::vector<float>& w,
                        const ggml_matrix* blocks, std::size_t n, const std::vector<float>& bias, float* y) {
  const float* b = bias.empty() ? nullptr : bias.data();
  if (blocks != nullptr && blocks->type != ggml_type::f32) {
    block_matmul(pool_, x, m, k, *blocks, b, y, quantized_);
    return;
  }
  const float* wf = blocks != nullptr ? reinterpret_cast<const float*>(blocks->data.data()) : w.data();
  matmul(pool_, x, m, k, wf, n, b, y);
}

void cpu_engine::forward(std::span<const int32_t> tokens, std::span<const row_group> groups,
                         std::span<const uint32_t> output_rows) {
  const transformer_config& c = weights_->config;
  const model_weights& w = *weights_;
  const std::size_t rows = tokens.size();
  const std::size_t hidden = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), ffn = c.intermediate_size;
  const uint32_t hd = c.head_dim, heads = c.num_attention_heads, kv_heads = c.num_key_value_heads;
  const auto eps = static_cast<float>(c.rms_norm_eps);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));

  x_.resize(rows * hidden);
  h_.resize(rows * hidden);
  q_.resize(rows * qd);
  k_.resize(rows * kvd);
  v_.resize(rows * kvd);
  attn_.resize(rows * qd);
  gate_.resize(rows * ffn);
  up_.resize(rows * ffn);
  std::vector<uint32_t> position(rows);
  uint32_t longest = 0;
  for (const row_group& g : groups) {
    for (uint32_t r = 0; r < g.rows; ++r) position[g.first_row + r] = g.start + r;
    longest = std::max(longest, g.start + g.rows);
  }
  for (auto& s : scratch_) s.resize(std::max<std::size_t>(s.size(), longest));

  for (std::size_t r = 0; r < rows; ++r) {
    std::memcpy(&x_[r * hidden], &w.embedding[static_cast<std::size_t>(tokens[r]) * hidden], hidden * sizeof(float));
  }
  // (group, row within group, head) for every attention task.
  std::size_t attention_tasks = rows * heads;

  for (uint32_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const layer_weights& lw = w.layers[layer];
    for_rows(pool_, rows, hidden, [&](std::size_t r) {
      rms_norm(&x_[r * hidden], lw.input_norm.data(), hidden, eps, &h_[r * hidden]);
    });
    const ggml_layer_matrices* nm = native_ ? &native_->layers[layer] : nullptr;
    linear(h_.data(), rows, hidden, lw.q, nm ? &nm->q : nullptr, qd, lw.q_bias, q_.data());
    linear(h_.data(), rows, hidden, lw.k, nm ? &nm->k : nullptr, kvd, lw.k_bias, k_.data());
    linear(h_.data(), rows, hidden, lw.v, nm ? &nm->v : nullptr, kvd, lw.v_bias, v_.data());
    for_rows(pool_, rows, qd + kvd, [&](std::size_t r) {
      for (uint32_t h = 0; h < heads; ++h) rope_.apply(&q_[r * qd + std::size_t{h} * hd], position[r]);
      for (uint32_t h = 0; h < kv_heads; ++h) rope_.apply(&k_[r * kvd + std::size_t{h} * hd], position[r]);
      if (native_) {
        // llama.cpp's default f16 KV cache: K and V are stored as fp16, and q is converted to
        // fp16 for the K·q product (ggml's vec_dot_f16).
        for (std::size_t i = r * qd; i < (r + 1) * qd; ++i) q_[i] = round_to_fp16(q_[i]);
        for (std::size_t i = r * kvd; i < (r + 1) * kvd; ++i) {
          k_[i] = round_to_fp16(k_[i]);
          v_[i] = round_to_fp16(v_[i]);
        }
      }
    });
    // Store this step's K and V in the pool, then attend over the pages (earlier chunks included).
    for (const row_group& g : groups) {
      for (uint32_t r = 0; r < g.rows; ++r) {
        const uint32_t pos = g.start + r;
        float* block = block_ptr(g.blocks[pos / params_.block_tokens]);
        const uint32_t slot = pos % params_.block_tokens;
        for (uint32_t h = 0; h < kv_heads; ++h) {
          std::memcpy(block + layout_.offset(layer, 0, h, slot), &k_[(g.first_row + r) * kvd + std::size_t{h} * hd],
                      hd * sizeof(float));
          std::memcpy(block + layout_.offset(layer, 1, h, slot), &v_[(g.first_row + r) * kvd + std::size_t{h} * hd],
                      hd * sizeof(float));
        }
      }
    }
    std::vector<paged_attention_params> params(groups.size());
    std::vector<uint32_t> group_of_row(rows);
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      const row_group& g = groups[gi];
      params[gi] = paged_attention_params{&q_[g.first_row * qd], &attn_[g.first_row * qd], kv_, layout_,
                                          g.blocks.data(), layer, heads, g.start, scale, native_ != nullptr};
      for (uint32_t r = 0; r < g.rows; ++r) group_of_row[g.first_row + r] = static_cast<uint32_t>(gi);
    }
    pool_.run(attention_tasks, [&](std::size_t t, unsigned worker) {
      const std::size_t row = t / heads;
      const auto head = static_cast<uint32_t>(t % heads);
      const uint32_t gi = group_of_row[row];
      paged_attention(params[gi], static_cast<uint32_t>(row - groups[gi].first_row), head, scratch_[worker].data());
    });
    // Output projection and residual.
    linear(attn_.data(), rows, qd, lw.o, nm ? &nm->o : nullptr, hidden, lw.o_bias, h_.data());
    for (std::size_t i = 0; i < rows * hidden; ++i) x_[i] += h_[i];
    // SwiGLU MLP and residual.
    for_rows(pool_, rows, hidden, [&](std::size_t r) {
      rms_norm(&x_[r * hidden], lw.post_attention_norm.data(), hidden, eps, &h_[r * hidden]);
    });
    const std::vector<float> none;
    linear(h_.data(), rows, hidden, lw.gate, nm ? &nm->gate : nullptr, ffn, none, gate_.data());
    linear(h_.data(), rows, hidden, lw.up, nm ? &nm->up : nullptr, ffn, none, up_.data());
    for_rows(pool_, rows, ffn, [&](std::size_t r) {
      float* g = &gate_[r * ffn];
      const float* u = &up_[r * ffn];
      for (std::size_t i = 0; i < ffn; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    });
    linear(gate_.data(), rows, ffn, lw.down, nm ? &nm->down : nullptr, hidden, none, h_.data());
    for (std::size_t i = 0; i < rows * hidden; ++i) x_[i] += h_[i];
  }

  // Final norm and LM head, only for the rows that sample.
  const std::size_t outputs = output_rows.size();
  std::vector<float> normed(outputs * hidden);
  for (std::size_t o = 0; o < outputs; ++o) {
    rms_norm(&x_[output_rows[o] * hidden], w.final_norm.data(), hidden, eps, &normed[o * hidden]);
  }
  logits_.resize(outputs * c.vocab_size);
  linear(normed.data(), outputs, hidden, w.output_weights(), native_ ? &native_->output : nullptr, c.vocab_size, {},
         logits_.data());
}

step_output cpu_engine::prefill(std::span<const prefill_chunk> chunks) {
  const uint32_t vocab = info_.vocab_size;
  std::size_t total = 0;
  for (const auto& ch : chunks) {
    if (ch.tokens.empty()) throw std::invalid_argument("cpu_engine: prefill chunk of sequence " + std::to_string(ch.seq_id) + " is empty");
    const uint64_t end = uint64_t{ch.start} + ch.tokens.size();
    if (end > info_.max_context) {
      throw std::invalid_argument("cpu_engine: sequence " + std::to_string(ch.seq_id) + " reaches position " +
                                  std::to_string(end) + ", over the context limit of " + std::to_string(info_.max_context));
    }
    for (int32_t t : ch.tokens) {
      if (t < 0 || static_cast<uint32_t>(t) >= vocab) {
        throw std::invalid_argument("cpu_engine: token " + std::to_string(t) + " of sequence " +
                                    std::to_string(ch.seq_id) + " is outside the vocabulary of " + std::to_string(vocab));
      }
    }
    check_blocks(ch.blocks, end, "prefill");
    total += ch.tokens.size();
  }

  std::vector<int32_t> tokens;
  tokens.reserve(total);
  std::vector<row_group> groups;
  std::vector<uint32_t> output_rows;
  std::vector<const prefill_chunk*> sampled;
  for (const auto& ch : chunks) {
    groups.push_back({tokens.size(), static_cast<uint32_t>(ch.tokens.size()), ch.start, ch.blocks});
    tokens.insert(tokens.end(), ch.tokens.begin(), ch.tokens.end());
    const msg::sampling_params* sp = ch.sampling;
    const bool penalties = sp && (sp->repetition_penalty != 1.0f || sp->frequency_penalty != 0.0f ||
                                  sp->presence_penalty != 0.0f);
    if (penalties) {
      auto& seen = prompt_tokens_[ch.seq_id];
      if (ch.start == 0) seen.clear();
      seen.insert(seen.end(), ch.tokens.begin(), ch.tokens.end());
    }
    if (ch.last) {
      output_rows.push_back(static_cast<uint32_t>(tokens.size() - 1));
      sampled.push_back(&ch);
    }
  }
  forward(tokens, groups, output_rows);

  samples_.assign(sampled.size(), {});
  pool_.run(sampled.size(), [&](std::size_t i, unsigned worker) {
    const prefill_chunk& ch = *sampled[i];
    std::span<const int32_t> context = ch.tokens;
    if (auto it = prompt_tokens_.find(ch.seq_id); it != prompt_tokens_.end()) context = it->second;
    samples_[i] = samplers_[worker].sample(last_logits(i), ch.sampling, context, sampler_seed(ch.sampling, ch.seq_id),
                                           uint64_t{ch.start} + ch.tokens.size());
  });
  step_output out;
  for (std::size_t i = 0; i < sampled.size(); ++i) {
    step_output_push(out, samples_[i], sampled[i]->sampling);
    prompt_tokens_.erase(sampled[i]->seq_id);
  }
  return out;
}

step_output cpu_engine::decode(std::span<const decode_slot> slots) {
  const uint32_t vocab = info_.vocab_size;
  std::vector<int32_t> tokens;
  std::vector<row_group> groups;
  std::vector<uint32_t> output_rows;
  for (const auto& s : slots) {
    if (s.history.empty()) throw std::invalid_argument("cpu_engine: decode slot of sequence " + std::to_string(s.seq_id) + " has no history");
    const uint64_t positions = s.history.size();
    if (positions > info_.max_context) {
      throw std::invalid_argument("cpu_engine: sequence " + std::to_string(s.seq_id) + " holds " + std::to_string(positions) +
                                  " tokens, over the context limit of " + std::to_string(info_.max_context));
    }
    const int32_t t = s.history.back();
    if (t < 0 || static_cast<uint32_t>(t) >= vocab) {
      throw std::invalid_argument("cpu_engine: token " + std::to_string(t) + " of sequence " + std::to_string(s.seq_id) +
                                  " is outside the vocabulary of " + std::to_string(vocab));
    }
    check_blocks(s.blocks, positions, "decode");
    output_rows.push_back(static_cast<uint32_t>(tokens.size()));
    groups.push_back({tokens.size(), 1, static_cast<uint32_t>(positions - 1), s.blocks});
    tokens.push_back(t);
  }
  forward(tokens, groups, output_rows);

  samples_.assign(slots.size(), {});
  pool_.run(slots.size(), [&](std::size_t i, unsigned worker) {
    const decode_slot& s = slots[i];
    samples_[i] = samplers_[worker].sample(last_logits(i), s.sampling, s.history, sampler_seed(s.sampling, s.seq_id),
                                           s.history.size());
  });
  step_output out;
  for (std::size_t i = 0; i < slots.size(); ++i) step_output_push(out, samples_[i], slots[i].sampling);
  return out;
}

void cpu_engine::release(uint64_t seq_id) { prompt_tokens_.erase(seq_id); }

bool cpu_engine::read_blocks(std::span<const uint32_t> blocks, std::span<std::byte> out) const {
  if (out.size() != blocks.size() * layout_.block_bytes) return false;
  for (uint32_t b : blocks) {
    if (b >= kv_total_blocks_) return false;
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    std::memcpy(out.data() + i * layout_.block_bytes, block_ptr(blocks[i]), layout_.block_bytes);
  }
  return true;
}

bool cpu_engine::write_blocks(std::span<const uint32_t> blocks, std::span<const std::byte> in) {
  if (in.size() != blocks.size() * layout_.block_bytes) return false;
  for (uint32_t b : blocks) {
    if (b >= kv_total_blocks_) return false;
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    std::memcpy(block_ptr(blocks[i]), in.data() + i * layout_.block_bytes, layout_.block_bytes);
  }
  return true;
}

msg::kv_pool_export cpu_engine::export_pool() const {
  msg::kv_pool_export e;
  if (kv_shm_name_.empty() || host_boot_id().empty()) return e;  // private pool, or an unknown host
  e.path = msg::kv_path::host_shm;
  e.host = host_boot_id();
  e.pid = static_cast<int32_t>(::getpid());
  e.handle = kv_shm_name_;
  e.base = reinterpret_cast<uint64_t>(kv_);
  e.pool_bytes = kv_bytes_;
  return e;
}

bool cpu_engine::import_blocks(const msg::kv_pool_export& from, std::span<const uint32_t> src,
                               std::span<const uint32_t> dst, std::string& error) {
  if (from.path != msg::kv_path::host_shm || from.host != host_boot_id()) {
    error = "the source pool is not shared memory on this host";
    return false;
  }
  if (src.size() > dst.size()) {
    error = "fewer destination blocks than source blocks";
    return false;
  }
  const uint64_t block_bytes = layout_.block_bytes;
  for (uint32_t b : src) {
    if ((uint64_t{b} + 1) * block_bytes > from.pool_bytes) {
      error = "source block " + std::to_string(b) + " is outside the exported pool";
      return false;
    }
  }
  for (std::size_t i = 0; i < src.size(); ++i) {
    if (dst[i] >= kv_total_blocks_) {
      error = "destination block " + std::to_string(dst[i]) + " is outside this pool";
      return false;
    }
  }
  const std::byte* base = imported_.map(from.handle, from.pool_bytes, error);
  if (!base) return false;
  for (std::size_t i = 0; i < src.size(); ++i) {
    std::memcpy(block_ptr(dst[i]), base + uint64_t{src[i]} * block_bytes, block_bytes);
  }
  return true;
}

std::unique_ptr<engine> make_cpu_engine(const deployment_config& config, const actor_config& actor,
                                        const kv_pool_seat& seat) {
  if (config.model.path.empty()) {
    throw std::runtime_error(
        "engine 'cpu' needs model.path: a Hugging Face model directory (config.json, *.safetensors) or a .gguf file");
  }
  cpu_engine_params params;
  params.served_name = config.model.name;
  params.kv_blocks = actor.kv_blocks;
  params.block_tokens = config.model.block_tokens;
  params.max_context = config.model.max_context;
  params.threads = config.engine.threads;
  params.seat = seat;
  const std::filesystem::path path = config.model.path;
  if (is_gguf_file(path)) {
    if (config.model.dtype == "f32") return std::make_unique<cpu_engine>(load_gguf_model_shared(path), std::move(params));
    return std::make_unique<cpu_engine>(load_gguf_native_shared(path), std::move(params));
  }
  return std::make_unique<cpu_engine>(load_hf_model_shared(path), std::move(params));
}

}  // namespace duet
