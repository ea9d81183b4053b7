#!/usr/bin/env bash
# The serving benchmark on the GPU machine (docs/benchmarks.md, "Serving on the H200"):
# real Azure traces replayed open-loop by `duet bench serve` over HTTP against `duet up` with
# CUDA engines on R1-Distill-Llama-8B-shaped random weights, with the simulator's prediction
# (calibrated to the CUDA engine) of the same deployment on the same trace in each report.
#   GPU_SERVE_STAGES=build,ckpt,smoke scripts/gpu-serve.sh      first call: build, checkpoint, smoke runs
#   GPU_SERVE_STAGES=one scripts/gpu-serve.sh                   one-GPU deployments, both traces
#   GPU_SERVE_STAGES=handover,two scripts/gpu-serve.sh          two GPUs: KV between GPUs, 1P1D
# Stages:
#   build     duet and bench_kv_handover (Release, sm_90)
#   ckpt      the random 8B checkpoint (16 GB, written once into $BUILD)
#   smoke     20 s of the conversation trace on the colocated and an SM-split deployment
#   one       per trace: colocated (prefill and decode engines on one shared stream), PD on
#             separate streams (decode at high priority), PD with the SMs split by green contexts
#             at 50/50 and 70/30; two deployments at a time, one per GPU when two are visible
#   handover  bench_kv_handover --gpus 0,1: KV bytes between the two GPUs (IPC, NCCL, peer floor)
#   high      heavier load: conversation x5 (colocated, PD streams, PD 50/50), code x1
#             (colocated, PD streams, PD 70/30), two at a time
#   long      conversation x3 for three minutes: colocated, PD streams, PD 50/50
#   two       1P1D: prefill process on GPU 0, decode process on GPU 1 (KV over CUDA IPC), both
#             traces at twice the one-GPU rate (the load two colocated GPUs would share)
# Needs .devdeps/ (as scripts/gpu-handover.sh) and the traces in $DUET_TRACES (default .devdata:
# copy ../shared/traces/AzureLLMInferenceTrace_{code,conv}_2023.csv there; they are not committed).
# Results in $OUT/serve/NAME/ (summary.json, requests.csv, report.html) and $OUT/serve.md.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/serve"
exec > >(tee -a "$OUT/serve.log") 2>&1
STAGES=${GPU_SERVE_STAGES:-build,ckpt,smoke}
BUILD=${GPU_BUILD:-build-gpu}
CKPT=$PWD/$BUILD/r1-distill-llama-8b-random
TRACES=${DUET_TRACES:-$PWD/.devdata}
CAL=$PWD/config/calibration-duet/h200-cuda-engine.toml
SLO=ttft=2s,tpot=50ms
# Trace windows (seconds of the trace) and rate scales: near the one-GPU engine's saturation
# as the calibrated simulator predicts it (docs/benchmarks.md gives the reasoning).
CONV="AzureLLMInferenceTrace_conv_2023.csv 0 180 3"
CODE="AzureLLMInferenceTrace_code_2023.csv 180 60 0.7"
# Heavier load (stage high): where goodput separates, and an out-of-sample check of the calibration.
CONV_HIGH="AzureLLMInferenceTrace_conv_2023.csv 0 300 5"
# Stage long: three minutes of replay (conversation 0-540 s at x3).
CONV_LONG="AzureLLMInferenceTrace_conv_2023.csv 0 540 3"
CODE_HIGH="AzureLLMInferenceTrace_code_2023.csv 180 60 1"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
source "$(dirname "$0")/gpu-env.sh"
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader || true
echo "stages $STAGES; $GPUS GPU(s); $(nproc) cores"

if has build; then
  echo "=== build ($(date +%T))"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DDUET_BENCH=ON >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build "$BUILD" -j"$(nproc)" --target duet bench_kv_handover >"$OUT/build.log" 2>&1 ||
    { grep -B2 -A8 -E 'error|FAILED' "$OUT/build.log" | head -80; exit 1; }
  echo "--- built in ${SECONDS}s"
fi
if has ckpt && [ ! -f "$CKPT/config.json" ]; then
  echo "=== checkpoint ($(date +%T))"
  t0=$SECONDS
  "$BUILD/duet" model random --preset r1-distill-llama-8b --out "$CKPT" >/dev/null || exit 1
  echo "--- 8B random checkpoint written in $((SECONDS - t0)) s: $(du -sh "$CKPT" | cut -f1)"
