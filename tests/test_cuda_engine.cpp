// The CUDA engine against the fp32 CPU engine on small random checkpoints (llama with GQA, qwen2
// with q/k/v biases): prefill logits, chunked prefill, teacher-forced decode steps through the
// graphs, graph replay equal to eager runs, KV block transfer, host-side penalties, input checks.
// Needs a GPU; skips without one.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <random>
#include <string_view>

#include "runtime/cpu_engine.hpp"
#include "runtime/cuda_engine.hpp"
#include "runtime/random_checkpoint.hpp"
#include "runtime/sampler.hpp"
#include "tests/cuda_test_util.hpp"

using namespace duet;
using namespace duet::cuda_test;

namespace {

std::filesystem::path checkpoint(const std::string& arch) {
  const auto dir = std::filesystem::path(DUET_BINARY_DIR) / "test-cuda-engine" / arch;
  random_checkpoint_params p;
  p.arch = arch;
  p.size = "tiny";
  p.seed = 11;
  p.norm_stddev = 0.1;
  p.stddev = 0.05;
  // head_dim 128 (the CUDA kernels' one size), 2 layers, a small vocabulary.
  p.overrides.layers = 2;
  p.overrides.vocab = 3000;
  if (arch == "llama") {
    p.overrides.hidden = 256;
    p.overrides.heads = 2;
    p.overrides.kv_heads = 1;
    p.overrides.ffn = 512;
  } else {
    p.overrides.hidden = 384;
    p.overrides.heads = 3;
    p.overrides.kv_heads = 1;
    p.overrides.ffn = 640;
  }
  p.overrides.head_dim = 128;
  write_random_checkpoint(dir, p);
  return dir;
}

double rel(std::span<const float> a, std::span<const float> b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return std::sqrt(num / den);
}

struct sequence {
  uint64_t id;
  std::vector<int32_t> tokens;
  std::vector<uint32_t> blocks;
};

std::vector<sequence> make_sequences(std::mt19937& rng, const std::vector<uint32_t>& lens,
                                     uint32_t vocab, uint32_t extra) {
  std::vector<sequence> out;
  uint32_t next_block = 0;
  for (std::size_t i = 0; i < lens.size(); ++i) {
    sequence s;
    s.id = 100 + i;
    for (uint32_t t = 0; t < lens[i]; ++t) s.tokens.push_back(static_cast<int32_t>(rng() % vocab));
    const uint32_t blocks = (lens[i] + extra + 15) / 16;
    for (uint32_t b = 0; b < blocks; ++b) s.blocks.push_back(next_block++);
    std::shuffle(s.blocks.begin(), s.blocks.end(), rng);
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<prefill_chunk> whole(const std::vector<sequence>& seqs) {
  std::vector<prefill_chunk> chunks;
  for (const auto& s : seqs) chunks.push_back({s.id, s.tokens, 0, s.blocks, true, nullptr});
  return chunks;
}

/// Appends next[i] to sequence i and returns the decode slots of every sequence.
std::vector<decode_slot> append_tokens(std::vector<sequence>& seqs, const std::vector<int32_t>& next) {
  std::vector<decode_slot> slots;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    seqs[i].tokens.push_back(next[i]);
    slots.push_back({seqs[i].id, seqs[i].tokens, seqs[i].blocks, nullptr});
  }
  return slots;
}

/// Greedy decode steps of `seqs` on both engines, fed `graphs`' tokens: every step's logits of
/// `eager` (graphs off) within 1e-2 relative of `graphs`' (graphs on).
void decode_graphs_against_eager(cuda_engine& graphs, cuda_engine& eager, std::vector<sequence>& seqs,
                                 std::vector<int32_t> next, int steps) {
  for (int step = 0; step < steps; ++step) {
    const std::vector<decode_slot> slots = append_tokens(seqs, next);
    const auto ga = graphs.decode(slots);
    (void)eager.decode(slots);
    REQUIRE(ga.tokens.size() == seqs.size());
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const double e = rel(eager.last_logits(i), graphs.last_logits(i));
      INFO("decode step " << step << " sequence " << i << " rel " << e);
      CHECK(e <= 1e-2);
    }
    next = ga.tokens;
  }
}

}  // namespace

