#!/usr/bin/env bash
# Two ways of serving, live on this machine's CPU: the embedded SmolLM2 deployment of
# config/local-cpu.toml with one engine thread per worker, a Poisson trace of short prompts and
# 30-token outputs (decode-bound), one run per mode and seed, alternating. Prints the
# first-to-second-token gap, ITL and TTFT of each run; the bench reports go to $OUT.
#   scripts/cpu-serve-ab.sh [SEEDS...]     default: 3 4 5 (about 6 minutes)
# AB_WHAT picks the pair:
#   decode-thread  (the default) decode steps on the actor's thread (DUET_DECODE_THREAD=0,
#                  runs "inline") against their own step thread (runs "thread")
#   first-token    router.first_token = "prefill" against "decode" (runs named so)
set -euo pipefail
cd "$(dirname "$0")/.."
DUET=${DUET_BIN:-build/duet}
WHAT=${AB_WHAT:-decode-thread}
OUT=${OUT:-$WHAT-ab}
TRACE_SPEC=${AB_TRACE:-synthetic:poisson:rate=3,count=150,in=40,out=30}
PORT=${AB_PORT:-18181}
case $WHAT in
  decode-thread) modes=(inline thread) ;;
  first-token) modes=(prefill decode) ;;
  *) echo "AB_WHAT must be decode-thread or first-token (got '$WHAT')" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
base="$OUT/deployment.toml"
sed -e "s/127.0.0.1:8080/127.0.0.1:$PORT/" -e "s#ipc:///tmp/duet-local-cpu.sock#ipc:///tmp/duet-serve-ab-$$.sock#" \
  -e 's/^threads = 0/threads = 1/' config/local-cpu.toml >"$base"
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(3 4 5)
for seed in "${seeds[@]}"; do
  for mode in "${modes[@]}"; do
    name="$mode-s$seed"
    config=$base decode_thread=1
    if [ "$WHAT" = first-token ]; then
      config="$OUT/$mode.toml"
      sed "/^\[router\]$/a first_token = \"$mode\"" "$base" >"$config"
    elif [ "$mode" = inline ]; then
      decode_thread=0
    fi
    DUET_DECODE_THREAD=$decode_thread "$DUET" up --config "$config" >"$OUT/$name.up.log" 2>&1 &
    up=$!
    "$DUET" bench serve --url "http://127.0.0.1:$PORT" --trace "$TRACE_SPEC,seed=$seed" --wait 120 \
      --out "$OUT/$name" --name "$name" >"$OUT/$name.log" 2>&1 || { kill -INT $up; wait $up || true; exit 1; }
    kill -INT $up
    wait $up || true
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'run':12s} {'2nd token P50 / P90 / P99 ms':>30s} {'ITL P50 / P99 ms':>18s} {'TTFT P50 ms':>12s} done")
for d in sorted(p for p in out.iterdir() if (p / "summary.json").exists()):
    s = json.loads((d / "summary.json").read_text())["runs"][0]["summary"]
    st, itl = s["second_token_s"], s["itl_s"]
    print(f"{d.name:12s} {st['p50']*1e3:10.1f} / {st['p90']*1e3:6.1f} / {st['p99']*1e3:6.1f} "
          f"{itl['p50']*1e3:8.1f} / {itl['p99']*1e3:6.1f} {s['ttft_s']['p50']*1e3:12.1f} {s['completed']}/{s['requests']}")
PY
