// Every CUDA kernel against its CPU reference (kernels/*_ref.cpp) on swept shapes, with outputs
// poisoned (NaN) first: a NaN left anywhere fails, and so does a relative error
// ||gpu - ref|| / ||ref|| over the bound stated at each check. Needs a GPU; skips without one.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/attention.cuh"
#include "kernels/embedding.cuh"
#include "kernels/gemm.cuh"
#include "kernels/kv_copy.cuh"
#include "kernels/kv_layout.hpp"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "kernels/sampling.cuh"
#include "kernels/silu_mul.cuh"
#include "tests/cuda_test_util.hpp"

using namespace duet::kernels;
using namespace duet::cuda_test;

namespace {

void ok(const kstatus& s) {
  REQUIRE_MESSAGE(s.ok(), s.message());
}

void expect(const error_stats& e, double bound, const std::string& what) {
  INFO(what << ": rel " << e.rel << " (bound " << bound << "), non-finite " << e.nan << " of "
            << e.n);
  CHECK(e.nan == 0);
  CHECK(e.rel <= bound);
}

}  // namespace

TEST_CASE("embedding_gather copies table rows and zeroes rows of out-of-range ids") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(1);
  for (uint32_t hidden : {64u, 4096u}) {
    for (uint32_t rows : {1u, 37u}) {
      const uint32_t vocab = 1000;
      const auto table = random_bf16(uint64_t{vocab} * hidden, rng);
      std::vector<int32_t> ids(rows);
      for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
      ids[0] = rows > 1 ? -1 : ids[0];
      ids.back() = rows > 1 ? static_cast<int32_t>(vocab) : ids.back();
      dbuf<uint16_t> dt(table), dout(uint64_t{rows} * hidden);
      dbuf<int32_t> dids(ids);
      ok(embedding_gather({dt.get(), dids.get(), dout.get(), rows, hidden, vocab}, nullptr));
      std::vector<uint16_t> ref(uint64_t{rows} * hidden);
      embedding_gather_reference({table.data(), ids.data(), ref.data(), rows, hidden, vocab});
      CHECK(dout.download() == ref);  // exact
    }
  }
}

TEST_CASE("kv_copy_blocks copies every listed block, whole and in order, and touches no other") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(5);
  // 2 MiB: the 8B model's block; 48 KiB + 16: a block that ends inside a CTA's piece.
  for (uint64_t block_bytes : {uint64_t{2} << 20, uint64_t{49168}}) {
    const uint32_t blocks = 40;
    std::vector<uint32_t> src_pool(block_bytes / 4 * blocks), dst_pool(src_pool.size());
    for (auto& w : src_pool) w = rng();
    for (auto& w : dst_pool) w = rng();
    std::vector<uint32_t> order(blocks);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<uint32_t> src(order.begin(), order.begin() + 13);
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<uint32_t> dst(order.begin(), order.begin() + 13);
    dbuf<uint32_t> dsrc_pool(src_pool), ddst_pool(dst_pool), dsrc(src), ddst(dst);
    ok(kv_copy_blocks({dsrc_pool.get(), ddst_pool.get(), dsrc.get(), ddst.get(), 13, block_bytes}, nullptr));
    auto expected = dst_pool;
    const uint64_t words = block_bytes / 4;
    for (std::size_t i = 0; i < src.size(); ++i) {
      std::copy_n(src_pool.begin() + static_cast<std::ptrdiff_t>(src[i] * words), words,
                  expected.begin() + static_cast<std::ptrdiff_t>(dst[i] * words));
    }
    CHECK(ddst_pool.download() == expected);  // exact
  }
  CHECK_FALSE(kv_copy_blocks({nullptr, nullptr, nullptr, nullptr, 1, 24}, nullptr).ok());  // not a multiple of 16
}

TEST_CASE("add_rmsnorm matches Hugging Face's bf16 RMSNorm with and without the residual add") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(2);
  for (uint32_t hidden : {64u, 576u, 4096u, 8192u}) {
    for (uint32_t rows : {1u, 5u, 64u}) {
      for (bool add : {false, true}) {
        const uint64_t n = uint64_t{rows} * hidden;
        auto res = random_bf16(n, rng, 2.0f);
        const auto delta = random_bf16(n, rng, 1.0f);
        const auto weight = random_bf16(hidden, rng, 0.1f, 1.0f);
        dbuf<uint16_t> dres(res), ddelta(delta), dw(weight), dout(n);
        ok(add_rmsnorm(
            {dres.get(), add ? ddelta.get() : nullptr, dw.get(), dout.get(), rows, hidden, 1e-5f},
            nullptr));
        std::vector<uint16_t> out_ref(n);
        add_rmsnorm_reference({res.data(), add ? delta.data() : nullptr, weight.data(),
                               out_ref.data(), rows, hidden, 1e-5f});
        // Bound 4e-3: the same bf16 rounding steps; only the fp32 sum order differs (a few 1-ulp
        // flips).
        expect(compare_bf16(dout.download(), out_ref), 4e-3, "rmsnorm out");
        CHECK(dres.download() ==
              res);  // the residual add is exact (one bf16 rounding of an fp32 sum)
      }
    }
  }
}