TEST_CASE(
    "the CUDA engine's prefill and decode logits follow the fp32 CPU engine (llama and qwen2)") {
  DUET_REQUIRE_GPU();
  for (const std::string arch : {"llama", "qwen2"}) {
    INFO("arch " << arch);
    const auto dir = checkpoint(arch);
    cpu_engine cpu(load_hf_model_shared(dir), cpu_engine_params{"t", 512, 16, 4096, 0, {}});
    cuda_engine_params gp;
    gp.served_name = "t";
    gp.kv_blocks = 512;
    gp.max_batch = 8;
    gp.prefill_tokens = 64;  // the 300-token prompt runs in five passes
    cuda_engine gpu(dir, gp);
    cpu_engine_params dummy;
    gpu.keep_logits(true);
    std::mt19937 rng(3);
    auto seqs = make_sequences(rng, {1, 17, 300}, 3000, 16);
    (void)dummy;
    const auto cpu_out = cpu.prefill(whole(seqs));
    const auto gpu_out = gpu.prefill(whole(seqs));
    REQUIRE(gpu_out.tokens.size() == 3);
    for (std::size_t i = 0; i < 3; ++i) {
      const double e = rel(gpu.last_logits(i), cpu.last_logits(i));
      INFO("prefill sequence " << i << " rel " << e);
      CHECK(e <= 3e-2);  // bf16 weights and activations against fp32
    }
    // Teacher-forced decode: both engines get the CPU engine's greedy tokens.
    std::vector<int32_t> next = cpu_out.tokens;
    for (int step = 0; step < 6; ++step) {
      const std::vector<decode_slot> slots = append_tokens(seqs, next);
      const auto c = cpu.decode(slots);
      (void)gpu.decode(slots);
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        const double e = rel(gpu.last_logits(i), cpu.last_logits(i));
        INFO("decode step " << step << " sequence " << i << " rel " << e);
        CHECK(e <= 3e-2);
      }
      next = c.tokens;
    }
    CHECK(gpu.graph_steps() == 6);  // every bucket's graph was captured with the engine
    CHECK(gpu.eager_steps() == 0);
  }
}

TEST_CASE("a prefill pass of one row (a one-token prompt alone) follows the fp32 CPU engine") {
  // One row takes the skinny GEMVs, which cannot add into the residual stream as the prefill
  // passes' cuBLASLt GEMMs do: the pass must still add every projection once.
  DUET_REQUIRE_GPU();
  const auto dir = checkpoint("llama");
  cpu_engine cpu(load_hf_model_shared(dir), cpu_engine_params{"t", 64, 16, 4096, 0, {}});
  cuda_engine_params gp;
  gp.served_name = "t";
  gp.kv_blocks = 64;
  gp.max_batch = 4;
  cuda_engine gpu(dir, gp);
  gpu.keep_logits(true);
  std::mt19937 rng(9);
  auto seqs = make_sequences(rng, {1}, 3000, 16);
  (void)cpu.prefill(whole(seqs));
  (void)gpu.prefill(whole(seqs));
  const double e = rel(gpu.last_logits(0), cpu.last_logits(0));
  INFO("rel " << e);
  CHECK(e <= 3e-2);
}

TEST_CASE("graph replay, eager decode and chunked prefill give the same results") {
  DUET_REQUIRE_GPU();
  const auto dir = checkpoint("llama");
  cuda_engine_params gp;
  gp.kv_blocks = 256;
  gp.max_batch = 16;
  gp.prefill_tokens = 512;
  cuda_engine graphs(dir, gp);
  gp.cuda_graphs = false;
  gp.prefill_tokens = 40;
  cuda_engine eager(dir, gp);
  graphs.keep_logits(true);
  eager.keep_logits(true);
  std::mt19937 rng(5);
  auto seqs = make_sequences(rng, {3, 90, 130, 11, 12}, 3000, 8);
  // The API-level chunks of sequence 2 arrive in two prefill calls on the eager engine.
  std::vector<prefill_chunk> first_half{{seqs[2].id,
                                         std::span<const int32_t>(seqs[2].tokens).first(64), 0,
                                         seqs[2].blocks, false, nullptr}};
  (void)eager.prefill(first_half);
  std::vector<prefill_chunk> rest;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    if (i == 2) {
      rest.push_back({seqs[i].id, std::span<const int32_t>(seqs[i].tokens).subspan(64), 64,
                      seqs[i].blocks, true, nullptr});
    } else {
      rest.push_back({seqs[i].id, seqs[i].tokens, 0, seqs[i].blocks, true, nullptr});
    }
  }
  const auto a = graphs.prefill(whole(seqs));
  const auto b = eager.prefill(rest);
  REQUIRE(a.tokens.size() == b.tokens.size());
  for (std::size_t i = 0; i < a.tokens.size(); ++i) {
    const double e = rel(eager.last_logits(i), graphs.last_logits(i));
    INFO("prefill " << i << " rel " << e);
    CHECK(e <=
          1e-2);  // other pass boundaries change GEMM shapes (cuBLASLt algorithms), not the math
  }
  decode_graphs_against_eager(graphs, eager, seqs, a.tokens, 4);
  CHECK(graphs.graph_steps() == 4);  // captured when the engine was built: every step replays
  CHECK(graphs.eager_steps() == 0);
  CHECK(eager.graph_steps() == 0);
}

