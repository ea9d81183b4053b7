#include <benchmark/benchmark.h>

#include "runtime/tokenizer.hpp"

static void bm_load(benchmark::State& state) {
  for (auto _ : state) {
    duet::tokenizer tok{duet::load_tokenizer_json(DUET_TEST_DATA "/tokenizers/llama3_1")};
    benchmark::DoNotOptimize(tok.vocab_size());
  }
}
BENCHMARK(bm_load)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
