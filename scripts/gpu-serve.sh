#!/usr/bin/env bash
# The serving benchmark on the GPU machine (docs/benchmarks.md, "Serving on the H200"):
# real Azure traces replayed open-loop by `duet bench serve` over HTTP against `duet up` with
# CUDA engines on R1-Distill-Llama-8B-shaped random weights, with the simulator's prediction
# (calibrated to the CUDA engine) of the same deployment on the same trace in each report.
#   GPU_SERVE_STAGES=build,ckpt,smoke scripts/gpu-serve.sh      first call: build, checkpoint, smoke runs
#   GPU_SERVE_STAGES=one scripts/gpu-serve.sh                   one-GPU deployments, both traces
#   GPU_SERVE_STAGES=handover,two scripts/gpu-serve.sh          two GPUs: KV between GPUs, 1P1D
#   GPU_SERVE_STAGES=build,ckpt,fidelity scripts/gpu-serve.sh   one call, one GPU, ~6 minutes
#   (GPU_SERVE_FID_ONLY=colocated: the colocated replay alone)
# Stages:
#   build     duet, and bench_kv_handover with stage handover (Release, sm_90)
#   ckpt      the random 8B checkpoint (16 GB, written once into $BUILD)
#   smoke     20 s of the conversation trace on the colocated and an SM-split deployment
#   one       per trace: colocated (prefill and decode engines on one shared stream), PD on
#             separate streams (decode at high priority), PD with the SMs split by green contexts
#             at 50/50 and 70/30; two deployments at a time, one per GPU when two are visible
#             (other KINDs for the matrix: green:F for prefill F and decode 1-F, reserve:F for
#             prefill on F of the SMs and decode on the whole GPU, the rest its own)
#   handover  bench_kv_handover --gpus 0,1: KV bytes between the two GPUs (IPC, NCCL, peer floor)
#   high      heavier load: conversation x5 (colocated, PD streams, PD 50/50), code x1
#             (colocated, PD streams, PD 70/30), two at a time
#   long      conversation x3 for three minutes: colocated, PD streams, PD 50/50
#   today_high conversation x5 (CONV_HIGH) on colocated and PD streams with today's calibration
#             (h200-cuda-engine-2026-12-01.toml); $OUT/today-high.tar.gz (~4 minutes with build)
#   matrix    today's engine on both traces and every one-GPU deployment kind, one GPU, the
#             simulator beside with the newest calibration ($CAL_MATRIX): the runs of
#             $GPU_SERVE_MATRIX ("NAME KIND TRACE START DURATION RATE;..."; KIND as in stage one, with
#             +bN for a decode max_batch of N instead of 128, e.g. streams+b256, +cN for a prefill
#             chunk_tokens of N instead of 2048, e.g. streams+b256+c512, and +fd for the first token
#             from the decode worker (router.first_token = "decode"); default code x1 on PD
#             streams, colocated and PD 70/30, then conversation x5 on PD streams and colocated), each
#             warmed up first, in order while they fit by $GPU_SERVE_DEADLINE; $OUT/matrix.tar.gz
#             (summaries, requests, deployments, logs), rewritten after every run
#   two       1P1D: prefill process on GPU 0, decode process on GPU 1 (KV over CUDA IPC), both
#             traces at twice the one-GPU rate (the load two colocated GPUs would share)
#   fidelity  one GPU, sized to end by $GPU_SERVE_DEADLINE s (default 540) after the script's
#             start, build and ckpt included: conversation x3 (CONV's window, shortened only when
#             time is short) on PD streams, replayed by bench serve (today's calibration,
#             h200-cuda-engine-2026-12-01.toml, simulated beside) and then by locust
#             (bench/locustfile.py, from wheels in .devwheels: scripts/fetch-wheels.sh), a second
#             bench serve replay of it when time is left, then on colocated; every deployment is
#             warmed up by 8 short requests first. Writes $OUT/serve.md (live vs simulated,
#             locust vs bench serve), $OUT/fidelity.json and $OUT/fidelity.tar.gz (the run
#             folders and logs: $OUT brings back 8 files at most), rewritten after every run.
# Needs .devdeps/ (as scripts/gpu-handover.sh) and the traces in $DUET_TRACES (default .devdata:
# copy ../shared/traces/AzureLLMInferenceTrace_{code,conv}_2023.csv there; they are not committed);
# stage fidelity also .devwheels/ (scripts/fetch-wheels.sh). Device call for it:
#   carry [".devdeps", ".devdata", ".devwheels"], timeout_s 600
# Results in $OUT/serve/NAME/ (summary.json, requests.csv, report.html) and $OUT/serve.md
# (stage fidelity: packed, see above).
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
ENGINE=${GPU_SERVE_ENGINE:-cuda}  # sim: a dry run of the stages without a GPU (the sim engine at time_scale 1)
# The card the deployments name (engine.gpu: the simulator's spec), the KV pools of the prefill
# and decode workers (in blocks) and the matrix's calibration: the card's own, read from
# nvidia-smi. The H200's 8,192 + 32,768 blocks (86 GB) do not fit beside the weights on an H100's
# 80 GB. GPU_SERVE_GPU (h200 or h100), GPU_SERVE_KV_BLOCKS and GPU_SERVE_CAL override them.
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case ${GPU_SERVE_GPU:-${CARD^^}} in
  h100 | *H100*) GPU_NAME=h100 KV_DEFAULT="4096 22528" CAL_DEFAULT=h100-cuda-engine-2026-12-07i.toml ;;
  h200 | *H200* | "") GPU_NAME=h200 KV_DEFAULT="8192 32768" CAL_DEFAULT=h200-cuda-engine-2026-12-07c.toml ;;
  *) echo "no deployment defaults for the card '${GPU_SERVE_GPU:-$CARD}' (GPU_SERVE_GPU: h200 or h100)"; exit 3 ;;