TEST_CASE("a batch between powers of two replays the graph of its multiple of 32 and matches eager decode") {
  DUET_REQUIRE_GPU();
  const auto dir = checkpoint("llama");
  cuda_engine_params gp;
  gp.kv_blocks = 512;
  gp.max_batch = 128;
  gp.prefill_tokens = 2048;
  cuda_engine graphs(dir, gp);  // buckets 1 .. 32, 64, 96, 128: 70 rows run the 96-row graph
  gp.graphs_at_start = false;
  cuda_engine lazy(dir, gp);  // captures a bucket's graph on its first step instead
  gp.cuda_graphs = false;
  cuda_engine eager(dir, gp);
  cuda_engine eager_twin(dir, gp);  // the lazy engine's reference
  for (cuda_engine* e : {&graphs, &lazy, &eager, &eager_twin}) e->keep_logits(true);
  std::mt19937 rng(9);
  std::vector<uint32_t> lens(70);
  for (auto& l : lens) l = 5 + rng() % 40;
  auto seqs = make_sequences(rng, lens, 3000, 8);
  auto lazy_seqs = seqs;
  const auto a = graphs.prefill(whole(seqs));
  for (cuda_engine* e : {&lazy, &eager, &eager_twin}) (void)e->prefill(whole(seqs));
  REQUIRE(seqs.size() == 70);
  decode_graphs_against_eager(graphs, eager, seqs, a.tokens, 3);
  CHECK(graphs.graph_steps() == 3);  // the 96-row graph was captured with the engine
  CHECK(graphs.eager_steps() == 0);
  decode_graphs_against_eager(lazy, eager_twin, lazy_seqs, a.tokens, 3);
  CHECK(lazy.graph_steps() == 2);  // the first step captures the 96-row graph, two replay it
  CHECK(lazy.eager_steps() == 1);
}