fi

deploy() {  # deploy FILE SLOT KIND: the deployment TOML of one run
  local file=$1 slot=$2 kind=$3 pre="" dec="" dnode="" ddev=0
  case $kind in
    colocated) pre='stream = "shared"'; dec='stream = "shared"' ;;
    streams) ;;
    green:*) local f=${kind#green:}
             pre="sm_share = $f"; dec="sm_share = $(python3 -c "print(round(1 - $f, 3))")" ;;
    1p1d) ddev=1; dnode=$(printf '\n[[nodes]]\nname = "d%s"\nendpoint = "ipc:///tmp/duet-serve-d%s.sock"\n' "$slot" "$slot") ;;
    *) echo "unknown deployment $kind"; return 1 ;;
  esac
  cat > "$file" <<EOF
[model]
name = "r1-8b-random"
path = "$CKPT"
max_context = 16384
block_tokens = 16

[engine]
kind = "cuda"
gpu = "h200"

[router]
queue_limit = 8192
request_timeout_ms = 600000

[broker]
lease_ms = 60000
transfer_timeout_ms = 30000

[[nodes]]
name = "n$slot"
endpoint = "ipc:///tmp/duet-serve-$slot.sock"
http = "127.0.0.1:$((18080 + slot))"

[[nodes.actors]]
name = "router"
role = "router"

[[nodes.actors]]
name = "broker"
role = "broker"

[[nodes.actors]]
name = "prefill0"
role = "prefill"
device = 0
kv_blocks = 8192
max_batch = 16
chunk_tokens = 2048
$pre
$dnode
[[nodes.actors]]
name = "decode0"
role = "decode"
device = $ddev
kv_blocks = 32768
max_batch = 128
$dec
EOF
}

serve() {  # serve NAME SLOT KIND VISIBLE_GPUS TRACE START DURATION RATE
  local name=$1 slot=$2 kind=$3 visible=$4 trace=$5 start=$6 dur=$7 rate=$8
  local cfg=$OUT/serve/$name.toml
  deploy "$cfg" "$slot" "$kind" || return 1
  CUDA_VISIBLE_DEVICES=$visible "$BUILD/duet" up --config "$cfg" >"$OUT/serve/$name.up.log" 2>&1 &
  local up=$!
  local span limit
  span=$(python3 -c "print(int($dur / $rate))")
  limit=$((span + 150))
  timeout $((limit + 300)) "$BUILD/duet" bench serve --url "http://127.0.0.1:$((18080 + slot))" \
    --trace "$TRACES/$trace" --start "$start" --duration "$dur" --rate-scale "$rate" --slo "$SLO" \
    --wait 240 --time-limit "$limit" --name "$name" --config "$cfg" --sim-deployment config \
    --calibration "$CAL" --title "$name: $trace from ${start}s, ${dur}s at rate x$rate" \
    --out "$OUT/serve/$name" >"$OUT/serve/$name.bench.log" 2>&1
  echo "--- $name: bench exit $? ($(date +%T))"
  kill -TERM "$up" 2>/dev/null
  for _ in $(seq 100); do kill -0 "$up" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$up" 2>/dev/null; pkill -KILL -f "duet-serve-d$slot" 2>/dev/null
  wait "$up" 2>/dev/null
  grep -iE 'sm|green|stream|error|fail' "$OUT/serve/$name.up.log" | head -8
  sed -n '/completed/,/E2E P99/p' "$OUT/serve/$name.bench.log"
}

if has smoke; then
  echo "=== smoke ($(date +%T))"
  serve smoke-colocated 0 colocated 0 AzureLLMInferenceTrace_conv_2023.csv 0 20 1 &
  s0=$!
  if [ "$GPUS" -ge 2 ]; then
    serve smoke-green50 1 green:0.5 1 AzureLLMInferenceTrace_conv_2023.csv 0 20 1
  else
    wait $s0; serve smoke-green50 1 green:0.5 0 AzureLLMInferenceTrace_conv_2023.csv 0 20 1
  fi
  wait $s0
fi