esac
read -r PREFILL_BLOCKS DECODE_BLOCKS <<<"${GPU_SERVE_KV_BLOCKS:-$KV_DEFAULT}"
MAX_CONTEXT=16384  # model.max_context of every deployment: bench serve clips to it, so locust must too
RUNS=$OUT/serve    # run folders (stage fidelity: $FID_RUNS, packed into $OUT)
# Trace windows (seconds of the trace) and rate scales: near the one-GPU engine's saturation
# as the calibrated simulator predicts it (docs/benchmarks.md gives the reasoning).
CONV="AzureLLMInferenceTrace_conv_2023.csv 0 180 3"
CODE="AzureLLMInferenceTrace_code_2023.csv 180 60 0.7"
# Heavier load (stage high): where goodput separates, and an out-of-sample check of the calibration.
CONV_HIGH="AzureLLMInferenceTrace_conv_2023.csv 0 300 5"
# Stage long: three minutes of replay (conversation 0-540 s at x3).
CONV_LONG="AzureLLMInferenceTrace_conv_2023.csv 0 540 3"
CODE_HIGH="AzureLLMInferenceTrace_code_2023.csv 180 60 1"
# Stage fidelity: CONV's window on today's engine and calibration; all of it must end by DEADLINE.
CONV_FID=${GPU_SERVE_FID_WINDOW:-$CONV}  # "TRACE START DURATION RATE"
CAL_FID=$PWD/config/calibration-duet/h200-cuda-engine-2026-12-01.toml
DEADLINE=${GPU_SERVE_DEADLINE:-540}
# Stage matrix: the newest calibration and the runs, in order of priority.
CAL_MATRIX=${GPU_SERVE_CAL:-$PWD/config/calibration-duet/$CAL_DEFAULT}
MATRIX=${GPU_SERVE_MATRIX:-"code1-pd-streams streams $CODE_HIGH;code1-colocated colocated $CODE_HIGH;code1-pd-green70 green:0.7 $CODE_HIGH;conv5-pd-streams streams $CONV_HIGH;conv5-colocated colocated $CONV_HIGH"}
FID_RUNS=/tmp/duet-fidelity/fidelity
LOCUST_VENV=/tmp/duet-locust
has() { [[ ",$STAGES," == *",$1,"* ]]; }
source "$(dirname "$0")/gpu-env.sh"
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader || true
if [ "$ENGINE" = cuda ] && [[ ${CARD^^} != *"${GPU_NAME^^}"* ]]; then
  # The simulator beside each run would price another card's engine.
  echo "the card is '$CARD' and the deployments name $GPU_NAME: set GPU_SERVE_GPU to the card"
  exit 3
fi
echo "stages $STAGES; $GPUS GPU(s); $(nproc) cores"