TEST_CASE(
    "rope_apply rotates q and k with llama3-scaled tables and appends K and V to their pages") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(3);
  struct shape {
    uint32_t q_heads, k_heads, block_tokens;
  };
  // head_dim 128 takes the 16-byte vector kernel, 72 (half not a multiple of 8) the scalar one.
  for (const shape sh : {shape{32, 8, 16}, shape{12, 2, 32}, shape{4, 4, 16}}) {
    for (const uint32_t d : {128u, 72u}) {
      for (uint32_t rows : {1u, 33u}) {
        const uint32_t half = d / 2, max_pos = 4096, layers = 3;
        // Tables as the engine builds them: angle = inv_freq * pos in float, cos/sin rounded to
        // float.
        std::vector<float> cosv(uint64_t{max_pos} * half), sinv(uint64_t{max_pos} * half);
        for (uint32_t p = 0; p < max_pos; ++p) {
          for (uint32_t i = 0; i < half; ++i) {
            const float inv =
                1.0f / std::pow(500000.0f, static_cast<float>(2 * i) / d) / (i > 40 ? 8.0f : 1.0f);
            const float a = inv * static_cast<float>(p);
            cosv[uint64_t{p} * half + i] = static_cast<float>(std::cos(static_cast<double>(a)));
            sinv[uint64_t{p} * half + i] = static_cast<float>(std::sin(static_cast<double>(a)));
          }
        }
        const uint32_t stride = (sh.q_heads + 2 * sh.k_heads) * d + 8;
        auto x = random_bf16(uint64_t{rows} * stride, rng);
        std::vector<int32_t> pos(rows), slots(rows);
        const uint32_t blocks = 8;
        std::vector<int32_t> all(blocks * sh.block_tokens);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        for (uint32_t r = 0; r < rows; ++r) {
          pos[r] = static_cast<int32_t>(rng() % max_pos);
          slots[r] = r == 0 && rows > 1 ? -1 : all[r];
        }
        kv_pool_view kv{nullptr, kv_block_elems(layers, sh.k_heads, d, sh.block_tokens),
                        layers,  sh.k_heads,
                        d,       sh.block_tokens};
        std::vector<uint16_t> pool(kv.block_elems * blocks, 0xffff);  // poisoned
        dbuf<uint16_t> dx(x), dpool(pool);
        dbuf<int32_t> dpos(pos), dslots(slots);
        dbuf<float> dcos(cosv), dsin(sinv);
        rope_params p;
        p.row_stride = stride;
        p.rows = rows;
        p.q_heads = sh.q_heads;
        p.k_heads = sh.k_heads;
        p.head_dim = d;
        p.max_positions = max_pos;
        p.kv = kv;
        p.layer = 1;
        rope_params gp = p;
        gp.x = dx.get();
        gp.positions = dpos.get();
        gp.cos = dcos.get();
        gp.sin = dsin.get();
        gp.slots = dslots.get();
        gp.kv.pool = dpool.get();
        ok(rope_apply(gp, nullptr));
        rope_params rp = p;
        rp.x = x.data();
        rp.positions = pos.data();
        rp.cos = cosv.data();
        rp.sin = sinv.data();
        rp.slots = slots.data();
        rp.kv.pool = pool.data();
        rope_apply_reference(rp);
        // Bound 1e-6: the same fp32 products and bf16 roundings, so bit-identical in practice.
        expect(compare_bf16(dx.download(), x), 1e-6, "rope rows");
        const auto gpu_pool = dpool.download();
        CHECK(std::memcmp(gpu_pool.data(), pool.data(), pool.size() * 2) ==
              0);  // same slots written, the rest untouched
      }
    }
  }
}

TEST_CASE("silu_mul matches bf16(bf16(silu(gate)) * up)") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(4);
  for (uint32_t ffn : {64u, 14336u}) {
    for (uint32_t rows : {1u, 19u}) {
      const auto gu = random_bf16(uint64_t{rows} * 2 * ffn, rng, 3.0f);
      dbuf<uint16_t> dgu(gu), dout(uint64_t{rows} * ffn);
      ok(silu_mul({dgu.get(), dout.get(), rows, ffn}, nullptr));
      std::vector<uint16_t> ref(uint64_t{rows} * ffn);
      silu_mul_reference({gu.data(), ref.data(), rows, ffn});
      // Bound 4e-3: __expf against std::exp moves a few results by one bf16 ulp.
      expect(compare_bf16(dout.download(), ref), 4e-3, "silu_mul");
    }
  }
}

TEST_CASE(
    "gemm matches fp32 accumulation on the skinny and cuBLASLt paths, with bias, fp32 output and "
    "SwiGLU input") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(5);
  gemm_runner runner;
  ok(runner.init());
  struct shape {
    uint32_t m, n, k;
    bool bias, fp32, swiglu;
    gemm_path path;
  };
  std::vector<shape> shapes = {
      {1, 6144, 4096, false, false, false, gemm_path::automatic},
      {3, 1000, 512, true, false, false, gemm_path::skinny},
      {4, 1027, 1024, false, true, false, gemm_path::skinny},
      {1, 2003, 1024, false, false, true, gemm_path::automatic},
      {1, 4096, 14336, false, false, true, gemm_path::skinny},
      {2, 4099, 14336, true, false, false, gemm_path::skinny},
      {1, 5000, 4096, false, true, false, gemm_path::skinny},
      {8, 1027, 1024, false, true, false, gemm_path::automatic},
      {4, 512, 256, false, false, false, gemm_path::cublaslt},
      {37, 6144, 512, true, false, false, gemm_path::automatic},
      {256, 512, 4096, false, false, false, gemm_path::automatic},
      {64, 1003, 1024, false, true, false, gemm_path::automatic},
  };
  if (small_sweep()) shapes.resize(5);
  for (const shape& s : shapes) {
    const uint32_t ldx = s.swiglu ? 2 * s.k : s.k;
    const auto x = random_bf16(uint64_t{s.m} * ldx, rng, 1.0f);
    const auto w = random_bf16(uint64_t{s.n} * s.k, rng, 0.05f);
    const auto bias = random_bf16(s.n, rng, 0.5f);
    dbuf<uint16_t> dx(x), dw(w), db(bias);
    dbuf<uint16_t> dy16(uint64_t{s.m} * s.n);
    dbuf<float> dy32(uint64_t{s.m} * s.n);
    gemm_params g{dx.get(),
                  ldx,
                  dw.get(),
                  s.bias ? db.get() : nullptr,
                  s.fp32 ? static_cast<void*>(dy32.get()) : dy16.get(),
                  s.n,
                  s.m,
                  s.n,
                  s.k,
                  s.fp32,
                  s.swiglu};
    ok(runner.run(g, nullptr, s.path));
    gemm_params r = g;
    r.x = x.data();
    r.w = w.data();
    r.bias = s.bias ? bias.data() : nullptr;
    std::vector<uint16_t> y16(uint64_t{s.m} * s.n);
    std::vector<float> y32(uint64_t{s.m} * s.n);
    r.y = s.fp32 ? static_cast<void*>(y32.data()) : y16.data();
    gemm_reference(r);
    INFO("m " << s.m << " n " << s.n << " k " << s.k);
    // Bound 1e-2 (bf16 output) / 1e-4 (fp32 output): fp32 sums in another order.
    if (s.fp32) {
      expect(compare_f32(dy32.download(), y32), 1e-4, "gemm fp32");
    } else {
      expect(compare_bf16(dy16.download(), y16), 1e-2, "gemm bf16");
    }
  }
}

