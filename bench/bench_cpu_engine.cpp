// CPU engine throughput: prefill tokens/s and decode tokens/s at batch 1 and 8, on random-weight
// checkpoints written at start-up: "tiny" (2 layers, hidden 64, the real Llama 3 vocabulary of
// 128256) and "small" (the SmolLM2-135M shape: 30 layers, hidden 576, 9 heads, 3 KV heads,
// FFN 1536, vocabulary 49152, tied embeddings). docs/cpu-engine.md records the figures.
//
// With models/smollm2-135m-instruct-q4_1.gguf present (scripts/fetch-model.sh; or
// $DUET_MODELS_DIR), also the real SmolLM2-135M-Instruct GGUF on the native path (Q4_1 blocks)
// and on the fp32 path (dequantized): "gguf_native" and "gguf_f32";
// bench/smollm2_vs_llamacpp.sh compares them with llama.cpp.
//
//   ./build-cpu/bench/bench_cpu_engine --benchmark_counters_tabular=true
// DUET_BENCH_THREADS sets the engine's threads (default: all cores).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "runtime/cpu_engine.hpp"
#include "runtime/gguf_model.hpp"
#include "runtime/random_checkpoint.hpp"

namespace {

namespace fs = std::filesystem;

struct bench_model {
  fs::path dir;
  std::shared_ptr<const duet::model_weights> weights;
  ~bench_model() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

const bench_model& model(const std::string& size) {
  static std::map<std::string, std::unique_ptr<bench_model>> models;
  auto& m = models[size];
  if (!m) {
    m = std::make_unique<bench_model>();
    m->dir = fs::temp_directory_path() / ("duet-bench-cpu-" + std::to_string(::getpid()) + "-" + size);
    duet::random_checkpoint_params p;
    p.arch = "llama";
    p.size = size;
    p.seed = 1;
    (void)duet::write_random_checkpoint(m->dir, p);
    m->weights = std::make_shared<const duet::model_weights>(duet::load_hf_model(m->dir));
  }
  return *m;
}

fs::path smollm2_path() {
  const char* env = std::getenv("DUET_MODELS_DIR");
  const fs::path dir = env != nullptr && *env != '\0' ? fs::path(env) : fs::path(DUET_SOURCE_DIR) / "models";
  return dir / "smollm2-135m-instruct-q4_1.gguf";
}

duet::cpu_engine make_engine(const std::string& size) {
  duet::cpu_engine_params p;
  p.served_name = size;
  p.kv_blocks = 1024;
  p.max_context = 8192;
  if (const char* t = std::getenv("DUET_BENCH_THREADS")) p.threads = static_cast<uint32_t>(std::atoi(t));
  if (size == "gguf_native") {
    static const auto native = duet::load_gguf_native_shared(smollm2_path());
    return duet::cpu_engine(native, p);
  }
  if (size == "gguf_f32") {
    static const auto f32 = duet::load_gguf_model_shared(smollm2_path());
    return duet::cpu_engine(f32, p);
  }
  return duet::cpu_engine(model(size).weights, p);
}

std::vector<int32_t> tokens(std::size_t n, uint32_t seed, int32_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> out(n);
  for (auto& t : out) t = dist(rng);
  return out;
}

std::vector<uint32_t> block_range(uint32_t first, uint32_t count) {
  std::vector<uint32_t> b(count);
  std::iota(b.begin(), b.end(), first);
  return b;
}

// One prompt of state.range(0) tokens, one chunk.
void prefill(benchmark::State& state, const std::string& size) {
  auto e = make_engine(size);
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto prompt = tokens(n, 1, static_cast<int32_t>(e.info().vocab_size));
  const auto blocks = block_range(0, static_cast<uint32_t>((n + 15) / 16));
  duet::prefill_chunk c{1, prompt, 0, blocks, true, nullptr};
  for (auto _ : state) benchmark::DoNotOptimize(e.prefill(std::span(&c, 1)));
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = e.threads();
}

// One decode step for state.range(0) sequences, each with 128 tokens of context.
void decode(benchmark::State& state, const std::string& size) {
  auto e = make_engine(size);
  const auto batch = static_cast<uint32_t>(state.range(0));
  constexpr uint32_t context = 128;
  std::vector<std::vector<int32_t>> histories;
  std::vector<std::vector<uint32_t>> tables;
  for (uint32_t s = 0; s < batch; ++s) {
    histories.push_back(tokens(context, 10 + s, static_cast<int32_t>(e.info().vocab_size)));
    tables.push_back(block_range(s * 16, 16));
    duet::prefill_chunk c{s, std::span(histories[s]).first(context - 1), 0, tables[s], false, nullptr};
    (void)e.prefill(std::span(&c, 1));
  }
  std::vector<duet::decode_slot> slots;
  for (uint32_t s = 0; s < batch; ++s) slots.push_back({s, histories[s], tables[s], nullptr});
  // Every step decodes position `context - 1` again (its KV slot is rewritten), so the context stays fixed.
  for (auto _ : state) benchmark::DoNotOptimize(e.decode(slots));
  state.counters["tokens/s"] = benchmark::Counter(batch, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = e.threads();
}

}  // namespace

BENCHMARK_CAPTURE(prefill, tiny, std::string("tiny"))->Arg(128)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(prefill, small, std::string("small"))->Arg(128)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(decode, tiny, std::string("tiny"))->Arg(1)->Arg(8)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(decode, small, std::string("small"))->Arg(1)->Arg(8)->Unit(benchmark::kMillisecond)->UseRealTime();

// The real model, when fetched.
const bool smollm2_registered = [] {
  if (!fs::exists(smollm2_path())) return false;
  for (const char* kind : {"gguf_native", "gguf_f32"}) {
    benchmark::RegisterBenchmark((std::string("prefill/") + kind).c_str(), prefill, std::string(kind))
        ->Arg(128)->Unit(benchmark::kMillisecond)->UseRealTime();
    benchmark::RegisterBenchmark((std::string("decode/") + kind).c_str(), decode, std::string(kind))
        ->Arg(1)->Arg(8)->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  return true;
}();

BENCHMARK_MAIN();