locust_install() {  # a venv holding locust, offline from .devwheels (scripts/fetch-wheels.sh)
  local pin
  pin=$(grep -E '^locust==' tests/requirements.txt) || return 1
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
  if python3 -m venv "$LOCUST_VENV" &&
     timeout 120 "$LOCUST_VENV/bin/python" -m pip install -q --no-index --find-links .devwheels "$pin"; then
    :
  else  # no ensurepip in this Python: a venv without pip, and pip run from its wheel
    echo "venv with pip failed; bootstrapping pip from .devwheels"
    rm -rf "$LOCUST_VENV"
    local wheel=(.devwheels/pip-*.whl)
    python3 -m venv --without-pip "$LOCUST_VENV" &&
      timeout 120 "$LOCUST_VENV/bin/python" "${wheel[0]}/pip" install -q --no-index --find-links .devwheels "$pin" ||
      return 1
  fi
  "$LOCUST_VENV/bin/locust" --version
}
if has fidelity; then  # beside the build: pip needs no GPU and little CPU
  rm -rf "${FID_RUNS%/*}" "$LOCUST_VENV"
  mkdir -p "$FID_RUNS"
  locust_install >"$FID_RUNS/pip.log" 2>&1 &
  PIP_PID=$!
fi

if has build; then
  echo "=== build ($(date +%T))"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DDUET_BENCH=ON >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  targets=(duet)
  has handover && targets+=(bench_kv_handover)
  cmake --build "$BUILD" -j"$(nproc)" --target "${targets[@]}" >"$OUT/build.log" 2>&1 ||
    { grep -B2 -A8 -E 'error|FAILED' "$OUT/build.log" | head -80; exit 1; }
  echo "--- built in ${SECONDS}s"
fi
# tokenizer.json too: scripts/gpu-check.sh writes a checkpoint without one (cuda_e2e), and the
# HTTP front end needs it.
if has ckpt && { [ ! -f "$CKPT/config.json" ] || [ ! -f "$CKPT/tokenizer.json" ]; }; then
  echo "=== checkpoint ($(date +%T))"
  t0=$SECONDS
  "$BUILD/duet" model random --preset r1-distill-llama-8b --out "$CKPT" >/dev/null || exit 1
  echo "--- 8B random checkpoint written in $((SECONDS - t0)) s: $(du -sh "$CKPT" | cut -f1)"
fi

deploy() {  # deploy FILE SLOT KIND[+bN][+cN][+fd]: the deployment TOML of one run (+bN: decode max_batch N,
  # else 128; +cN: prefill chunk_tokens N, else 2048; +fd: router.first_token = "decode")
  local file=$1 slot=$2 kind=${3%%+*} pre="" dec="" dnode="" ddev=0 dbatch=128 chunk=2048 first="" opt
  for opt in $(tr '+' ' ' <<<"${3#"$kind"}"); do
    case $opt in
      b*) dbatch=${opt#b} ;;
      c*) chunk=${opt#c} ;;
      fd) first='first_token = "decode"' ;;
      *) echo "bad option $opt in $3"; return 1 ;;
    esac
  done
  [[ $dbatch =~ ^[0-9]+$ && $chunk =~ ^[0-9]+$ ]] || { echo "bad decode batch or chunk in $3"; return 1; }
  # A run named -cN- must run N-token chunks: runs named c1024 once ran 2,048 (docs/benchmarks.md, erratum).
  if [[ $(basename "$file") =~ -c([0-9]+)(-|\.) && ${BASH_REMATCH[1]} != "$chunk" ]]; then
    echo "run $(basename "$file" .toml) is named for ${BASH_REMATCH[1]}-token chunks but $3 gives $chunk"; return 1
  fi
  case $kind in
    colocated) pre='stream = "shared"'; dec='stream = "shared"' ;;
    streams) ;;
    green:*) local f=${kind#green:}
             pre="sm_share = $f"; dec="sm_share = $(python3 -c "print(round(1 - $f, 3))")" ;;
    reserve:*) pre="sm_share = ${kind#reserve:}" ;;  # decode on the whole GPU, the rest its own
    1p1d) ddev=1; dnode=$(printf '\n[[nodes]]\nname = "d%s"\nendpoint = "ipc:///tmp/duet-serve-d%s.sock"\n' "$slot" "$slot") ;;
    *) echo "unknown deployment $kind"; return 1 ;;
  esac
  cat > "$file" <<EOF
[model]
name = "r1-8b-random"
path = "$CKPT"
max_context = $MAX_CONTEXT
block_tokens = 16

[engine]
kind = "$ENGINE"
gpu = "$GPU_NAME"

[router]
queue_limit = 8192
request_timeout_ms = 600000
$first

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
kv_blocks = $PREFILL_BLOCKS
max_batch = 16
chunk_tokens = $chunk
$pre
$dnode
[[nodes.actors]]
name = "decode0"
role = "decode"
device = $ddev
kv_blocks = $DECODE_BLOCKS
max_batch = $dbatch
$dec
EOF
}

