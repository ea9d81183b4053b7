#!/usr/bin/env bash
# Decode and prefill speed of duet's CPU engine on SmolLM2-135M-Instruct (Q4_1 GGUF) against
# llama.cpp (llama-cpp-python) on the same file, same machine, same thread count, in one run.
#
#   bench/smollm2_vs_llamacpp.sh [BUILD_DIR] [THREADS]     # defaults: build-cpu, all cores
#
# Needs: scripts/fetch-model.sh done; bench_cpu_engine built in BUILD_DIR; a Python with
# llama-cpp-python ($PYTHON, default .venv-fixtures/bin/python: tests/requirements-fixtures.txt).
# duet: bench_cpu_engine's decode step at 128 tokens of context, batch 1 and 8, and a 128-token
# prefill on the native path (Q4_1 blocks as ggml multiplies them), batch-1 decode on the f32 path
# (dequantized), wall and CPU time.
# llama.cpp: the 128-token prompt's eval (prefill), then the mean time of 128 single-token evals
# (batch-1 decode, contexts 128..255), n_threads = n_threads_batch = THREADS, wall and process
# CPU time (llama-cpp-python decodes one sequence: no batch-8 figure).
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
DUET_BENCH_THREADS="$threads" "$build/bench/bench_cpu_engine" --benchmark_filter='gguf_native|decode/gguf_f32/1/' \
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
runs, cpu_runs, prefills, cpu_prefills = [], [], [], []
for _ in range(3):
    llm.reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    llm.eval(prompt)
    prefills.append(time.perf_counter() - start)
    cpu_prefills.append(time.process_time() - cpu_start)
    tok = 504
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(128):
        llm.eval([tok])
    runs.append((time.perf_counter() - start) / 128)
    cpu_runs.append((time.process_time() - cpu_start) / 128)
med, cpu = statistics.median(runs), statistics.median(cpu_runs)
pre, cpu_pre = statistics.median(prefills), statistics.median(cpu_prefills)
print(f"llama.cpp {llama_cpp.__version__}: decode batch 1: {med * 1e3:.2f} ms/token ({cpu * 1e3:.2f} ms CPU), "
      f"{1 / med:.1f} tokens/s (median of 3 runs of 128 tokens; {', '.join(f'{1 / r:.1f}' for r in runs)})")
print(f"llama.cpp {llama_cpp.__version__}: prefill 128 tokens: {pre * 1e3:.1f} ms ({cpu_pre * 1e3:.1f} ms CPU), "
      f"{128 / pre:.1f} tokens/s (median of 3)")
PY