/// A bf16 GEMM's shape: y [m, n] = x [m, k] . w [n, k]^T (+ bias).
struct gemm_shape {
  uint32_t m, n, k;
  bool bias;
};

/// A GEMM's random operands (x [m, k], w [n, k], bias [n]) on the host and the device.
struct gemm_operands {
  std::vector<uint16_t> x, w, bias;
  dbuf<uint16_t> dx, dw, db;
  gemm_operands(uint32_t m, uint32_t n, uint32_t k, std::mt19937& rng)
      : x(random_bf16(uint64_t{m} * k, rng, 1.0f)),
        w(random_bf16(uint64_t{n} * k, rng, 0.05f)),
        bias(random_bf16(n, rng, 0.5f)),
        dx(x),
        dw(w),
        db(bias) {}
  /// bf16 y = x . w^T (+ bias) on the device buffers, y dense [m, n].
  [[nodiscard]] gemm_params device(uint32_t m, uint32_t n, uint32_t k, bool with_bias,
                                   uint16_t* y) const {
    return gemm_params{dx.get(), k, dw.get(), with_bias ? db.get() : nullptr, y, n, m, n, k};
  }
  /// The same GEMM (g's flags) on the host copies, writing y: gemm_reference's input.
  [[nodiscard]] gemm_params host(const gemm_params& g, uint16_t* y) const {
    gemm_params r = g;
    r.x = x.data();
    r.w = w.data();
    r.bias = g.bias ? bias.data() : nullptr;
    r.y = y;
    return r;
  }
};

/// A shape's operands, its output buffer and the reference y = x . w^T (+ bias), fp32-accumulated.
struct gemm_case {
  gemm_operands op;
  dbuf<uint16_t> dy;
  gemm_params g;
  std::vector<uint16_t> ref;
  gemm_case(const gemm_shape& s, std::mt19937& rng)
      : op(s.m, s.n, s.k, rng),
        dy(uint64_t{s.m} * s.n),
        g(op.device(s.m, s.n, s.k, s.bias, dy.get())),
        ref(uint64_t{s.m} * s.n) {
    gemm_reference(op.host(g, ref.data()));
  }
};

TEST_CASE("gemm with accumulate adds x . w^T to y once per run, the tuner's trials included") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(13);
  gemm_runner runner;
  ok(runner.init());
  // m = 128 and 512 are tuned on first use (multiples of 64); 1 runs the skinny kernel and 37
  // its bucket's (64) algorithm.
  std::vector<gemm_shape> shapes = {
      {128, 4096, 4096, false}, {1, 4096, 4096, false}, {37, 1003, 1024, true}, {512, 4096, 14336, false}};
  if (small_sweep()) shapes.resize(3);
  for (const gemm_shape& s : shapes) {
    const gemm_operands op(s.m, s.n, s.k, rng);
    const auto y0 = random_bf16(uint64_t{s.m} * s.n, rng, 4.0f);
    dbuf<uint16_t> dy(y0);
    gemm_params g = op.device(s.m, s.n, s.k, s.bias, dy.get());
    g.accumulate = true;
    std::vector<uint16_t> ref = y0;
    gemm_params r = op.host(g, ref.data());
    INFO("m " << s.m << " n " << s.n << " k " << s.k);
    for (int run = 1; run <= 2; ++run) {  // the first run tunes where the shape is worth it
      ok(runner.run(g, nullptr));
      gemm_reference(r);
      // Bound 1e-2: fp32 sums in another order, then one bf16 rounding of y + product.
      expect(compare_bf16(dy.download(), ref), 1e-2, "accumulate, run " + std::to_string(run));
    }
  }
  // The skinny kernel writes y; it is refused rather than silently overwriting.
  const gemm_operands op(1, 64, 4096, rng);
  dbuf<uint16_t> dy(64);
  gemm_params g = op.device(1, 64, 4096, false, dy.get());
  g.accumulate = true;
  const kstatus refused = runner.run(g, nullptr, gemm_path::skinny);
  CHECK(refused.message().find("accumulate") != std::string::npos);
}

TEST_CASE("gemm tuning times every candidate once per round, in alternating order, by the median") {
  // Host-only: runs without a GPU.
  const auto order = tuning_trial_order(3, 4, true);
  REQUIRE(order.size() == 12);
  const uint32_t expected[12][2] = {{0, 0}, {1, 0}, {2, 0}, {2, 1}, {1, 1}, {0, 1},
                                    {0, 2}, {1, 2}, {2, 2}, {2, 3}, {1, 3}, {0, 3}};
  for (std::size_t i = 0; i < order.size(); ++i) {
    INFO("trial " << i);
    CHECK(order[i].candidate == expected[i][0]);
    CHECK(order[i].round == expected[i][1]);
  }
  // Each candidate's runs in a row (DUET_GEMM_TUNE_ORDER=seq).
  const auto in_a_row = tuning_trial_order(2, 3, false);
  REQUIRE(in_a_row.size() == 6);
  for (std::size_t i = 0; i < in_a_row.size(); ++i) {
    CHECK(in_a_row[i].candidate == i / 3);
    CHECK(in_a_row[i].round == i % 3);
  }
  CHECK(tuning_trial_order(0, 5, true).empty());
  // One stalled run does not decide in rounds; in a row the mean counts it.
  CHECK(tuning_trial_time({1.0f, 9.0f, 1.2f, 1.1f, 0.9f}, true) == doctest::Approx(1.1f));
  CHECK(tuning_trial_time({1.0f, 2.0f, 3.0f}, false) == doctest::Approx(2.0f));
  CHECK(tuning_trial_time({}, true) == 0.0f);
}

