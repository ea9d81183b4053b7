#!/usr/bin/env bash
# Batch-1 decode speed of duet's CPU engine on SmolLM2-135M-Instruct (Q4_1 GGUF) against
# llama.cpp (llama-cpp-python) on the same file, same machine, same thread count, in one run.
#
#   bench/smollm2_vs_llamacpp.sh [BUILD_DIR] [THREADS]     # defaults: build-cpu, all cores
#
# Needs: scripts/fetch-model.sh done; bench_cpu_engine built in BUILD_DIR; a Python with
# llama-cpp-python ($PYTHON, default .venv-fixtures/bin/python: tests/requirements-fixtures.txt).
# duet: bench_cpu_engine's decode step at 128 tokens of context (native = Q4_1 blocks as ggml
# multiplies them, f32 = dequantized). llama.cpp: the mean time of 128 single-token evals after
# a 128-token prompt (contexts 128..255), n_threads = n_threads_batch = THREADS.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build-cpu}"
threads="${2:-$(nproc)}"
python="${PYTHON:-$root/.venv-fixtures/bin/python}"
model="${DUET_MODELS_DIR:-$root/models}/smollm2-135m-instruct-q4_1.gguf"
[ -f "$model" ] || { echo "smollm2 bench: $model is missing: run scripts/fetch-model.sh" >&2; exit 1; }
[ -x "$build/bench/bench_cpu_engine" ] || { echo "smollm2 bench: build bench_cpu_engine in $build first" >&2; exit 1; }

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "threads: $threads"
echo "--- duet cpu engine (bench_cpu_engine)"
DUET_BENCH_THREADS="$threads" "$build/bench/bench_cpu_engine" --benchmark_filter='decode/gguf_.*/1/' \
  --benchmark_min_time=3 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
  --benchmark_counters_tabular=true 2>/dev/null | grep -E 'Benchmark|median'
echo "--- llama.cpp (llama-cpp-python)"
"$python" - "$model" "$threads" <<'PY'
import sys, time, statistics
import llama_cpp
from llama_cpp import Llama
model, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=model, n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads,
            logits_all=False, verbose=False)
prompt = [(i * 7919) % 40000 + 100 for i in range(128)]
runs = []
for _ in range(3):
    llm.reset()
    llm.eval(prompt)
    tok = 504
    start = time.perf_counter()
    for _ in range(128):
        llm.eval([tok])
    runs.append((time.perf_counter() - start) / 128)
med = statistics.median(runs)
print(f"llama.cpp {llama_cpp.__version__}: decode batch 1: {med * 1e3:.2f} ms/token, {1 / med:.1f} tokens/s "
      f"(median of 3 runs of 128 tokens; {', '.join(f'{1 / r:.1f}' for r in runs)})")
PY