if has one; then
  for w in "conv $CONV" "code $CODE"; do
    set -- $w
    tag=$1; shift
    echo "=== one GPU, $tag trace ($(date +%T))"
    g1=0; [ "$GPUS" -ge 2 ] && g1=1
    serve "$tag-colocated" 0 colocated 0 "$@" &
    a=$!
    [ "$g1" = 0 ] && wait $a
    serve "$tag-pd-streams" 1 streams "$g1" "$@"
    wait $a
    serve "$tag-pd-green50" 0 green:0.5 0 "$@" &
    a=$!
    [ "$g1" = 0 ] && wait $a
    serve "$tag-pd-green70" 1 green:0.7 "$g1" "$@"
    wait $a
  done
fi

if has high; then
  echo "=== one GPU, heavier load ($(date +%T))"
  g1=0; [ "$GPUS" -ge 2 ] && g1=1
  rounds=("conv5-colocated colocated $CONV_HIGH|conv5-pd-green50 green:0.5 $CONV_HIGH"
          "conv5-pd-streams streams $CONV_HIGH|code1-pd-green70 green:0.7 $CODE_HIGH"
          "code1-colocated colocated $CODE_HIGH|code1-pd-streams streams $CODE_HIGH")
  for r in "${rounds[@]}"; do
    IFS='|' read -r first second <<<"$r"
    set -- $first
    serve "$1" 0 "$2" 0 "${@:3}" &
    a=$!
    [ "$g1" = 0 ] && wait $a
    set -- $second
    serve "$1" 1 "$2" "$g1" "${@:3}"
    wait $a
  done
fi

if has long; then
  echo "=== one GPU, three minutes ($(date +%T))"
  g1=0; [ "$GPUS" -ge 2 ] && g1=1
  serve conv3long-colocated 0 colocated 0 $CONV_LONG &
  a=$!
  [ "$g1" = 0 ] && wait $a
  serve conv3long-pd-streams 1 streams "$g1" $CONV_LONG
  wait $a
  serve conv3long-pd-green50 0 green:0.5 0 $CONV_LONG
fi

if has handover; then
  echo "=== KV between GPUs ($(date +%T))"
  if [ "$GPUS" -ge 2 ]; then
    timeout 400 "$BUILD/bench/bench_kv_handover" --gpus 0,1 --json "$OUT/kv_handover_x2.json"
    echo "--- bench_kv_handover exit $?"
  else
    echo "one GPU: skipped"
  fi
fi

if has two; then
  if [ "$GPUS" -ge 2 ]; then
    set -- $CONV
    echo "=== 1P1D across two GPUs ($(date +%T))"
    serve conv-1p1d 2 1p1d 0,1 "$1" "$2" "$3" "$(python3 -c "print($4 * 2)")"
    set -- $CODE
    serve code-1p1d 2 1p1d 0,1 "$1" "$2" "$3" "$(python3 -c "print($4 * 2)")"
  else
    echo "one GPU: 1P1D skipped"
  fi
fi

# One table of every run so far: live figures and the simulator's beside them.
python3 - "$OUT/serve" >"$OUT/serve.md" <<'EOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
print("| run | req | done | TTFT P50 / P99 ms | ITL P50 / P99 ms | P99/P50 ITL | TPOT P99 ms | goodput req/s | sim TTFT P50 / P99 | sim ITL P50 / P99 | sim goodput |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for d in sorted(p for p in root.iterdir() if (p / "summary.json").exists()):
    runs = json.loads((d / "summary.json").read_text())["runs"]
    def s(r, k, q): return r["summary"][k][q] * 1e3
    live = runs[0]; sim = runs[1] if len(runs) > 1 else None
    L = live["summary"]
    ratio = s(live, "itl_s", "p99") / max(s(live, "itl_s", "p50"), 1e-9)
    row = [d.name, L["requests"], L["completed"],
           f'{s(live,"ttft_s","p50"):.0f} / {s(live,"ttft_s","p99"):.0f}',
           f'{s(live,"itl_s","p50"):.1f} / {s(live,"itl_s","p99"):.1f}', f"{ratio:.1f}",
           f'{s(live,"tpot_s","p99"):.1f}', f'{L["goodput_rps"]:.2f}']
    if sim:
        row += [f'{s(sim,"ttft_s","p50"):.0f} / {s(sim,"ttft_s","p99"):.0f}',
                f'{s(sim,"itl_s","p50"):.1f} / {s(sim,"itl_s","p99"):.1f}', f'{sim["summary"]["goodput_rps"]:.2f}']
    print("| " + " | ".join(str(x) for x in row) + " |")
EOF
cat "$OUT/serve.md"
echo "=== done in ${SECONDS}s ($(date +%T))"