TEST_CASE("gemm plan buckets: decode buckets up to 256 rows, then multiples of 64") {
  CHECK(gemm_plan_rows(1) == 1);
  CHECK(gemm_plan_rows(3) == 4);
  CHECK(gemm_plan_rows(32) == 32);
  CHECK(gemm_plan_rows(33) == 64);
  CHECK(gemm_plan_rows(91) == 96);
  CHECK(gemm_plan_rows(256) == 256);
  CHECK(gemm_plan_rows(257) == 320);
  CHECK(gemm_plan_rows(2000) == 2048);
  const std::vector<uint32_t> buckets = gemm_plan_buckets(2048);
  CHECK(buckets.front() == 1);
  CHECK(buckets.back() == 2048);
  CHECK(buckets.size() == 6 + 7 + 28);  // 1..32, 64..256 by 32, 320..2048 by 64
  for (uint32_t m = 1; m <= 2048; ++m) {
    const uint32_t b = gemm_plan_rows(m);
    INFO("m " << m);
    REQUIRE(b >= m);
    CHECK(std::count(buckets.begin(), buckets.end(), b) == 1);
    CHECK(gemm_plan_rows(b) == b);
  }
}

TEST_CASE("gemm: rows between plan buckets run their bucket's algorithm and stay right") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(17);
  gemm_runner runner;
  ok(runner.init());
  for (const gemm_shape& s : std::vector<gemm_shape>{{91, 4096, 4096, true}, {37, 6144, 4096, false},
                                                     {300, 1003, 1024, true}}) {
    gemm_case c(s, rng);
    std::size_t count = 0;
    ok(runner.candidates(c.g, count));
    INFO("m " << s.m << " n " << s.n << " k " << s.k << ": " << count << " candidates");
    CHECK(count == 1);  // the bucket's algorithm: no heuristic query of its own
    c.dy.poison();
    ok(runner.run(c.g, nullptr));
    check(cudaDeviceSynchronize(), "sync");
    expect(compare_bf16(c.dy.download(), c.ref), 1e-2, "m " + std::to_string(s.m));
  }
}

TEST_CASE("gemm: every cuBLASLt algorithm the tuner may keep is right") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(7);
  gemm_runner runner;
  ok(runner.init());
  std::vector<gemm_shape> shapes = {
      {64, 4096, 14336, false}, {8, 6144, 4096, false}, {96, 1003, 1024, true}, {256, 4096, 4096, false}};
  if (small_sweep()) shapes.resize(2);
  for (const gemm_shape& s : shapes) {
    gemm_case c(s, rng);
    std::size_t count = 0;
    ok(runner.candidates(c.g, count));
    INFO("m " << s.m << " n " << s.n << " k " << s.k << ": " << count << " candidates");
    CHECK(count >= 1);
    for (std::size_t i = 0; i < count; ++i) {
      c.dy.poison();
      ok(runner.run_candidate(c.g, i, nullptr));
      check(cudaDeviceSynchronize(), "sync");
      expect(compare_bf16(c.dy.download(), c.ref), 1e-2, "candidate " + std::to_string(i));
    }
  }
}

TEST_CASE(
    "the skinny gemm that loads its weights before the PDL wait reads the input the kernel "
    "before it wrote on the stream") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(11);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  gemm_runner runner;
  ok(runner.init());
  for (const uint32_t k : {4096u, 14336u}) {
    const uint32_t n = 6144, vocab = 64;
    const auto table = random_bf16(uint64_t{vocab} * k, rng, 1.0f);
    const auto w = random_bf16(uint64_t{n} * k, rng, 0.05f);
    const std::vector<int32_t> id = {37};
    dbuf<uint16_t> dtable(table), dw(w), dx(k), dy(n);
    dbuf<int32_t> did(id);
    for (const bool w_static : {true, false}) {
      dx.poison();
      dy.poison();
      check(cudaDeviceSynchronize(), "sync");
      // x = table[37], written by the kernel just before the GEMV on the same stream.
      ok(embedding_gather({dtable.get(), did.get(), dx.get(), 1, k, vocab}, stream));
      gemm_params g{dx.get(), k, dw.get(), nullptr, dy.get(), n, 1, n, k};
      g.w_static = w_static;
      ok(runner.run(g, stream, gemm_path::skinny));
      check(cudaStreamSynchronize(stream), "sync");
      std::vector<uint16_t> x(table.begin() + uint64_t{37} * k, table.begin() + uint64_t{38} * k);
      std::vector<uint16_t> ref(n);
      gemm_params r = g;
      r.x = x.data();
      r.w = w.data();
      r.y = ref.data();
      gemm_reference(r);
      INFO("k " << k << " w_static " << w_static);
      expect(compare_bf16(dy.download(), ref), 1e-2, "gemm after a writer");
    }
  }
  check(cudaStreamDestroy(stream), "stream");
}

namespace {

struct paged_setup {
  kv_pool_view kv;
  std::vector<uint16_t> pool;
  std::vector<int32_t> table;  // concatenated block tables
  std::vector<int32_t> table_at;
};

// A pool of random K/V with each sequence's blocks scattered in random order.
paged_setup make_pool(std::mt19937& rng, uint32_t kv_heads, uint32_t block_tokens,
                      const std::vector<int>& lens) {
  paged_setup s;
  const uint32_t layers = 2;
  uint32_t blocks = 0;
  for (int len : lens) blocks += (static_cast<uint32_t>(len) + block_tokens - 1) / block_tokens;
  s.kv = kv_pool_view{nullptr, kv_block_elems(layers, kv_heads, 128, block_tokens),
                      layers,  kv_heads,
                      128,     block_tokens,
                      blocks};
  s.pool = random_bf16(s.kv.block_elems * blocks, rng, 1.0f);
  std::vector<int32_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  uint32_t at = 0;
  for (int len : lens) {
    s.table_at.push_back(static_cast<int32_t>(s.table.size()));
    for (uint32_t b = 0; b < (static_cast<uint32_t>(len) + block_tokens - 1) / block_tokens; ++b)
      s.table.push_back(order[at++]);
  }
  return s;
}

}  // namespace

