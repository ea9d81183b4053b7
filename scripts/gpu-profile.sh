#!/usr/bin/env bash
# Where a CUDA engine step spends its time, on the GPU machine, in one command:
#   build -> a random checkpoint of the R1-Distill-Llama-8B shape with few layers (every layer is
#   the same work) -> the kernel rates (bench_cuda_engine --kernels-only, the kernels between the
#   GEMMs included) -> every kernel of one prefill pass and of decode steps timed by Nsight Compute
#   (gpu__time_duration, one replay each, caches flushed) beside the step's wall time without the
#   profiler -> the KV handover at 1K and 8K tokens (CUDA IPC repeated at once in the other
#   process, to tell the GPU's switch between the two processes from the copy).
# Run from the repository root with .devdeps/ carried (docs/cuda-engine.md, "Running it"):
#   GPU_PROFILE_STAGES=build,ckpt,kernels,steps,handover scripts/gpu-profile.sh
# Results in $OUT (at most the 8 files a device call brings back): profile.log, kernels.json,
# steps.md (the per-kernel tables), ncu-STEP.csv per step, kv_handover.json.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/profile.log") 2>&1
STAGES=${GPU_PROFILE_STAGES:-build,ckpt,kernels,steps,handover}
BUILD=${GPU_PROFILE_BUILD:-build-gpu}
LAYERS=${GPU_PROFILE_LAYERS:-2}
CKPT=${GPU_PROFILE_CKPT:-/tmp/duet-profile-${LAYERS}l}
PREFILL=${GPU_PROFILE_PREFILL:-8192}
DECODE=${GPU_PROFILE_DECODE:-1 64}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
source "$(dirname "$0")/gpu-env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true

if has build; then
  echo "=== build ($(date +%T))"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DDUET_BENCH=ON >"$BUILD.configure.log" 2>&1 || { tail -30 "$BUILD.configure.log"; exit 1; }
  cmake --build "$BUILD" -j16 --target duet bench_cuda_engine bench_kv_handover ${GPU_PROFILE_TARGETS:-} \
    >"$BUILD.build.log" 2>&1 || { grep -B2 -A12 -m5 "error" "$BUILD.build.log"; exit 1; }
fi
if has ckpt && [ ! -f "$CKPT/config.json" ]; then
  echo "=== checkpoint: the 8B shape with $LAYERS layers ($(date +%T))"
  "$BUILD/duet" model random --preset r1-distill-llama-8b --layers "$LAYERS" --out "$CKPT" >/dev/null || exit 1
fi
if has kernels; then
  echo "=== kernel rates ($(date +%T))"
  timeout 300 "$BUILD/bench/bench_cuda_engine" "$CKPT" "$OUT/kernels.json" --kernels-only
fi
if has steps; then
  echo "=== steps by kernel ($(date +%T))"
  profile() {  # profile NAME ARGS...: wall time alone, then every kernel under ncu
    local name=$1; shift
    "$BUILD/bench/bench_cuda_engine" "$CKPT" /dev/null "$@" | sed "s/^/$name alone: /"
    timeout 240 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      --page raw "$BUILD/bench/bench_cuda_engine" "$CKPT" /dev/null "$@" >"$OUT/ncu-$name.csv" 2>"/tmp/ncu-$name.err"
    local rc=$?
    echo "--- $name: ncu exit $rc"
    [ $rc -eq 0 ] || tail -5 "/tmp/ncu-$name.err"
  }
  profile prefill$PREFILL --profile-prefill "$PREFILL"
  for b in $DECODE; do profile decode$b --profile-decode "$b"; done
  python3 scripts/ncu_steps.py --layers "$LAYERS" "$OUT"/ncu-*.csv >"$OUT/steps.md"
  cat "$OUT/steps.md"
fi
if has handover; then
  echo "=== KV handover ($(date +%T))"
  timeout 300 "$BUILD/bench/bench_kv_handover" --tokens "${GPU_PROFILE_HANDOVER:-1024,8192}" --json "$OUT/kv_handover.json"
fi
echo "=== done ($(date +%T), ${SECONDS}s)"
