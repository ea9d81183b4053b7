#!/usr/bin/env bash
# `duet bench engine` with the CUDA engine on the GPU machine (docs/benchmarks.md, "Engine
# benchmark"): prefill throughput at 2K, 8K and 32K tokens and decode step time at context 1K
# (batch 1 to 256) and 8K (batch 1 to 64 on a card of 100 GB or more, as the H200; 1 to 32
# below that, as the H100; BENCH_ENGINE_BATCH_8K overrides), on an
# R1-Distill-Llama-8B-shaped random checkpoint. Every row's sequences are checked to agree first
# (an untimed greedy pass with logprobs). Writes $OUT/bench-engine-ctx1k.json, -ctx8k.json and
# bench-engine.log. Needs .devdeps/ (scripts/gpu-env.sh). Device call:
#   carry [".devdeps"], timeout_s 600; about 4 minutes with the build.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bench-engine.log") 2>&1
source scripts/gpu-env.sh
BUILD=${GPU_BUILD:-build-gpu}
CKPT=$PWD/$BUILD/r1-distill-llama-8b-random
STEPS=${BENCH_ENGINE_STEPS:-64}
# 64 x 8K of KV (69 GB) fits beside the weights on an H200 (141 GB), not on an H100 (80 GB).
CARD_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ "${CARD_MIB:-0}" -ge 100000 ]; then DEFAULT_8K=1,8,64; else DEFAULT_8K=1,8,32; fi
BATCH_8K=${BENCH_ENGINE_BATCH_8K:-$DEFAULT_8K}

gpu_build_duet "$BUILD"
gpu_random_checkpoint "$BUILD" "$CKPT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv

echo "=== context 1K ($(date +%T))"
"$BUILD/duet" bench engine --engine cuda --model "$CKPT" --prefill 2048,8192,32768 \
  --batch 1,8,64,128,256 --context 1024 --steps "$STEPS" --json "$OUT/bench-engine-ctx1k.json"
echo "=== context 8K ($(date +%T))"
"$BUILD/duet" bench engine --engine cuda --model "$CKPT" --prefill 2048 \
  --batch "$BATCH_8K" --context 8192 --steps "$STEPS" --json "$OUT/bench-engine-ctx8k.json"
echo "=== done ($(date +%T))"