TEST_CASE(
    "prefill_attention matches causal softmax attention over paged KV, GQA, chunks after earlier "
    "chunks") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(6);
  struct shape {
    uint32_t heads, kv_heads, block_tokens;
  };
  struct seq {
    int start, rows;
  };
  std::vector<std::vector<seq>> batches = {
      {{0, 1}}, {{0, 77}, {100, 64}, {513, 200}, {3, 5}}, {{0, 300}}, {{37, 700}, {0, 129}}};
  std::vector<shape> shapes = {{32, 8, 16}, {12, 2, 32}, {28, 4, 8}};
  if (small_sweep()) {
    batches = {{{0, 70}, {40, 9}, {5, 150}}};
    shapes = {{8, 2, 16}};
  }
  // One reference per shape and batch; every variant is checked against it, its output poisoned
  // first.
  for (const shape& sh : shapes) {
    for (const auto& batch : batches) {
      std::vector<int> lens;
      std::vector<int32_t> seq_rows{0}, seq_start;
      uint32_t max_rows = 0;
      for (const seq& s : batch) {
        lens.push_back(s.start + s.rows);
        seq_start.push_back(s.start);
        seq_rows.push_back(seq_rows.back() + s.rows);
        max_rows = std::max<uint32_t>(max_rows, static_cast<uint32_t>(s.rows));
      }
      paged_setup ps = make_pool(rng, sh.kv_heads, sh.block_tokens, lens);
      const uint32_t rows = static_cast<uint32_t>(seq_rows.back());
      const uint32_t q_stride = (sh.heads + 2 * sh.kv_heads) * 128;
      const auto q = random_bf16(uint64_t{rows} * q_stride, rng, 1.0f);
      dbuf<uint16_t> dq(q), dpool(ps.pool), dout(uint64_t{rows} * sh.heads * 128);
      dbuf<int32_t> dtable(ps.table), drows(seq_rows), dstart(seq_start), dat(ps.table_at);
      prefill_attention_params p;
      p.q_stride = q_stride;
      p.out_stride = sh.heads * 128;
      p.kv = ps.kv;
      p.layer = 1;
      p.seqs = static_cast<uint32_t>(batch.size());
      p.max_seq_rows = max_rows;
      p.heads = sh.heads;
      p.kv_heads = sh.kv_heads;
      p.scale = 1.0f / std::sqrt(128.0f);
      std::vector<uint16_t> ref(uint64_t{rows} * sh.heads * 128);
      prefill_attention_params r = p;
      r.q = q.data();
      r.out = ref.data();
      r.kv.pool = ps.pool.data();
      r.block_table = ps.table.data();
      r.seq_rows = seq_rows.data();
      r.seq_start = seq_start.data();
      r.seq_table = ps.table_at.data();
      prefill_attention_reference(r);
      for (uint32_t variant : {0u, 1u, 2u, 3u, 4u, 5u, 6u}) {
        if (variant >= 4 && !prefill_attention_wgmma_available()) continue;
        prefill_attention_params g = p;
        g.variant = variant;
        g.q = dq.get();
        g.out = dout.get();
        g.kv.pool = dpool.get();
        g.block_table = dtable.get();
        g.seq_rows = drows.get();
        g.seq_start = dstart.get();
        g.seq_table = dat.get();
        dout.poison();
        ok(prefill_attention(g, nullptr));
        INFO("variant " << variant << " heads " << sh.heads << "/" << sh.kv_heads
                        << " block_tokens " << sh.block_tokens << " rows " << rows);
        // Bound 1e-2: probabilities rounded to bf16 before P.V, fp32 accumulation
        // (flash-attention numerics).
        expect(compare_bf16(dout.download(), ref), 1e-2, "prefill attention");
      }
    }
  }
}

TEST_CASE("decode_attention_splits fills the SMs' waves within four, with the fewest splits that do") {
  // Host-only: runs without a GPU. 3 CTAs per SM; the 8B shape's 8 KV heads.
  for (const uint32_t sms : {132u, 96u, 64u, 36u}) {
    for (uint32_t batch = 1; batch <= 512; ++batch) {
      const uint32_t s = decode_attention_splits(batch, 8, sms);
      const double waves = double(batch) * 8 * s / (3.0 * sms);
      INFO("SMs " << sms << " batch " << batch << " splits " << s);
      CHECK(s >= 1);
      CHECK(s <= decode_attention_max_splits);
      CHECK(waves >= 0.9);  // the GPU is never left idle for want of CTAs
      CHECK(waves <= std::max(4.0, double(batch) * 8 / (3.0 * sms)));  // nor split past 4 waves
      if (double(batch) * 8 >= 4 * 3.0 * sms) CHECK(s == 1);  // enough waves: no partials
    }
  }
  // The H200's 132 SMs: batch 64 took one split (1.29 waves, the last 0.29 full) and now three;
  // batch 256 (5.2 waves) keeps one.
  CHECK(decode_attention_splits(64, 8, 132) == 3);
  CHECK(decode_attention_splits(8, 8, 132) == 6);
  CHECK(decode_attention_splits(256, 8, 132) == 1);
  CHECK(decode_attention_splits(1, 8, 132) == 48);
}

