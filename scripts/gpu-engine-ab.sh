#!/usr/bin/env bash
# Engine settings side by side on the GPU machine, in one device call, for the prefill or the
# decode phase (GPU_AB_PHASE=prefill, the default, or decode):
#   build -> the phase's kernel tests (prefill: every attention variant against the fp64
#   reference; decode: the GEMMs, every cuBLASLt candidate included, and sampling; outputs poisoned) ->
#   prefill: one-layer kernel rates of every attention variant (bench_cuda_engine --kernels-only)
#   -> the engine tests and the engine's rows of the phase (--prefill-only / --decode-only) under
#   each configuration in turn, alternating for GPU_AB_ROUNDS rounds -> memcheck and racecheck on
#   the phase's kernel tests -> a summary table.
# Configurations: GPU_AB_CONFIGS="LABEL:VAR=VALUE VAR=VALUE;LABEL:..." (environment settings of
# the engine), or GPU_AB_VARIANTS=5,7 for attention variants (labels v5, v7). Run from the
# repository root (docs/cuda-engine.md gives the device calls):
#   GPU_AB_VARIANTS=5,7 bash scripts/gpu-engine-ab.sh
#   GPU_AB_PHASE=decode GPU_AB_CONFIGS="hot:DUET_GEMM_TUNE=hot;cold:DUET_GEMM_TUNE=1" bash scripts/gpu-engine-ab.sh
# GPU_AB_DEADLINE (seconds, default 560): stages that would not fit are skipped, and said so.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUILD=${GPU_CHECK_BUILD:-build-gpu}
CKPT=$BUILD/r1-distill-llama-8b-random
CONFIGS=${GPU_AB_CONFIGS:-}
GPU_AB_VARIANTS=${GPU_AB_VARIANTS:-5,7}
if [ -z "$CONFIGS" ]; then
  for v in ${GPU_AB_VARIANTS//,/ }; do CONFIGS+="${CONFIGS:+;}v$v:DUET_CUDA_ATTN_VARIANT=$v"; done
fi
ROUNDS=${GPU_AB_ROUNDS:-2}
PHASE=${GPU_AB_PHASE:-prefill}
case "$PHASE" in
  prefill) TESTS='prefill_attention*' ;;
  decode) TESTS='*gemm*,*sample_tokens*' ;;
  *) echo "GPU_AB_PHASE must be prefill or decode, not $PHASE" >&2; exit 2 ;;
esac
DEADLINE=${GPU_AB_DEADLINE:-560}

GPU_CHECK_STAGES=build GPU_CHECK_BUILD=$BUILD bash scripts/gpu-check.sh || exit 1
exec > >(tee -a "$OUT/$PHASE-ab.log") 2>&1
source "$(dirname "$0")/gpu-env.sh"

failed=()
stage_run() {  # stage_run NAME TIMEOUT CMD...: run (gpu-env.sh) unless the deadline is too near
  if [ $((SECONDS + $2 / 3)) -gt "$DEADLINE" ]; then
    echo "=== $1 skipped: ${SECONDS}s used of ${DEADLINE}s"
    failed+=("$1(skipped)")
    return 1
  fi
  echo "=== $1 ($(date +%T))"
  run "$@"
}

writer=""
if [ ! -f "$CKPT/config.json" ]; then
  ( "$BUILD/tests/cuda_e2e" write "$CKPT" >"$BUILD/ckpt.log" 2>&1 ) &
  writer=$!
fi
stage_run kernel-tests 150 "$BUILD/tests/test_cuda_kernels" -tc="$TESTS"
if [ -n "$writer" ]; then wait "$writer"; fi
if [ "$PHASE" = prefill ]; then
  stage_run kernel-rates 200 "$BUILD/bench/bench_cuda_engine" "$CKPT" "$OUT/kernels.json" --kernels-only
fi
IFS=';' read -ra configs <<<"$CONFIGS"
for c in "${configs[@]}"; do
  read -ra settings <<<"${c#*:}"
  stage_run "engine-tests-${c%%:*}" 120 env "${settings[@]}" "$BUILD/tests/test_cuda_engine"
