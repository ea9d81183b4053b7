#!/usr/bin/env bash
# KV streaming during prefill on the GPU machine (issue 6, deliverable 4; docs/benchmarks.md,
# "KV handover"): a prefill and a decode node of CUDA engines on one GPU, in two processes, KV on
# the stream path (device -> host -> ZeroMQ ipc -> host -> device), long prompts one at a time,
# `broker.stream_prefill` "off" (the KV moves after the whole prompt) against "chunks" (each
# finished chunk's blocks move while the next chunk computes). Each request's TTFT and its first
# inter-token gap (first to second token: the handover stall) come from `duet bench serve`
# over ZeroMQ. Run after a build and the 8B checkpoint of scripts/gpu-check.sh, e.g.
#   GPU_CHECK_STAGES=build,bench scripts/gpu-check.sh; scripts/gpu-stream-prefill.sh
# Results in $OUT/stream-prefill.md; the nodes' logs and bench serve's reports stay in $WORK
# (/tmp/duet-stream-prefill), since a device call brings back 8 files. STREAM_CHUNK_BYTES sets
# [broker] stream_chunk_bytes (default 4 MiB); the nodes' stream_read_us / stream_write_us
# counters (printed per mode) say how long the owner's reads and the adopter's writes took.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUILD=${GPU_BUILD:-build-gpu}
CKPT=${GPU_CKPT:-$BUILD/r1-distill-llama-8b-random}
LENGTHS=${STREAM_PREFILL_LENGTHS:-8192 16384 30000 8192 16384 30000}
WORK=${STREAM_PREFILL_WORK:-/tmp/duet-stream-prefill}
mkdir -p "$WORK"
source "$(dirname "$0")/gpu-env.sh"
[ -f "$CKPT/config.json" ] || { echo "no checkpoint at $CKPT (scripts/gpu-check.sh writes it)"; exit 1; }

trace=/tmp/duet-stream-prefill.jsonl
{
  echo '{"timestamp": 0, "input_length": 1024, "output_length": 8}'  # warm-up: plans, graphs
  at=3000
  for n in $LENGTHS; do
    echo "{\"timestamp\": $at, \"input_length\": $n, \"output_length\": 8}"
    at=$((at + 6000))
  done
} >"$trace"

run_mode() {  # run_mode off|chunks
  local mode=$1 cfg=/tmp/duet-sp-$1.toml
  cat >"$cfg" <<EOF
[model]
name = "r1-8b-random"
path = "$CKPT"
max_context = 32768
block_tokens = 16
[engine]
kind = "cuda"
[broker]
transfer = "stream"
stream_prefill = "$mode"
stream_chunk_bytes = ${STREAM_CHUNK_BYTES:-4194304}
lease_ms = 60000
transfer_timeout_ms = 60000
[router]
request_timeout_ms = 120000
[[nodes]]
name = "p"
endpoint = "ipc:///tmp/duet-sp-$mode-p.sock"
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
kv_blocks = 2200
max_batch = 4
chunk_tokens = 2048
[[nodes]]
name = "d"
endpoint = "ipc:///tmp/duet-sp-$mode-d.sock"
[[nodes.actors]]
name = "decode0"
role = "decode"
device = 0
kv_blocks = 2200
max_batch = 4
EOF
  "$BUILD/duet" node --config "$cfg" --name p >"$WORK/sp-$mode-p.log" 2>&1 &
  local p=$!
  "$BUILD/duet" node --config "$cfg" --name d >"$WORK/sp-$mode-d.log" 2>&1 &
  local d=$!
  timeout -k 10 300 "$BUILD/duet" bench serve --config "$cfg" --trace "$trace" --wait 180 --time-limit 150 \
    --name "$mode" --out "$WORK/sp-$mode" >"$WORK/sp-$mode.bench.log" 2>&1
  echo "--- stream_prefill $mode: bench exit $? ($(date +%T))"
  timeout 20 "$BUILD/duet" stats --config "$cfg" 2>/dev/null | grep -E "stream_bytes|stream_(read|write)_us|transfers_|chunks|expired" | head -12
  kill -TERM $p $d 2>/dev/null
  sleep 3
  kill -KILL $p $d 2>/dev/null
  wait $p $d 2>/dev/null
}
run_mode off
run_mode chunks

python3 - "$WORK" <<'PY' | tee "$OUT/stream-prefill.md"
import csv, sys
out = sys.argv[1]
rows = {}
for mode in ("off", "chunks"):
    try:
        for r in csv.DictReader(open(f"{out}/sp-{mode}/requests.csv")):
            gaps = [int(g) for g in r["itl_us"].split()] if r["itl_us"] else []
            rows.setdefault((int(r["id"]), int(r["prompt_tokens"])), {})[mode] = (
                r["outcome"], float(r["ttft_s"] or "nan") * 1e3, gaps[0] / 1e3 if gaps else float("nan"))
    except FileNotFoundError:
        print(f"no report for {mode}")
print("| request | prompt tokens | TTFT off ms | first gap off ms | TTFT chunks ms | first gap chunks ms |")
print("| --- | --- | --- | --- | --- | --- |")
for (i, n), m in sorted(rows.items()):
    o, c = m.get("off", ("-", float("nan"), float("nan"))), m.get("chunks", ("-", float("nan"), float("nan")))
    print(f"| {i} | {n} | {o[1]:.1f} | {o[2]:.1f} | {c[1]:.1f} | {c[2]:.1f} |" + ("" if o[0] == c[0] == "ok" else f" {o[0]}/{c[0]}"))
PY
