#!/usr/bin/env bash
# The simulator's calibration for duet's CUDA engine, on the GPU machine (docs/sim.md,
# "Calibration files"): bench_cuda_engine --prefill-only (the GEMM rates and one-sequence
# prefill of 256 to 32K tokens on R1-Distill-Llama-8B-shaped random weights), merged with the
# full benchmark's decode rows (docs/data/bench_cuda_engine_h200.json) by
# bench/calibrate_from_bench.py. Needs .devdeps/ as scripts/gpu-handover.sh. Writes
# $OUT/bench-prefill.json and $OUT/h200-cuda-engine.toml.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUILD=${GPU_BUILD:-build-gpu}
CKPT=$PWD/$BUILD/r1-distill-llama-8b-random
source "$(dirname "$0")/gpu-env.sh"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DDUET_BENCH=ON >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build "$BUILD" -j"$(nproc)" --target duet bench_cuda_engine >"$OUT/build.log" 2>&1 ||
  { grep -B2 -A8 -E 'error|FAILED' "$OUT/build.log" | head -60; exit 1; }
echo "built in ${SECONDS}s"
[ -f "$CKPT/config.json" ] || "$BUILD/duet" model random --preset r1-distill-llama-8b --out "$CKPT" >/dev/null || exit 1
echo "checkpoint at ${SECONDS}s"
timeout 300 "$BUILD/bench/bench_cuda_engine" "$CKPT" "$OUT/bench-prefill.json" --prefill-only || exit 1
python3 bench/calibrate_from_bench.py docs/data/bench_cuda_engine_h200.json "$OUT/bench-prefill.json" \
  --serving config/calibration-duet/h200-cuda-engine.toml --exclude-decode 4x1024 >"$OUT/h200-cuda-engine.toml"
cat "$OUT/h200-cuda-engine.toml"
echo "done in ${SECONDS}s"