TEST_CASE("batch-1 decode in one kernel follows the fp32 CPU engine as the kernels apart do") {
  DUET_REQUIRE_GPU();
  for (const std::string arch : {"llama", "qwen2"}) {
    INFO("arch " << arch);
    const auto dir = checkpoint(arch);
    cpu_engine cpu(load_hf_model_shared(dir), cpu_engine_params{"t", 256, 16, 4096, 0, {}});
    cuda_engine_params gp;
    gp.kv_blocks = 256;
    gp.max_batch = 8;
    gp.prefill_tokens = 512;
    gp.fused_decode = true;
    cuda_engine fused(dir, gp);
    gp.cuda_graphs = false;
    cuda_engine fused_eager(dir, gp);
    gp.cuda_graphs = true;
    gp.fused_decode = false;
    cuda_engine apart(dir, gp);
    if (const char* env = std::getenv("DUET_DECODE_FUSED"); env && *env) {
      CHECK(fused.fused_decode() == (std::string_view(env) != "0"));  // the environment decides
      CHECK(apart.fused_decode() == (std::string_view(env) != "0"));
      return;
    }
    REQUIRE(fused.fused_decode());
    REQUIRE(fused_eager.fused_decode());
    REQUIRE_FALSE(apart.fused_decode());
    for (cuda_engine* e : {&fused, &fused_eager, &apart}) e->keep_logits(true);
    std::mt19937 rng(21);
    // One key, a split's worth, several splits of a KV head and a long context over many blocks.
    auto seqs = make_sequences(rng, {1, 17, 300, 1000}, 3000, 12);
    (void)cpu.prefill(whole(seqs));
    for (cuda_engine* e : {&fused, &fused_eager, &apart}) (void)e->prefill(whole(seqs));
    std::vector<int32_t> next(seqs.size(), 7);
    for (int step = 0; step < 6; ++step) {
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        seqs[i].tokens.push_back(next[i]);
        const decode_slot slot{seqs[i].id, seqs[i].tokens, seqs[i].blocks, nullptr};
        const auto c = cpu.decode({&slot, 1});
        (void)apart.decode({&slot, 1});
        (void)fused.decode({&slot, 1});
        (void)fused_eager.decode({&slot, 1});
        const double fused_err = rel(fused.last_logits(0), cpu.last_logits(0));
        const double apart_err = rel(apart.last_logits(0), cpu.last_logits(0));
        const double replay = rel(fused.last_logits(0), fused_eager.last_logits(0));
        INFO("step " << step << " sequence " << i << " (" << seqs[i].tokens.size()
                     << " tokens): fused " << fused_err << ", apart " << apart_err
                     << " from the CPU engine; graph against eager " << replay);
        // Apart from attention (fp32 probabilities, where the kernels apart round them to bf16)
        // the one-kernel step computes the same bits; both stay within bf16 noise of fp32.
        CHECK(fused_err <= 3e-2);
        CHECK(fused_err <= apart_err + 1e-2);
        CHECK(replay <= 1e-6);  // a fixed order of sums: replays are deterministic
        next[i] = c.tokens[0];
      }
    }
    CHECK(fused.graph_steps() == 6 * seqs.size());  // the cooperative launch replays in a graph
    CHECK(fused.eager_steps() == 0);
    // A batch of two (kernels apart) reads the keys and values the one-kernel steps wrote.
    std::vector<sequence> pair{seqs[1], seqs[3]};
    const std::vector<decode_slot> slots = append_tokens(pair, {next[1], next[3]});
    (void)cpu.decode(slots);
    (void)fused.decode(slots);
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const double e = rel(fused.last_logits(i), cpu.last_logits(i));
      INFO("batch of two, row " << i << " rel " << e);
      CHECK(e <= 3e-2);
    }
  }
}

TEST_CASE("decode after a smaller split-K batch stays right: the split counters keep their place") {
  // The decode attention's split counters once sat where a smaller batch had written its partial
  // results, so a larger batch after it read garbage counters and dropped the merge of some rows
  // (rows 64..95 here). The engine that ran 4 rows first must match a fresh one on all 96.
  DUET_REQUIRE_GPU();
  const auto dir = checkpoint("llama");
  cuda_engine_params gp;
  gp.kv_blocks = 96 * 26 + 16;
  gp.max_batch = 128;
  gp.prefill_tokens = 2048;
  cuda_engine used(dir, gp);
  cuda_engine fresh(dir, gp);
  used.keep_logits(true);
  fresh.keep_logits(true);
  std::mt19937 rng(13);
  std::vector<uint32_t> lens(96);
  for (auto& l : lens) l = 300 + rng() % 100;  // several 64-key splits per sequence
  auto seqs = make_sequences(rng, lens, 3000, 8);
  const auto first = used.prefill(whole(seqs));
  (void)fresh.prefill(whole(seqs));
  const std::vector<decode_slot> all = append_tokens(seqs, first.tokens);
  (void)used.decode(std::span(all).first(4));  // the same positions again below: idempotent
  (void)used.decode(all);
  (void)fresh.decode(all);
  for (std::size_t i = 0; i < all.size(); ++i) {
    const double e = rel(used.last_logits(i), fresh.last_logits(i));
    INFO("sequence " << i << " rel " << e);
    CHECK(e <= 1e-5);
  }
}

