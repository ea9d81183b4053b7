#!/usr/bin/env bash
# Prefill steps as serving runs compose them, timed on the GPU machine at several SM shares
# (docs/sim.md, "Prefill steps by composition"): `duet bench engine --prefill-mix` on an
# R1-Distill-Llama-8B-shaped random checkpoint with 1,024-token passes (the serving runs'
# chunk), each share in a green context of its own process. Rows: one prompt of 128 to 1,024
# tokens; a 1,024-token chunk after 1K to 6K tokens of its prompt (code); 2 to 16 prompts in one
# step (conversation); and two mixed steps. Each row's chunk tokens are checked against a
# prefill of the whole prompt. Writes $OUT/prefill-mix-s{100,70,60,50}.json and prefill-mix.log.
# Needs .devdeps/ (scripts/gpu-env.sh). Device call: carry [".devdeps"], timeout_s 600; about
# 3 minutes with the build.
#   PREFILL_MIX_SHARES="1 0.7 0.6 0.5" PREFILL_MIX_REPEATS=10 scripts/gpu-prefill-mix.sh
# PREFILL_MIX_ROWS replaces the rows (scripts/compare-steps.py sample picks them from a run's step
# log) and PREFILL_MIX_CHUNK the chunk (1024; 2048 for colocated runs' steps).
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/prefill-mix.log") 2>&1
source scripts/gpu-env.sh
BUILD=${GPU_BUILD:-build-gpu}
CKPT=$PWD/$BUILD/r1-distill-llama-8b-random
SHARES=${PREFILL_MIX_SHARES:-1 0.7 0.6 0.5}
REPEATS=${PREFILL_MIX_REPEATS:-10}
CHUNK=${PREFILL_MIX_CHUNK:-1024}
MIXES=${PREFILL_MIX_ROWS:-1x1024,1x768,1x512,1x256,1x128,1x64,1x1024@1024,1x1024@2048,1x1024@3072,1x1024@6144,1x512@1024,1x512@3072,2x512,4x256,8x128,16x64,1x512@512+2x256,1x256@2048+3x256}

gpu_build_duet "$BUILD"
gpu_random_checkpoint "$BUILD" "$CKPT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv

for share in $SHARES; do
  pct=$(python3 -c "print(round($share * 100))")
  echo "=== SM share $share ($(date +%T))"
  "$BUILD/duet" bench engine --engine cuda --model "$CKPT" --chunk-tokens "$CHUNK" --sm-share "$share" \
    --prefill-mix "$MIXES" --repeats "$REPEATS" --json "$OUT/prefill-mix-s$pct.json"
done
echo "=== done ($(date +%T))"
