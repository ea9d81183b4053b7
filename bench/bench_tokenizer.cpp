// Encode/decode throughput of the byte-level BPE tokenizer on one thread, on the same text and
// in the same shapes as bench/tokenizer_hf.py measures HF `tokenizers` (see docs/tokenizer.md):
//   ./build/bench/bench_tokenizer --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/tokenizer.hpp"

namespace {

const std::string& bench_text() {
  static const std::string text = [] {
    std::ifstream in(DUET_BENCH_DATA "/tokenizer-bench.txt", std::ios::binary);
    if (!in) throw std::runtime_error(DUET_BENCH_DATA "/tokenizer-bench.txt: cannot open");
    std::ostringstream buf;
    buf << in.rdbuf();
    return buf.str();
  }();
  return text;
}

// 4 KiB pieces cut at the first line end at or after 4096 bytes (as tokenizer_hf.py cuts).
const std::vector<std::string>& bench_chunks() {
  static const std::vector<std::string> chunks = [] {
    const std::string& text = bench_text();
    std::vector<std::string> out;
    std::size_t start = 0;
    while (start < text.size()) {
      std::size_t end = text.find('\n', start + 4096);
      end = end == std::string::npos ? text.size() : end + 1;
      out.push_back(text.substr(start, end - start));
      start = end;
    }
    return out;
  }();
  return chunks;
}

std::string tokenizer_dir(const std::string& model) {
  return std::string(DUET_TEST_DATA) + "/tokenizers/" + model;
}

const duet::tokenizer& loaded(const std::string& model) {
  static std::map<std::string, duet::tokenizer> cache;
  auto it = cache.find(model);
  if (it == cache.end()) {
    it = cache.emplace(model, duet::tokenizer{duet::load_tokenizer_json(tokenizer_dir(model))})
             .first;
  }
  return it->second;
}

void report(benchmark::State& state, std::size_t bytes, std::size_t tokens) {
  state.SetBytesProcessed(static_cast<int64_t>(bytes) * state.iterations());
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(tokens) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.counters["tokens"] = static_cast<double>(tokens);
}

// The whole text (about 260 KB) in one encode call; the word cache is warm after the first.
void bm_encode_whole(benchmark::State& state, const std::string& model) {
  const duet::tokenizer& tok = loaded(model);
  const std::string& text = bench_text();
  std::size_t tokens = 0;
  for (auto _ : state) {
    const auto ids = tok.encode(text, false);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  report(state, text.size(), tokens);
}

// The same text as about 64 prompts of 4 KiB, one encode call each.
void bm_encode_chunks(benchmark::State& state, const std::string& model) {
  const duet::tokenizer& tok = loaded(model);
  std::size_t bytes = 0;
  std::size_t tokens = 0;
  for (auto _ : state) {
    bytes = 0;
    tokens = 0;
    for (const std::string& chunk : bench_chunks()) {
      const auto ids = tok.encode(chunk, false);
      bytes += chunk.size();
      tokens += ids.size();
      benchmark::DoNotOptimize(ids.data());
    }
  }
  report(state, bytes, tokens);
}

// A freshly built tokenizer each time: every word goes through BPE once (empty cache).
void bm_encode_cold(benchmark::State& state, const std::string& model) {
  const std::string& text = bench_text();
  std::size_t tokens = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto tok = std::make_unique<duet::tokenizer>(duet::load_tokenizer_json(tokenizer_dir(model)));
    state.ResumeTiming();
    const auto ids = tok->encode(text, false);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
    state.PauseTiming();
    tok.reset();
    state.ResumeTiming();
  }
  report(state, text.size(), tokens);
}

// decode of the whole text's ids, and the same ids through the stream decoder one by one.
void bm_decode(benchmark::State& state, const std::string& model) {
  const duet::tokenizer& tok = loaded(model);
  const auto ids = tok.encode(bench_text(), false);
  for (auto _ : state) {
    const std::string text = tok.decode(ids);
    benchmark::DoNotOptimize(text.data());
  }
  report(state, bench_text().size(), ids.size());
}

void bm_stream_decode(benchmark::State& state, const std::string& model) {
  const duet::tokenizer& tok = loaded(model);
  const auto ids = tok.encode(bench_text(), false);
  for (auto _ : state) {
    duet::stream_decoder stream(tok);
    std::size_t out = 0;
    for (const int32_t id : ids) out += stream.push(id).size();
    out += stream.flush().size();
    benchmark::DoNotOptimize(out);
  }
  report(state, bench_text().size(), ids.size());
}

void bm_load(benchmark::State& state, const std::string& model) {
  for (auto _ : state) {
    duet::tokenizer tok{duet::load_tokenizer_json(tokenizer_dir(model))};
    benchmark::DoNotOptimize(tok.vocab_size());
  }
}

}  // namespace

BENCHMARK_CAPTURE(bm_encode_whole, llama3_1, std::string("llama3_1"))
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode_whole, qwen3, std::string("qwen3"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode_chunks, llama3_1, std::string("llama3_1"))
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode_chunks, qwen3, std::string("qwen3"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_encode_cold, llama3_1, std::string("llama3_1"))
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(bm_encode_cold, qwen3, std::string("qwen3"))
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(bm_decode, llama3_1, std::string("llama3_1"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_stream_decode, llama3_1, std::string("llama3_1"))
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(bm_load, llama3_1, std::string("llama3_1"))
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK_CAPTURE(bm_load, qwen3, std::string("qwen3"))
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

BENCHMARK_MAIN();
