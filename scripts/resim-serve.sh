#!/usr/bin/env bash
# The simulator's prediction of every H200 serving run in docs/data/h200-serve/ (each run's
# deployment TOML and trace window), beside the measured figures (docs/benchmarks.md,
# "Simulator vs measured"). Needs the Azure traces: $DUET_TRACES (default ../shared/traces).
#   scripts/resim-serve.sh [CALIBRATION.toml]
set -eu
cd "$(dirname "$0")/.."
CAL=${1:-config/calibration-duet/h200-cuda-engine.toml}
TRACES=${DUET_TRACES:-../shared/traces}
DUET=${DUET_BIN:-build/duet}
OUT=${OUT:-resim-out}
mkdir -p "$OUT"
for toml in docs/data/h200-serve/*.toml; do
  name=$(basename "$toml" .toml)
  case $name in  # the trace window and rate of each run (scripts/gpu-serve.sh)
    conv5-*) w="conv 0 300 5" ;;
    conv3long-*) w="conv 0 540 3" ;;
    conv-1p1d) w="conv 0 180 6" ;;
    conv-*) w="conv 0 180 3" ;;
    code1-*) w="code 180 60 1" ;;
    code-1p1d) w="code 180 60 1.4" ;;
    code-*) w="code 180 60 0.7" ;;
  esac
  set -- $w
  # The runs predate on-demand KV: their decode workers reserved prompt + max_tokens up front.
  sed 's/^role = "decode"$/role = "decode"\nkv_allocation = "reserve"/' "$toml" >"$OUT/$name.toml"
  "$DUET" sim --config "$OUT/$name.toml" --trace "$TRACES/AzureLLMInferenceTrace_$1_2023.csv" --start "$2" \
    --duration "$3" --rate-scale "$4" --slo ttft=2s,tpot=50ms --calibration "$CAL" \
    --out "$OUT/$name" >"$OUT/$name.log"
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| run | TTFT P50 ms | TTFT P99 ms | ITL P50 ms | ITL P99 ms |")
print("| --- | --- | --- | --- | --- |")
for live_file in sorted(pathlib.Path("docs/data/h200-serve").glob("*.json")):
    sim_file = out / live_file.stem / "summary.json"
    if not sim_file.exists():
        continue
    live = json.loads(live_file.read_text())["runs"][0]["summary"]
    sim = json.loads(sim_file.read_text())["runs"][0]["summary"]
    cells = []
    for key, q in (("ttft_s", "p50"), ("ttft_s", "p99"), ("itl_s", "p50"), ("itl_s", "p99")):
        a, b = live[key][q] * 1e3, sim[key][q] * 1e3
        cells.append(f"{a:.1f} / {b:.1f} ({(b / a - 1) * 100:+.0f}%)")
    print(f"| {live_file.stem} | " + " | ".join(cells) + " |")
PY