TEST_CASE(
    "decode_attention matches softmax attention over paged KV with and without split-K, and is "
    "deterministic") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(7);
  struct shape {
    uint32_t heads, kv_heads, block_tokens;
  };
  std::vector<int> lens = {1, 5, 64, 100, 1000, 3000};
  std::vector<shape> shapes = {{32, 8, 16}, {12, 2, 32}, {28, 4, 8}};
  std::vector<uint32_t> splits = {1, 16, 64};
  if (small_sweep()) {
    lens = {1, 70, 300};
    shapes = {{8, 2, 16}};
    splits = {1, 4};
  }
  for (uint32_t variant : {0u, 1u}) {
    for (const shape& sh : shapes) {
      for (uint32_t max_splits : splits) {
        paged_setup ps = make_pool(rng, sh.kv_heads, sh.block_tokens, lens);
        const uint32_t batch = static_cast<uint32_t>(lens.size());
        const uint32_t q_stride = (sh.heads + 2 * sh.kv_heads) * 128;
        const auto q = random_bf16(uint64_t{batch} * q_stride, rng, 1.0f);
        dbuf<uint16_t> dq(q), dpool(ps.pool), dout(uint64_t{batch} * sh.heads * 128);
        dbuf<int32_t> dtable(ps.table), dat(ps.table_at),
            dlens(std::vector<int32_t>(lens.begin(), lens.end()));
        dbuf<char> ws(decode_attention_workspace_bytes(batch, sh.heads, sh.kv_heads, max_splits));
        check(cudaMemset(ws.get(), 0, ws.size()), "memset");
        decode_attention_params p;
        p.q_stride = q_stride;
        p.out_stride = sh.heads * 128;
        p.kv = ps.kv;
        p.layer = 1;
        p.batch = batch;
        p.heads = sh.heads;
        p.kv_heads = sh.kv_heads;
        p.scale = 1.0f / std::sqrt(128.0f);
        p.max_splits = max_splits;
        p.split_min_keys = 64;
        p.variant = variant;
        decode_attention_params g = p;
        g.q = dq.get();
        g.out = dout.get();
        g.kv.pool = dpool.get();
        g.block_table = dtable.get();
        g.seq_table = dat.get();
        g.seq_lens = dlens.get();
        g.workspace = ws.get();
        ok(decode_attention(g, nullptr));
        const auto first = dout.download();
        dout.poison();
        ok(decode_attention(g, nullptr));  // the split counters must be back at zero
        CHECK(dout.download() == first);
        std::vector<uint16_t> ref(uint64_t{batch} * sh.heads * 128);
        std::vector<int32_t> lens32(lens.begin(), lens.end());
        decode_attention_params r = p;
        r.q = q.data();
        r.out = ref.data();
        r.kv.pool = ps.pool.data();
        r.block_table = ps.table.data();
        r.seq_table = ps.table_at.data();
        r.seq_lens = lens32.data();
        decode_attention_reference(r);
        INFO("variant " << variant << " heads " << sh.heads << "/" << sh.kv_heads
                        << " block_tokens " << sh.block_tokens << " max_splits " << max_splits);
        expect(compare_bf16(first, ref), 1e-2, "decode attention");  // bound as for prefill
      }
    }
  }
}

TEST_CASE("one decode_attention workspace serves every batch up to the one it was sized for") {
  // Batches of 4, 16, 8 and 16 again through one workspace sized for 16, split-K on: the split
  // counters of rows 8..15 must not sit where the 4-row launch wrote its partial results.
  DUET_REQUIRE_GPU();
  std::mt19937 rng(11);
  const uint32_t heads = 32, kv_heads = 8, block_tokens = 16, capacity = 16, max_splits = 16;
  std::vector<int> lens(capacity);
  for (auto& l : lens) l = 300 + static_cast<int>(rng() % 700);
  paged_setup ps = make_pool(rng, kv_heads, block_tokens, lens);
  const uint32_t q_stride = heads * 128;
  const auto q = random_bf16(uint64_t{capacity} * q_stride, rng, 1.0f);
  std::vector<int32_t> lens32(lens.begin(), lens.end());
  dbuf<uint16_t> dq(q), dpool(ps.pool), dout(uint64_t{capacity} * heads * 128);
  dbuf<int32_t> dtable(ps.table), dat(ps.table_at), dlens(lens32);
  dbuf<char> ws(decode_attention_workspace_bytes(capacity, heads, kv_heads, max_splits));
  check(cudaMemset(ws.get(), 0, ws.size()), "memset");
  decode_attention_params p;
  p.q_stride = q_stride;
  p.out_stride = heads * 128;
  p.kv = ps.kv;
  p.layer = 1;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.scale = 1.0f / std::sqrt(128.0f);
  p.max_splits = max_splits;
  p.split_min_keys = 64;
  p.workspace_batch = capacity;
  const auto on_device = [&](uint32_t batch) {
    decode_attention_params g = p;
    g.batch = batch;
    g.q = dq.get();
    g.out = dout.get();
    g.kv.pool = dpool.get();
    g.block_table = dtable.get();
    g.seq_table = dat.get();
    g.seq_lens = dlens.get();
    g.workspace = ws.get();
    return g;
  };
  for (const uint32_t batch : {4u, 16u, 8u, 16u}) {
    dout.poison();
    ok(decode_attention(on_device(batch), nullptr));
    std::vector<uint16_t> ref(uint64_t{batch} * heads * 128);
    decode_attention_params r = p;
    r.batch = batch;
    r.q = q.data();
    r.out = ref.data();
    r.kv.pool = ps.pool.data();
    r.block_table = ps.table.data();
    r.seq_table = ps.table_at.data();
    r.seq_lens = lens32.data();
    decode_attention_reference(r);
    auto got = dout.download();
    got.resize(ref.size());
    INFO("batch " << batch);
    expect(compare_bf16(got, ref), 1e-2, "decode attention");
  }
  // Past the workspace: refused, not launched.
  CHECK_FALSE(decode_attention(on_device(capacity + 1), nullptr).ok());
}