decode_thread_of() {  # decode_thread_of NAME: 0 for runs named -inline (decode steps on the actor's
  # thread, as every run up to 2026-12-05e), else $DUET_DECODE_THREAD or 1 (scripts/serve_runs.py)
  if [[ $1 == *-inline ]]; then echo 0; else echo "${DUET_DECODE_THREAD:-1}"; fi
}

up_start() {  # up_start NAME SLOT KIND VISIBLE_GPUS: `duet up` of that deployment, in the background (pid in UP)
  local name=$1 slot=$2 kind=$3 visible=$4
  deploy "$RUNS/$name.toml" "$slot" "$kind" || return 1
  # GPU_SERVE_STEP_LOG=1: every engine step of the run to $RUNS/NAME.steps.<worker>.<pid>.csv
  # (runtime/step_log.hpp; scripts/compare-steps.py reads them).
  DUET_STEP_LOG=${GPU_SERVE_STEP_LOG:+$RUNS/$name.steps} \
    DUET_DECODE_THREAD=$(decode_thread_of "$name") CUDA_VISIBLE_DEVICES=$visible "$BUILD/duet" up \
    --config "$RUNS/$name.toml" >"$RUNS/$name.up.log" 2>&1 &
  UP=$! UP_KIND=${kind%%+*}
}

up_stop() {  # up_stop NAME SLOT: SIGTERM to $UP, SIGKILL after 20 s (1p1d: its decode node's process too)
  local name=$1 slot=$2
  kill -TERM "$UP" 2>/dev/null
  for _ in $(seq 100); do kill -0 "$UP" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$UP" 2>/dev/null
  [ "$UP_KIND" = 1p1d ] && pkill -KILL -f "duet-serve-d$slot" 2>/dev/null
  wait "$UP" 2>/dev/null
  grep -iE 'sm|green|stream|error|fail' "$RUNS/$name.up.log" | head -8
}

bench_serve() {  # bench_serve NAME SLOT CALIBRATION WAIT_S LIMIT_S TRACE START DURATION RATE: bench serve, simulator beside
  local name=$1 slot=$2 cal=$3 wait=$4 limit=$5 trace=$6 start=$7 dur=$8 rate=$9 rc
  DUET_DECODE_THREAD=$(decode_thread_of "$name") \
    timeout -k 10 $((limit + wait + ${BENCH_GRACE:-60})) "$BUILD/duet" bench serve --url "http://127.0.0.1:$((18080 + slot))" \
    --trace "$TRACES/$trace" --start "$start" --duration "$dur" --rate-scale "$rate" --slo "$SLO" \
    --wait "$wait" --time-limit "$limit" --name "$name" --config "$RUNS/$name.toml" --sim-deployment config \
    --calibration "$cal" --title "$name: $trace from ${start}s, ${dur}s at rate x$rate" \
    --out "$RUNS/$name" >"$RUNS/$name.bench.log" 2>&1
  rc=$?
  echo "--- $name: bench exit $rc ($(date +%T))"
  return $rc
}