TEST_CASE("KV blocks read from one engine and written into another continue the same sequence") {
  DUET_REQUIRE_GPU();
  const auto dir = checkpoint("llama");
  cuda_engine_params gp;
  gp.kv_blocks = 64;
  gp.max_batch = 4;
  cuda_engine prefiller(dir, gp);
  cuda_engine decoder(dir, gp);
  prefiller.keep_logits(true);
  decoder.keep_logits(true);
  std::mt19937 rng(9);
  auto seqs = make_sequences(rng, {45}, 3000, 4);
  const auto first = prefiller.prefill(whole(seqs));
  const uint32_t used = (45 + 15) / 16;
  std::vector<uint32_t> src(seqs[0].blocks.begin(), seqs[0].blocks.begin() + used);
  std::vector<std::byte> bytes(src.size() * prefiller.info().block_bytes);
  REQUIRE(prefiller.read_blocks(src, bytes));
  std::vector<uint32_t> dst(seqs[0].blocks.size());
  std::iota(dst.begin(), dst.end(), 20u);
  REQUIRE(decoder.write_blocks(std::span<const uint32_t>(dst).first(used), bytes));
  CHECK_FALSE(
      decoder.write_blocks(std::vector<uint32_t>{64},
                           std::span<const std::byte>(bytes).first(decoder.info().block_bytes)));
  seqs[0].tokens.push_back(first.tokens[0]);
  const auto a =
      prefiller.decode(std::vector<decode_slot>{{1, seqs[0].tokens, seqs[0].blocks, nullptr}});
  const auto b = decoder.decode(std::vector<decode_slot>{{1, seqs[0].tokens, dst, nullptr}});
  CHECK(a.tokens == b.tokens);
  CHECK(rel(decoder.last_logits(0), prefiller.last_logits(0)) <= 1e-6);
}

TEST_CASE("read_blocks returns every block's bytes in the order asked, over many staging buffers") {
  DUET_REQUIRE_GPU();
  const auto dir = checkpoint("llama");
  cuda_engine_params gp;
  gp.kv_blocks = 4096;  // of this model: several times the 8 MiB a staging buffer holds
  gp.max_batch = 4;
  cuda_engine e(dir, gp);
  const uint64_t block_bytes = e.info().block_bytes;
  const uint32_t n = e.info().kv_blocks;
  REQUIRE(uint64_t{n} * block_bytes > 3 * (8ull << 20));
  std::vector<uint32_t> all(n);
  std::iota(all.begin(), all.end(), 0u);
  std::vector<std::byte> pool(uint64_t{n} * block_bytes);
  std::mt19937 rng(12);
  for (auto& b : pool) b = static_cast<std::byte>(rng());
  REQUIRE(e.write_blocks(all, pool));
  // Runs of consecutive ids (one copy each) between single blocks out of order, and a repeat.
  std::vector<uint32_t> ask;
  for (uint32_t i = 0; i + 64 < n; i += 97) {
    for (uint32_t j = 0; j < 17; ++j) ask.push_back(i + j);
    ask.push_back(n - 1 - i);
  }
  ask.push_back(ask.front());
  std::vector<std::byte> out(ask.size() * block_bytes, std::byte{0xAB});
  REQUIRE(e.read_blocks(ask, out));
  for (std::size_t i = 0; i < ask.size(); ++i) {
    INFO("block " << i << " (id " << ask[i] << ")");
    REQUIRE(std::equal(out.begin() + i * block_bytes, out.begin() + (i + 1) * block_bytes,
                       pool.begin() + uint64_t{ask[i]} * block_bytes));
  }
  CHECK_FALSE(e.read_blocks(std::vector<uint32_t>{n}, std::span(out).first(block_bytes)));
}

