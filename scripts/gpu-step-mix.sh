#!/usr/bin/env bash
# Live prefill steps against the same steps alone, on the GPU machine (docs/benchmarks.md,
# "Live prefill steps against the same steps alone"): serving runs of scripts/gpu-serve.sh's
# matrix stage with every engine step logged (GPU_SERVE_STEP_LOG=1), then for each run
# GPU_STEP_MIX_COUNT (30) of its prefill steps' mixes, spread over their sizes, timed alone by
# `duet bench engine --prefill-mix` on the same engine build. scripts/compare-steps.py report
# then splits each step's live time into its cost alone and what the decode engine beside it
# added. Writes $OUT/steps.tar.gz (step logs, run summaries, mixes and their timings).
#   GPU_SERVE_MATRIX="NAME KIND TRACE START DURATION RATE;..." bash scripts/gpu-step-mix.sh
# Device call: carry [".devdeps", ".devdata"], timeout_s 600.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUILD=${GPU_BUILD:-build-gpu}
CKPT=$PWD/$BUILD/r1-distill-llama-8b-random
V=AzureLLMInferenceTrace_conv_2023.csv
export GPU_SERVE_MATRIX=${GPU_SERVE_MATRIX:-"conv3-pd-streams-b256-c1024-fd-42s streams+b256+c1024+fd $V 0 126 3;conv3-colocated-b256-42s colocated+b256 $V 0 126 3"}
GPU_SERVE_STEP_LOG=1 GPU_SERVE_STAGES=build,ckpt,matrix GPU_SERVE_DEADLINE=${GPU_SERVE_DEADLINE:-400} \
  bash scripts/gpu-serve.sh
source scripts/gpu-env.sh  # the Debian libraries duet links (gpu-serve.sh sets them for its own runs only)
RUNS=$OUT/serve
mkdir -p "$OUT/mixes"
IFS=';' read -ra runs <<<"$GPU_SERVE_MATRIX"
for run in "${runs[@]}"; do
  name=${run%% *}
  [ -f "$RUNS/$name.replay-start-ms" ] || { echo "--- $name: no replay"; continue; }
  mixes=$(python3 scripts/compare-steps.py sample "$RUNS/$name".steps.*prefill*.csv \
    --after "$(cat "$RUNS/$name.replay-start-ms")" --count "${GPU_STEP_MIX_COUNT:-30}") || continue
  echo "=== $name: $(tr ',' '\n' <<<"$mixes" | wc -l) mixes alone ($(date +%T))"
  timeout 150 "$BUILD/duet" bench engine --engine cuda --model "$CKPT" --prefill-mix "$mixes" \
    --json "$OUT/mixes/$name-alone.json" >"$OUT/mixes/$name-alone.log" 2>&1
  echo "--- exit $?"; tail -3 "$OUT/mixes/$name-alone.log"
done
tar -czf "$OUT/steps.tar.gz" --exclude='report.html' --exclude='requests.csv' -C "$OUT" mixes -C "$RUNS" .
ls -la "$OUT"