TEST_CASE(
    "decode_attention reads the newest key as the RoPE kernel just before it on the stream appends "
    "it") {
  // The decode kernel requests its first tile before waiting for the kernel before it (PDL),
  // except a tile holding the newest key: that key's slot is poisoned (NaN) until rope_apply
  // appends it, so reading it early fails the check.
  DUET_REQUIRE_GPU();
  std::mt19937 rng(9);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const std::vector<int> lens = {17, 100, 1000, 3000};
  const uint32_t heads = 32, kv_heads = 8, batch = static_cast<uint32_t>(lens.size());
  for (const uint32_t block_tokens : {16u, 8u}) {
    for (const uint32_t max_splits : {1u, 16u}) {
      paged_setup ps = make_pool(rng, kv_heads, block_tokens, lens);
      std::vector<int32_t> pos(batch), slots(batch);
      for (uint32_t b = 0; b < batch; ++b) {
        pos[b] = lens[b] - 1;
        const int32_t page = ps.table[ps.table_at[b] + pos[b] / static_cast<int32_t>(block_tokens)];
        slots[b] =
            page * static_cast<int32_t>(block_tokens) + pos[b] % static_cast<int32_t>(block_tokens);
        for (uint32_t kv = 0; kv < 2; ++kv) {
          for (uint32_t h = 0; h < kv_heads; ++h) {
            uint16_t* key = ps.pool.data() + uint64_t(page) * ps.kv.block_elems +
                            ps.kv.offset(1, kv, h, static_cast<uint32_t>(pos[b]) % block_tokens);
            std::fill(key, key + 128, uint16_t{0x7fc0});  // NaN until appended
          }
        }
      }
      const uint32_t q_stride = (heads + 2 * kv_heads) * 128, half = 64, max_pos = 4096;
      std::vector<float> cosv(uint64_t{max_pos} * half), sinv(uint64_t{max_pos} * half);
      for (uint32_t p = 0; p < max_pos; ++p) {
        for (uint32_t i = 0; i < half; ++i) {
          const double a = p / std::pow(500000.0, 2.0 * i / 128);
          cosv[uint64_t{p} * half + i] = static_cast<float>(std::cos(a));
          sinv[uint64_t{p} * half + i] = static_cast<float>(std::sin(a));
        }
      }
      dbuf<uint16_t> dqkv(random_bf16(uint64_t{batch} * q_stride, rng, 1.0f)), dpool(ps.pool),
          dout(uint64_t{batch} * heads * 128);
      dbuf<int32_t> dtable(ps.table), dat(ps.table_at),
          dlens(std::vector<int32_t>(lens.begin(), lens.end())), dpos(pos), dslots(slots);
      dbuf<float> dcos(cosv), dsin(sinv);
      dbuf<char> ws(decode_attention_workspace_bytes(batch, heads, kv_heads, max_splits));
      check(cudaMemset(ws.get(), 0, ws.size()), "memset");
      check(cudaDeviceSynchronize(), "sync");
      rope_params rp;
      rp.x = dqkv.get();
      rp.row_stride = q_stride;
      rp.positions = dpos.get();
      rp.cos = dcos.get();
      rp.sin = dsin.get();
      rp.rows = batch;
      rp.q_heads = heads;
      rp.k_heads = kv_heads;
      rp.head_dim = 128;
      rp.max_positions = max_pos;
      rp.slots = dslots.get();
      rp.kv = ps.kv;
      rp.kv.pool = dpool.get();
      rp.layer = 1;
      ok(rope_apply(rp, stream));
      decode_attention_params g;
      g.q = dqkv.get();
      g.q_stride = q_stride;
      g.out = dout.get();
      g.out_stride = heads * 128;
      g.kv = rp.kv;
      g.layer = 1;
      g.block_table = dtable.get();
      g.seq_table = dat.get();
      g.seq_lens = dlens.get();
      g.batch = batch;
      g.heads = heads;
      g.kv_heads = kv_heads;
      g.scale = 1.0f / std::sqrt(128.0f);
      g.max_splits = max_splits;
      g.split_min_keys = 64;
      g.workspace = ws.get();
      ok(decode_attention(g, stream));
      check(cudaStreamSynchronize(stream), "sync");
      // The reference over what rope_apply left: rotated q, the pool with the newest keys appended.
      const auto q = dqkv.download();
      const auto pool = dpool.download();
      std::vector<uint16_t> ref(uint64_t{batch} * heads * 128);
      std::vector<int32_t> lens32(lens.begin(), lens.end());
      decode_attention_params r = g;
      r.q = q.data();
      r.out = ref.data();
      r.kv.pool = const_cast<uint16_t*>(pool.data());
      r.block_table = ps.table.data();
      r.seq_table = ps.table_at.data();
      r.seq_lens = lens32.data();
      decode_attention_reference(r);
      INFO("block_tokens " << block_tokens << " max_splits " << max_splits);
      expect(compare_bf16(dout.download(), ref), 1e-2, "decode attention after the append");
    }
  }
  check(cudaStreamDestroy(stream), "stream");
}

/// `p` reading and writing these buffers (host or device).
sample_params with_buffers(sample_params p, const float* logits, const sample_row* requests,
                           int32_t* tokens, float* logprobs, int32_t* top_ids, float* top_logprobs) {
  p.logits = logits;
  p.requests = requests;
  p.tokens = tokens;
  p.logprobs = logprobs;
  p.top_ids = top_ids;
  p.top_logprobs = top_logprobs;
  return p;
}

/// Samples `logits` ([rows, vocab]) on the GPU, without and with the split statistics, and
/// checks both against sample_tokens_reference: tokens and top ids exact, logprobs within 1e-3
/// (equal where the reference's are infinite or NaN). Returns the reference's tokens.
std::vector<int32_t> check_sampling_against_reference(const std::vector<float>& logits,
                                      const std::vector<sample_row>& rows, uint32_t vocab,
                                      uint32_t max_top) {
  const uint32_t n = static_cast<uint32_t>(rows.size());
  sample_params p;
  p.ld = vocab;
  p.rows = n;
  p.vocab = vocab;
  p.max_top = max_top;
  std::vector<int32_t> tok(n), top(uint64_t{n} * max_top);
  std::vector<float> lp(n), toplp(uint64_t{n} * max_top);
  sample_tokens_reference(
      with_buffers(p, logits.data(), rows.data(), tok.data(), lp.data(), top.data(), toplp.data()));
  auto close = [](float a, float b) {
    return a == b || (std::isnan(a) && std::isnan(b)) || std::abs(a - b) <= 1e-3f;
  };
  dbuf<float> dl(logits);
  dbuf<sample_row> dr(rows);
  for (bool split : {false, true}) {
    dbuf<int32_t> dtok(n), dtop(uint64_t{n} * max_top);
    dbuf<float> dlp(n), dtoplp(uint64_t{n} * max_top);
    dbuf<uint8_t> dstats(sample_stats_bytes(n, vocab));
    sample_params g =
        with_buffers(p, dl.get(), dr.get(), dtok.get(), dlp.get(), dtop.get(), dtoplp.get());
    g.stats = split ? static_cast<void*>(dstats.get()) : nullptr;
    ok(sample_tokens(g, nullptr));
    const auto gtok = dtok.download();
    const auto glp = dlp.download();
    const auto gtop = dtop.download();
    const auto gtoplp = dtoplp.download();
    for (uint32_t i = 0; i < n; ++i) {
      INFO("vocab " << vocab << " split " << split << " row " << i << " t "
                    << rows[i].temperature << " k " << rows[i].top_k << " p " << rows[i].top_p
                    << " min_p " << rows[i].min_p);
      CHECK(gtok[i] == tok[i]);  // exact: same thresholds, same id-order draw
      CHECK(close(glp[i], lp[i]));
      for (uint32_t j = 0; j < max_top; ++j) {
        CHECK(gtop[uint64_t{i} * max_top + j] == top[uint64_t{i} * max_top + j]);
        if (top[uint64_t{i} * max_top + j] >= 0) {
          CHECK(close(gtoplp[uint64_t{i} * max_top + j], toplp[uint64_t{i} * max_top + j]));
        }
      }
    }
  }
  return tok;
}