serve() {  # serve NAME SLOT KIND VISIBLE_GPUS TRACE START DURATION RATE
  local name=$1 slot=$2 kind=$3 visible=$4 trace=$5 start=$6 dur=$7 rate=$8
  up_start "$name" "$slot" "$kind" "$visible" || return 1
  local span limit
  span=$(python3 -c "print(int($dur / $rate))")
  limit=$((span + 150))
  bench_serve "$name" "$slot" "$CAL" 240 "$limit" "$trace" "$start" "$dur" "$rate"
  up_stop "$name" "$slot"
  sed -n '/completed/,/E2E P99/p' "$RUNS/$name.bench.log"
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

if has today_high; then  # conversation x5 on today's engine and calibration: colocated, then PD streams
  echo "=== one GPU, heavier load, today's engine ($(date +%T))"
  CAL_SAVED=$CAL CAL=$CAL_FID
  for run in "conv5-today-colocated colocated" "conv5-today-pd-streams streams"; do
    set -- $run
    serve "$1" 0 "$2" 0 $CONV_HIGH
    tar -czf "$OUT/today-high.tar.gz" -C "$RUNS" --exclude='*.up.log' --exclude='report.html' --exclude='requests.csv' .
  done
  CAL=$CAL_SAVED
fi

locust_replay() {  # locust_replay NAME SLOT LIMIT_S TRACE START DURATION RATE: bench/locustfile.py, the same requests
  local name=$1 slot=$2 limit=$3 trace=$4 start=$5 dur=$6 rate=$7 rc
  mkdir -p "$RUNS/$name"
  DUET_TRACE=$TRACES/$trace DUET_START=$start DUET_DURATION=$dur DUET_RATE_SCALE=$rate \
  DUET_MAX_CONTEXT=$MAX_CONTEXT DUET_REQUEST_TIMEOUT=$limit DUET_WAIT=30 \
  DUET_LOCUST_OUT=$RUNS/$name/locust.json PYTHONUNBUFFERED=1 \
    timeout -k 10 $((limit + 40)) "$LOCUST_VENV/bin/locust" -f bench/locustfile.py --headless \
      --host "http://127.0.0.1:$((18080 + slot))" -u 512 -r 512 --run-time "${limit}s" --only-summary \
      --loglevel WARNING --csv "$RUNS/$name/locust" >"$RUNS/$name.locust.log" 2>&1
  rc=$?
  echo "--- $name: locust exit $rc ($(date +%T))"
  grep -E '^(TTFT|TPOT|E2E) ' "$RUNS/$name.locust.log" | head -6
  grep -iE 'late|error|Traceback' "$RUNS/$name.locust.log" | head -5
  return $rc
}

warm_up() {  # warm_up NAME SLOT WAIT_S: wait for the deployment, then 8 short requests (first-use costs out of the replay)
  local name=$1 slot=$2 wait=$3 rc w t0=$SECONDS
  "$BUILD/duet" bench serve --url "http://127.0.0.1:$((18080 + slot))" \
    --trace synthetic:poisson:rate=8,count=8,in=1024,out=16,seed=1 --wait "$wait" --time-limit 15 \
    --name "$name-warmup" --out "$RUNS/$name-warmup" >"$RUNS/$name-warmup.log" 2>&1 &
  w=$!
  # Watched here rather than by timeout(1) alone: a deployment that exits (a CUDA error, say)
  # ends the wait at once instead of after the whole --wait.
  while kill -0 "$w" 2>/dev/null; do
    if ! kill -0 "$UP" 2>/dev/null; then
      echo "--- $name: duet up exited"; tail -5 "$RUNS/$name.up.log"; kill -TERM "$w" 2>/dev/null; break
    elif [ $((SECONDS - t0)) -gt $((wait + 20)) ]; then
      echo "--- $name: warm-up not done after $((wait + 20)) s"; kill -TERM "$w" 2>/dev/null; break
    fi
    sleep 1
  done
  wait "$w"; rc=$?
  if [ "$rc" = 0 ]; then echo "--- $name: up and warmed up after $((SECONDS - UP_T0)) s"
  else echo "--- $name: not ready after $((SECONDS - UP_T0)) s (warm-up exit $rc; $name-warmup.log): its runs skipped"; fi
  return $rc
}

fidelity_report() {  # $OUT/serve.md, $OUT/fidelity.json and $OUT/fidelity.tar.gz from $FID_RUNS, so far
  python3 - "$FID_RUNS" "$OUT" docs/data/h200-serve "$FID_WINDOW" "${CAL_FID##*/}" <<'EOF'
import json, pathlib, sys
runs, out, old_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
window, calibration = sys.argv[4], sys.argv[5]

def load(p):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None

def ms(s, k, q):
    return s[k][q] * 1e3

def diff(a, b):
    return f"{(b - a) / a * 100:+.0f}%" if a else "n/a"

lines = [f"# Fidelity on the H200: today's engine, the simulator with {calibration}",
         "", f"Window: {window}. Live / simulated (simulated minus live, relative to live).", "",
         "| run | done | TTFT P50 ms | TTFT P99 ms | ITL P50 ms | ITL P99 ms | TPOT P99 ms | goodput req/s |",
         "| --- | --- | --- | --- | --- | --- | --- | --- |"]
report = {"window": window, "calibration": calibration, "runs": {}, "locust": None}
for name in ("conv3-colocated", "conv3-pd-streams", "conv3-pd-streams-repeat"):
    summary = load(runs / name / "summary.json")
    if not summary:
        continue
    live = summary["runs"][0]["summary"]
    sim = summary["runs"][1]["summary"] if len(summary["runs"]) > 1 else None
    report["runs"][name] = {"live": live, "sim": sim}
    def cell(k, q, fmt):
        a = ms(live, k, q)
        if not sim:
            return f"{a:{fmt}}"
        b = ms(sim, k, q)
        return f"{a:{fmt}} / {b:{fmt}} ({diff(a, b)})"
    good = f'{live["goodput_rps"]:.2f}' + (f' / {sim["goodput_rps"]:.2f}' if sim else "")
    lines.append(f'| {name} | {live["completed"]}/{live["requests"]} | {cell("ttft_s", "p50", ".0f")} | '
                 f'{cell("ttft_s", "p99", ".0f")} | {cell("itl_s", "p50", ".1f")} | {cell("itl_s", "p99", ".1f")} | '
                 f'{cell("tpot_s", "p99", ".1f")} | {good} |')

hop_rows = [("router.hop_encode", "router: tokenize"), ("prefill.hop_inbox", "prefill: mailbox (in queue)"),
            ("prefill.hop_queue", "prefill: queue"),
            ("prefill.hop_compute", "prefill: first chunk to last"), ("prefill.hop_register", "prefill: broker ack"),
            ("router.hop_ttft", "router: submit to prefill_done"), ("prefill.hop_step", "prefill: one step"),
            ("prefill.tokens_per_step", "prefill: tokens per step"), ("decode.hop_step", "decode: one step"),
            ("decode.mean_batch", "decode: sequences per step"), ("outside_router", "beyond the router"),
            ("client_ttft", "client TTFT")]
hop_runs = []
for name in report["runs"]:
    summary = load(runs / name / "summary.json")
    live = summary.get("bench", {}).get("ttft_hops")
    sims = summary.get("bench", {}).get("simulated") or [{}]
    if live:
        hop_runs.append((name, live, sims[0].get("ttft_hops")))
        report["runs"][name]["ttft_hops"] = {"live": live, "sim": sims[0].get("ttft_hops")}
if hop_runs:
    lines += ["", "TTFT by hop, mean ms, live / simulated (-1: not recorded; bench serve sends token ids, so "
              "nothing is tokenized):", "", "| hop | " + " | ".join(n for n, _, _ in hop_runs) + " |",
              "| --- |" + " --- |" * len(hop_runs)]
    for key, label in hop_rows:
        cells = [f'{live.get(key, -1):.1f} / {sim.get(key, -1):.1f}' if sim else f'{live.get(key, -1):.1f}'
                 for _, live, sim in hop_runs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

lines += ["", "The same deployments on 2026-11-29 (docs/data/h200-serve, engine of then, conversation 0-180 s x3, no warm-up), live:",
          "", "| run | TTFT P50 / P99 ms | ITL P50 / P99 ms | TPOT P99 ms |", "| --- | --- | --- | --- |"]
for old, new in (("conv-colocated", "conv3-colocated"), ("conv-pd-streams", "conv3-pd-streams")):
    summary = load(old_dir / f"{old}.json")
    if summary:
        s = summary["runs"][0]["summary"]
        lines.append(f'| {old} | {ms(s, "ttft_s", "p50"):.0f} / {ms(s, "ttft_s", "p99"):.0f} | '
                     f'{ms(s, "itl_s", "p50"):.1f} / {ms(s, "itl_s", "p99"):.1f} | {ms(s, "tpot_s", "p99"):.1f} |')

loc = load(runs / "conv3-pd-streams-locust" / "locust.json")
bench = report["runs"].get("conv3-pd-streams")
if loc and bench:
    ls, bs = loc["summary"], bench["live"]
    rep = report["runs"].get("conv3-pd-streams-repeat")
    rs = rep["live"] if rep else None
    def close(a, b, rel=0.15):
        return abs(a - b) <= rel * max(abs(a), abs(b))
    # tests/http/test_bench_serve.py's criterion: P99 E2E, P99 TPOT and P50 TPOT within 15%.
    agree = {ref: all(close(ls[m][q], s[m][q]) for m, q in (("e2e_s", "p99"), ("tpot_s", "p99"), ("tpot_s", "p50")))
             for ref, s in (("bench_serve", bs), ("bench_serve_repeat", rs)) if s}
    report["locust"] = {"summary": ls, "late": loc.get("late"), "max_in_flight": loc.get("max_in_flight"),
                        "users": loc.get("users"), "agree_within_15pct": agree}
    lines += ["", "Locust (bench/locustfile.py) against bench serve on the conv3-pd-streams deployment, the same "
              "window and requests, one after the other on the same server:", "",
              "| ms | bench serve | locust (diff) |" + (" bench serve again |" if rs else ""),
              "| --- | --- | --- |" + (" --- |" if rs else "")]
    for m, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        for q in ("p50", "p99"):
            a, b = ms(bs, m, q), ms(ls, m, q)
            row = f"| {label} {q.upper()} | {a:.1f} | {b:.1f} ({diff(a, b)}) |"
            if rs:
                row += f" {ms(rs, m, q):.1f} |"
            lines.append(row)
    late = loc.get("late") or {}
    lines += ["", f'Completed: bench serve {bs["completed"]}/{bs["requests"]}, locust {ls["completed"]}/{ls["requests"]} '
              f'(outcomes {ls["outcomes"]}); locust late requests {late.get("requests")} '
              f'({late.get("all_users_busy")} with every user busy, max {1e3 * (late.get("max_late_s") or 0):.0f} ms), '
              f'{loc.get("max_in_flight")} in flight at most.',
              "Locust within 15% of bench serve on P99 E2E, P99 TPOT and P50 TPOT (tests/http/test_bench_serve.py): " +
              ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in agree.items())]
elif (runs / "conv3-pd-streams-locust.locust.log").exists():
    lines += ["", "Locust: ran, but wrote no locust.json (see conv3-pd-streams-locust.locust.log in fidelity.tar.gz)."]
(out / "fidelity.json").write_text(json.dumps(report, indent=1) + "\n")
(runs / "fidelity.md").write_text("\n".join(lines) + "\n")
(out / "serve.md").write_text("\n".join(lines) + "\n")
EOF
  tar -czf "$OUT/fidelity.tar.gz.tmp" -C "${FID_RUNS%/*}" "${FID_RUNS##*/}" && mv "$OUT/fidelity.tar.gz.tmp" "$OUT/fidelity.tar.gz"
  if [ "$(stat -c %s "$OUT/fidelity.tar.gz")" -gt 15000000 ]; then  # $OUT brings back 16 MiB a file
    tar -czf "$OUT/fidelity.tar.gz" -C "${FID_RUNS%/*}" --exclude='*.up.log' --exclude='report.html' "${FID_RUNS##*/}"
  fi
}

if has fidelity; then
  echo "=== fidelity: one GPU, conversation x3, today's engine and calibration ($(date +%T); at ${SECONDS} s of ${DEADLINE})"
  RUNS=$FID_RUNS
  read -r ftrace fstart fdur frate <<<"$CONV_FID"
  # Three replays of one window (PD streams by bench serve, then by locust, colocated by bench
  # serve) and two deployment starts must fit: a start ~STARTUP s (weights from the page cache,
  # the warm-up), a replay its span plus ~DRAIN s (the last requests, the simulation, the report).
  STARTUP=20 DRAIN=15 RESERVE=25 BENCH_GRACE=20
  fspan=$(python3 -c "print(int($fdur / $frate))")
  fit=$(( (DEADLINE - SECONDS - RESERVE - 2 * STARTUP - 3 * DRAIN) / 3 ))
  if [ "$fit" -lt "$fspan" ]; then
    fspan=$fit; fdur=$(python3 -c "print($fit * $frate)")
    echo "short of time: the window shortened to $fdur s of the trace ($fspan s of replay)"
  fi
  FID_WINDOW="$ftrace from ${fstart} s, $fdur s at rate x$frate ($fspan s of replay)"
  window=("$ftrace" "$fstart" "$fdur" "$frate")
  one_run=$((STARTUP + fspan + DRAIN))
  # limit_for LATER: a replay's time limit, leaving LATER seconds for the runs after it (0: too little left)
  limit_for() { local l=$((DEADLINE - SECONDS - RESERVE - $1)); [ $l -gt $((fspan + 60)) ] && l=$((fspan + 60)); [ $l -ge $((fspan + 5)) ] && echo $l || echo 0; }
  # wait_for LATER: how long a deployment may take to come up, leaving LATER seconds (at most 120, at least 5)
  wait_for() { local w=$((DEADLINE - SECONDS - RESERVE - $1)); [ $w -gt 120 ] && w=120; [ $w -lt 5 ] && w=5; echo $w; }
  fid_replay() {  # fid_replay NAME SLOT LATER: bench serve of the window (LATER as for limit_for), then the report
    local lim
    lim=$(limit_for "$3")
    if [ "$lim" -gt 0 ]; then
      bench_serve "$1" "$2" "$CAL_FID" 30 "$lim" "${window[@]}"
      sed -n '/completed/,/E2E P99/p' "$RUNS/$1.bench.log"
      fidelity_report
    else
      echo "--- out of time: $1 skipped"
    fi
  }
  fid_colocated() {  # the colocated deployment: start, warm up, replay the window, stop
    UP_T0=$SECONDS
    up_start conv3-colocated 0 colocated 0
    if warm_up conv3-colocated 0 "$(wait_for $((fspan + DRAIN)))"; then
      fid_replay conv3-colocated 0 0
    fi
    up_stop conv3-colocated 0
  }
  if [ "$fspan" -lt 20 ]; then
    echo "fidelity: only ${fspan} s of replay would fit before ${DEADLINE} s: skipped"
  elif [ ! -x "$BUILD/duet" ] || [ ! -f "$CKPT/config.json" ]; then
    echo "fidelity: no $BUILD/duet or $CKPT (stages build,ckpt): skipped"
  elif [ "${GPU_SERVE_FID_ONLY:-}" = colocated ]; then  # the colocated replay alone (~130 s)
    fid_colocated
  else
    UP_T0=$SECONDS
    up_start conv3-pd-streams 1 streams 0
    # Priority when time is short: this replay, then locust's, then colocated, then the repeat.
    if warm_up conv3-pd-streams 1 "$(wait_for $((2 * (fspan + DRAIN))))"; then
      fid_replay conv3-pd-streams 1 $((fspan + DRAIN))
      for _ in $(seq 30); do kill -0 "$PIP_PID" 2>/dev/null || break; sleep 1; done
      if kill -0 "$PIP_PID" 2>/dev/null; then pip_rc=timeout; else wait "$PIP_PID"; pip_rc=$?; fi
      tail -3 "$RUNS/pip.log"
      lim=$(limit_for 0)
      if [ "$pip_rc" != 0 ]; then
        echo "--- locust did not install (pip.log in fidelity.tar.gz): locust skipped"
      elif [ "$lim" -gt 0 ]; then
        locust_replay conv3-pd-streams-locust 1 "$lim" "${window[@]}"
        fidelity_report
      else
        echo "--- out of time: locust skipped"
      fi
      # A second bench serve replay (client noise against locust), only when colocated still fits after it.
      if [ "$(limit_for $((fspan + DRAIN + one_run)))" -gt 0 ]; then
        cp "$RUNS/conv3-pd-streams.toml" "$RUNS/conv3-pd-streams-repeat.toml"
        fid_replay conv3-pd-streams-repeat 1 "$one_run"
      fi
    fi
    up_stop conv3-pd-streams 1
    lim=$(limit_for $STARTUP)
    if [ "$lim" -gt 0 ]; then
      fid_colocated
    else
      echo "--- out of time: colocated skipped"
    fi
  fi
  fidelity_report
  RUNS=$OUT/serve
fi

if has matrix; then
  echo "=== matrix: one GPU, today's engine, ${CAL_MATRIX##*/} ($(date +%T); at ${SECONDS} s of ${DEADLINE})"
  CAL_SAVED=$CAL CAL=$CAL_MATRIX
  IFS=';' read -ra matrix_runs <<<"$MATRIX"
  for run in "${matrix_runs[@]}"; do
    set -- $run  # NAME KIND TRACE START DURATION RATE
    span=$(python3 -c "print(int($5 / $6))")
    # A run: the start (~20 s from the page cache, the warm-up), the replay, its drain (~40 s at overload).
    left=$((DEADLINE - SECONDS - 15))
    if [ "$left" -lt $((20 + span + 40)) ]; then echo "--- out of time ($left s left): $1 skipped"; continue; fi
    UP_T0=$SECONDS
    up_start "$1" 0 "$2" 0 || continue
    if warm_up "$1" 0 60; then
      date +%s%3N >"$RUNS/$1.replay-start-ms"  # steps before it are the warm-up's
      limit=$((DEADLINE - SECONDS - 15 - 30)); [ "$limit" -gt $((span + 90)) ] && limit=$((span + 90))
      BENCH_GRACE=10 bench_serve "$1" 0 "$CAL" 30 "$limit" "${@:3}"
      sed -n '/completed/,/E2E P99/p' "$RUNS/$1.bench.log"
    fi
    up_stop "$1" 0
    tar -czf "$OUT/matrix.tar.gz.tmp" -C "$RUNS" --exclude='report.html' . && mv "$OUT/matrix.tar.gz.tmp" "$OUT/matrix.tar.gz"
    if [ "$(stat -c %s "$OUT/matrix.tar.gz")" -gt 15000000 ]; then  # $OUT brings back 16 MiB a file
      tar -czf "$OUT/matrix.tar.gz" -C "$RUNS" --exclude='report.html' --exclude='*.up.log' --exclude='requests.csv' .
    fi
  done
  CAL=$CAL_SAVED
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

# One table of every run so far: live figures and the simulator's beside them (and stage fidelity's tables).
python3 - "$OUT/serve" >"$OUT/serve-runs.md" <<'EOF'
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
if ls "$OUT"/serve/*/summary.json >/dev/null 2>&1; then
  cat "$OUT/serve-runs.md" ${FID_WINDOW:+"$FID_RUNS/fidelity.md"} >"$OUT/serve.md"
fi
rm -f "$OUT/serve-runs.md"
cat "$OUT/serve.md" 2>/dev/null
echo "=== done in ${SECONDS}s ($(date +%T))"
