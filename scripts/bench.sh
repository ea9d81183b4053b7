#!/usr/bin/env bash
# Builds the Release benchmarks into build-bench/ and runs them, one JSON file per benchmark
# binary in bench-results/ (docs/benchmarks.md explains every figure).
#
#   scripts/bench.sh                          the transport and control-plane benchmarks
#   scripts/bench.sh bench_transport          only these targets
#   DUET_BENCH_REPETITIONS=9 scripts/bench.sh more repetitions (default 5; medians are reported)
#   DUET_BENCH_ARGS='--benchmark_filter=BM_fan_in' scripts/bench.sh   extra Google Benchmark flags
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${DUET_JOBS:-$(nproc)}
repetitions=${DUET_BENCH_REPETITIONS:-5}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=(bench_transport bench_control_plane); fi

cmake -S . -B build-bench -G Ninja -DDUET_CUDA=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-bench --target "${targets[@]}" -j "$jobs"

mkdir -p bench-results
stamp=$(date -u +%Y%m%dT%H%M%SZ)
for target in "${targets[@]}"; do
  out="bench-results/${target}-${stamp}.json"
  echo "== ${target} -> ${out}"
  # shellcheck disable=SC2086  # DUET_BENCH_ARGS is a list of flags
  "build-bench/bench/${target}" --benchmark_repetitions="${repetitions}" \
    --benchmark_display_aggregates_only=true --benchmark_out="${out}" --benchmark_out_format=json \
    ${DUET_BENCH_ARGS:-}
done