TEST_CASE(
    "sample_tokens: greedy, temperature with top-k/top-p/min-p, logprobs and top-N match the "
    "reference") {
  DUET_REQUIRE_GPU();
  std::mt19937 rng(8);
  std::vector<uint32_t> vocabs = {1001, 128256};  // 1001: rows not 16-byte aligned, scalar loads
  if (small_sweep()) vocabs = {3000};
  for (uint32_t vocab : vocabs) {
    std::vector<sample_row> rows;
    auto add = [&](float t, int k, float tp, float mp, uint32_t top) {
      sample_row r;
      r.temperature = t;
      r.top_k = k;
      r.top_p = tp;
      r.min_p = mp;
      r.top_logprobs = top;
      r.uniform = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      rows.push_back(r);
    };
    add(0, 0, 1, 0, 0);
    add(0, 0, 1, 0, 5);  // greedy on a tie (set below)
    for (int rep = 0; rep < 4; ++rep) {
      add(1.0f, 0, 1, 0, 0);
      add(0.7f, 50, 1, 0, 3);
      add(1.0f, 0, 0.9f, 0, 0);
      add(1.3f, 0, 1, 0.05f, 20);
      add(0.8f, 40, 0.8f, 0.02f, 1);
      add(1.0f, 1, 1, 0, 0);
      add(1.0f, 0, 0.0f, 0, 0);
    }
    const uint32_t n = static_cast<uint32_t>(rows.size());
    std::vector<float> logits(uint64_t{n} * vocab);
    std::normal_distribution<float> d(0.0f, 3.0f);
    for (auto& v : logits) v = d(rng);
    logits[uint64_t{1} * vocab + 17] = 100.0f;  // row 1: a tie at the maximum, lowest id wins
    logits[uint64_t{1} * vocab + 5] = 100.0f;
    const auto tokens = check_sampling_against_reference(logits, rows, vocab, 20);
    CHECK(tokens[1] == 5);
  }
}

TEST_CASE("sample_tokens: ties, NaN and infinities across the split statistics' pieces") {
  DUET_REQUIRE_GPU();
  uint32_t span = 1;  // logits per piece: the largest vocabulary that is one piece
  while (sample_stat_splits(span + 1) == 1) ++span;
  REQUIRE(span < 128256);
  for (uint32_t vocab : {128256u, 4099u, 2048u, 7u}) {
    std::vector<sample_row> rows(6);
    rows[4].temperature = 1.0f;  // the draw skips NaN (top-N of a row with NaN is not defined)
    rows[5].top_logprobs = 3;
    const uint32_t n = static_cast<uint32_t>(rows.size());
    std::vector<float> logits(uint64_t{n} * vocab);
    std::mt19937 rng(vocab);
    std::normal_distribution<float> d(0.0f, 2.0f);
    for (auto& v : logits) v = d(rng);
    auto at = [&](uint32_t r, uint32_t i) -> float& {
      return logits[uint64_t{r} * vocab + std::min(i, vocab - 1)];
    };
    at(0, vocab - 1) = 50.0f;  // row 0: equal maxima in the last and first pieces: the first id
    at(0, 3) = 50.0f;
    const bool two_pieces = vocab > span + 1;
    if (two_pieces) {
      at(1, span + 1) = 50.0f;  // row 1: in the second piece, and NaN beside it
      at(1, span) = std::nanf("");
    }
    for (uint32_t i = 0; i < vocab; ++i) at(2, i) = -INFINITY;  // row 2: nothing but -inf
    at(3, vocab / 2) = INFINITY;                                 // row 3: +inf twice
    at(3, vocab - 1) = INFINITY;
    const uint32_t nan_end = two_pieces ? span : vocab / 2;  // row 4: a piece of NaN
    for (uint32_t i = 0; i < nan_end; ++i) at(4, i) = std::nanf("");
    const auto tokens = check_sampling_against_reference(logits, rows, vocab, 4);
    CHECK(tokens[0] == 3);
    if (two_pieces) CHECK(tokens[1] == static_cast<int32_t>(span + 1));
    CHECK(tokens[3] == static_cast<int32_t>(vocab / 2));
  }
}

TEST_CASE("launchers refuse bad shapes with a status instead of launching") {
  DUET_REQUIRE_GPU();
  rmsnorm_params p;
  p.hidden = 7;
  const kstatus s = add_rmsnorm(p, nullptr);
  CHECK_FALSE(s.ok());
  CHECK(s.message().find("hidden") != std::string::npos);
  decode_attention_params a;
  a.kv.head_dim = 64;
  CHECK_FALSE(decode_attention(a, nullptr).ok());

  // A well-formed prefill shape (pointers are never read: the launchers refuse first).
  int32_t dummy = 0;
  uint16_t cell = 0;
  prefill_attention_params f;
  f.q = f.out = &cell;
  f.q_stride = f.out_stride = 4 * 128;
  f.kv = kv_pool_view{&cell, kv_block_elems(1, 1, 128, 16), 1, 1, 128, 16, 0};
  f.block_table = f.seq_rows = f.seq_start = f.seq_table = &dummy;
  f.seqs = 1;
  f.max_seq_rows = 1;
  f.heads = 4;
  f.kv_heads = 1;
  f.variant = 7;
  const kstatus bad_variant = prefill_attention(f, nullptr);
  CHECK(bad_variant.message().find("variant") != std::string::npos);
  if (prefill_attention_wgmma_available()) {
    f.variant = 5;  // the TMA view needs the pool's size
    const kstatus no_blocks = prefill_attention(f, nullptr);
    CHECK(no_blocks.message().find("kv.blocks") != std::string::npos);
    f.kv.blocks = 4;
    f.kv.block_tokens = 12;  // not a power of two
    f.kv.block_elems = kv_block_elems(1, 1, 128, 12);
    const kstatus odd_blocks = prefill_attention(f, nullptr);
    CHECK(odd_blocks.message().find("power of two") != std::string::npos);
  }
}