done
for r in $(seq "$ROUNDS"); do
  for c in "${configs[@]}"; do
    read -ra settings <<<"${c#*:}"
    # DUET_GEMM_LOG=1: each GEMM shape's tuned choice goes to the log.
    stage_run "$PHASE-${c%%:*}-round$r" 150 env "${settings[@]}" DUET_GEMM_LOG=1 \
      "$BUILD/bench/bench_cuda_engine" "$CKPT" "$OUT/$PHASE-${c%%:*}-round$r.json" --$PHASE-only
  done
done
export DUET_CUDA_TEST_SMALL=1
stage_run memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
  "$BUILD/tests/test_cuda_kernels" -tc="$TESTS"
# Not the tests that run cuBLASLt alone: racecheck flags its own nvjet kernels (scripts/gpu-check.sh
# says more).
stage_run racecheck 150 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
  --print-limit 20 "$BUILD/tests/test_cuda_kernels" -tc="$TESTS" \
  -tce='*every cuBLASLt algorithm*,*gemm with accumulate*,*rows between plan buckets*'

python3 - "$OUT" "$PHASE" <<'PY' | tee "$OUT/summary.md"
import glob, json, os, re, sys
out, phase = sys.argv[1], sys.argv[2]
if phase == "decode":
    rows, rates = {}, {}
    for f in sorted(glob.glob(os.path.join(out, "decode-*-round*.json"))):
        v, r = re.search(r"decode-(.+)-round(\d+)\.json", f).groups()
        report = json.load(open(f))
        for d in report.get("decode", []):
            rows.setdefault((d["batch"], d["context"]), {}).setdefault(v, []).append(d["ms"])
        for key, value in report.get("kernels", {}).items():
            if re.match(r"gemm_M\d+_\w+_cublaslt_TBps", key):
                rates.setdefault(key, {}).setdefault(v, []).append(value)
    configs = sorted({v for by in rows.values() for v in by})
    print("| decode batch, context | " + " | ".join(f"{v} ms (rounds)" for v in configs) + " |")
    print("| --- |" + " --- |" * len(configs))
    for (batch, ctx) in sorted(rows):
        print(f"| {batch}, {ctx} | " + " | ".join(", ".join(f"{x:.3f}" for x in rows[(batch, ctx)].get(v, [])) for v in configs) + " |")
    print()
    print("| cuBLASLt TB/s over the weight | " + " | ".join(configs) + " |")
    print("| --- |" + " --- |" * len(configs))
    for key in sorted(rates, key=lambda k: (int(re.search(r"M(\d+)", k).group(1)), k)):
        print(f"| {key[5:-14]} | " + " | ".join(", ".join(f"{x:.2f}" for x in rates[key].get(v, [])) for v in configs) + " |")
    sys.exit(0)
kernels = json.load(open(os.path.join(out, "kernels.json"))).get("kernels", {}) if os.path.exists(os.path.join(out, "kernels.json")) else {}
print("| kernel, one layer | " + " | ".join(f"v{v}" for v in range(7)) + " |")
print("| --- |" + " --- |" * 7)
for shape in ("8K", "32K_last_chunk"):
    cells = [kernels.get(f"prefill_attention_{shape}_TFLOPs_v{v}") for v in range(7)]
    print(f"| {shape} TFLOP/s | " + " | ".join(f"{c:.0f}" if c else "-" for c in cells) + " |")
rows = {}
for f in sorted(glob.glob(os.path.join(out, "prefill-*-round*.json"))):
    v, r = re.search(r"prefill-(.+)-round(\d+)\.json", f).groups()
    for p in json.load(open(f)).get("prefill", []):
        rows.setdefault(p["tokens"], {}).setdefault(v, []).append(p["tok_s"])
variants = sorted({v for by in rows.values() for v in by})
print()
print("| prefill tokens | " + " | ".join(f"{v} tok/s (rounds)" for v in variants) + " |")
print("| --- |" + " --- |" * len(variants))
for tokens in sorted(rows):
    print(f"| {tokens} | " + " | ".join(", ".join(f"{x:.0f}" for x in rows[tokens].get(v, [])) for v in variants) + " |")
PY
echo
if [ ${#failed[@]} -eq 0 ]; then echo "${PHASE^^} A/B: all stages passed"; else echo "${PHASE^^} A/B: FAILED: ${failed[*]}"; fi
[ ${#failed[@]} -eq 0 ]