TEST_CASE("write_blocks puts every block's bytes where asked, runs and repeats included") {
  DUET_REQUIRE_GPU();
  const auto dir = checkpoint("llama");
  cuda_engine_params gp;
  gp.kv_blocks = 4096;
  gp.max_batch = 4;
  cuda_engine e(dir, gp);
  const uint64_t block_bytes = e.info().block_bytes;
  const uint32_t n = e.info().kv_blocks;
  std::vector<uint32_t> all(n);
  std::iota(all.begin(), all.end(), 0u);
  std::vector<std::byte> expected(uint64_t{n} * block_bytes, std::byte{0x5C});
  REQUIRE(e.write_blocks(all, expected));
  // Runs of consecutive ids between single blocks out of order, more than 16 MiB in all.
  std::vector<uint32_t> put;
  for (uint32_t i = 0; i + 64 < n; i += 61) {
    for (uint32_t j = 0; j < 33; ++j) put.push_back(i + 3 + j);
    put.push_back(n - 1 - i);  // may repeat an id of a run: the later write must win
  }
  REQUIRE(put.size() * block_bytes > 2 * (8ull << 20));
  std::vector<std::byte> in(put.size() * block_bytes);
  std::mt19937 rng(13);
  for (auto& b : in) b = static_cast<std::byte>(rng());
  REQUIRE(e.write_blocks(put, in));
  for (std::size_t i = 0; i < put.size(); ++i) {
    std::copy(in.begin() + i * block_bytes, in.begin() + (i + 1) * block_bytes,
              expected.begin() + uint64_t{put[i]} * block_bytes);
  }
  // Read back in id order: one run, so the read cannot share a mapping mistake with the write.
  std::vector<std::byte> pool(expected.size(), std::byte{0xAB});
  REQUIRE(e.read_blocks(all, pool));
  for (uint32_t b = 0; b < n; ++b) {
    INFO("block " << b);
    REQUIRE(std::equal(pool.begin() + uint64_t{b} * block_bytes,
                       pool.begin() + uint64_t{b + 1} * block_bytes,
                       expected.begin() + uint64_t{b} * block_bytes));
  }
  CHECK_FALSE(e.write_blocks(std::vector<uint32_t>{n}, std::span(in).first(block_bytes)));
  CHECK_FALSE(e.write_blocks(put, std::span(in).first(block_bytes)));
}

TEST_CASE("sampling on the GPU is seeded, and penalties are applied by the host sampler") {
  DUET_REQUIRE_GPU();
  const auto dir = checkpoint("llama");
  cuda_engine_params gp;
  gp.kv_blocks = 64;
  gp.max_batch = 4;
  cuda_engine gpu(dir, gp);
  gpu.keep_logits(true);
  std::mt19937 rng(10);
  auto seqs = make_sequences(rng, {20, 20}, 3000, 4);
  msg::sampling_params hot;
  hot.temperature = 1.5f;
  hot.top_k = 100;
  hot.seed = 42;
  hot.has_seed = true;
  hot.top_logprobs = 4;
  msg::sampling_params penal = hot;
  penal.repetition_penalty = 1.3f;
  penal.frequency_penalty = 0.5f;
  std::vector<prefill_chunk> chunks{{seqs[0].id, seqs[0].tokens, 0, seqs[0].blocks, true, &hot},
                                    {seqs[1].id, seqs[1].tokens, 0, seqs[1].blocks, true, &penal}};
  const auto a = gpu.prefill(chunks);
  const auto samples = gpu.last_samples();
  const auto b = gpu.prefill(chunks);  // the same positions again: the same seeded draw
  CHECK(a.tokens == b.tokens);
  REQUIRE(samples.size() == 2);
  CHECK(samples[0].top.size() == 4);
  CHECK(samples[0].top[0].logprob >= samples[0].top[3].logprob);
  // The penalised row equals the host sampler on the same logits.
  sampler host;
  const auto expect =
      host.sample(gpu.last_logits(1), &penal, seqs[1].tokens, sampler_seed(&penal, seqs[1].id), 20);
  CHECK(expect.token == b.tokens[1]);
}

TEST_CASE("bad inputs are refused before the device is touched and the engine stays usable") {
  DUET_REQUIRE_GPU();
  const auto dir = checkpoint("llama");
  cuda_engine_params gp;
  gp.kv_blocks = 8;
  gp.max_batch = 2;
  cuda_engine gpu(dir, gp);
  std::vector<int32_t> toks{1, 2, 3};
  std::vector<uint32_t> blocks{0};
  std::vector<uint32_t> outside{8};
  std::vector<int32_t> bad{1, 5000};
  CHECK_THROWS_AS((void)gpu.prefill(std::vector<prefill_chunk>{{1, bad, 0, blocks, true, nullptr}}),
                  std::invalid_argument);
  CHECK_THROWS_AS(
      (void)gpu.prefill(std::vector<prefill_chunk>{{1, toks, 0, outside, true, nullptr}}),
      std::invalid_argument);
  CHECK_THROWS_AS((void)gpu.decode(std::vector<decode_slot>{{1, {}, blocks, nullptr}}),
                  std::invalid_argument);
  const auto ok = gpu.prefill(std::vector<prefill_chunk>{{1, toks, 0, blocks, true, nullptr}});
  CHECK(ok.tokens.size() == 1);
  CHECK_THROWS_AS(cuda_engine(dir / "missing", gp), std::exception);
}
