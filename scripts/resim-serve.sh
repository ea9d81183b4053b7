#!/usr/bin/env bash
# The simulator's prediction of every H200 serving run in a data folder (each run's deployment
# TOML and trace window), beside the measured figures (docs/benchmarks.md, "Simulator vs
# measured"). Needs the Azure traces: $DUET_TRACES (default ../shared/traces).
#   scripts/resim-serve.sh [CALIBRATION.toml [DATA]]
# DATA: docs/data/h200-serve (the default; 11-29 runs), docs/data/h200-serve-2026-12-01b (the
# 12-01 engine, with config/calibration-duet/h200-cuda-engine-2026-12-01.toml) or
# docs/data/h200-serve-2026-12-02 (the wgmma prefill attention, with ...-2026-12-01c.toml);
# docs/data/h200-serve-2026-12-02e and -02f with ...-2026-12-02e.toml (before), -02f.toml or
# -2026-12-03.toml (the decode delay by overlap); docs/data/h200-serve-2026-12-03, -03b and
# -03c (out of sample: decode batch caps 128 and 256 on one machine) with ...-2026-12-03.toml;
# -03d to -03g (prefill chunks of 512 to 2,048 tokens, code x1, conversation x4.5 and x5) with
# ...-2026-12-03b.toml (PD-streams contention by prefill step size), -03c.toml or -03i.toml (the
# newest for PD streams: a prefill step starting during a decode step delays it too); -03j,
# -04, -04b and -04c (PD with the SMs split on today's engine) with ...-2026-12-05.toml (the
# newest: prefill priced from steps timed alone, slowed beside the decode share), -04b.toml (a
# decode step on a share slowed while the other share runs prefill) or -04.toml; -05 with -05.
set -eu
cd "$(dirname "$0")/.."
CAL=${1:-config/calibration-duet/h200-cuda-engine.toml}
DATA=${2:-docs/data/h200-serve}
TRACES=${DUET_TRACES:-../shared/traces}
DUET=${DUET_BIN:-build/duet}
OUT=${OUT:-resim-out}
# RESIM_SPREAD=0.03: each run also simulated with the engine 3 % slower and faster (duet sim
# --speed-spread); the table then gives the TTFT P99 range and whether the live figure is in it.
SPREAD=${RESIM_SPREAD:-0}
# RESIM_DECODE_THREAD=1 (or 0): every run simulated with decode steps on a thread of their own
# (or on the actor's thread) whatever it ran with: what the decode step thread would change.
# RESIM_FIRST_TOKEN=decode (or prefill): every run simulated with that router.first_token.
FIRST_TOKEN=${RESIM_FIRST_TOKEN:-}
mkdir -p "$OUT"
for toml in "$DATA"/*.toml; do
  name=$(basename "$toml" .toml)
  # The trace window and rate, and the engine settings it ran with (scripts/serve_runs.py).
  w=$(python3 scripts/serve_runs.py "$DATA/$name")
  set -- $w
  # The 11-29 runs predate on-demand KV: their decode workers reserved prompt + max_tokens up front.
  if [ "$DATA" = docs/data/h200-serve ]; then
    sed 's/^role = "decode"$/role = "decode"\nkv_allocation = "reserve"/' "$toml" >"$OUT/$name.toml"
  else
    cp "$toml" "$OUT/$name.toml"
  fi
  if [ -n "$FIRST_TOKEN" ]; then
    sed -i '/^first_token = /d' "$OUT/$name.toml"
    if grep -q '^\[router\]$' "$OUT/$name.toml"; then
      sed -i "/^\[router\]\$/a first_token = \"$FIRST_TOKEN\"" "$OUT/$name.toml"
    else
      printf '\n[router]\nfirst_token = "%s"\n' "$FIRST_TOKEN" >>"$OUT/$name.toml"
    fi
  fi
  DUET_DECODE_BUCKET_STEP=$5 DUET_PREFILL_THREAD=$6 DUET_DECODE_THREAD=${RESIM_DECODE_THREAD:-$7} "$DUET" sim --config "$OUT/$name.toml" --trace "$TRACES/$1" --start "$2" \
    --duration "$3" --rate-scale "$4" --slo ttft=2s,tpot=50ms --calibration "$CAL" \
    --speed-spread "$SPREAD" --out "$OUT/$name" >"$OUT/$name.log"
done
python3 - "$OUT" "$DATA" <<'PY'
import json, pathlib, sys
out, data = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def runs():  # (live bench JSON, simulated summary) of every run the simulator replayed
    for live_file in sorted(data.glob("*.json")):
        sim_file = out / live_file.stem / "summary.json"
        if live_file.stem != "fidelity" and sim_file.exists():
            yield live_file, sim_file
band = lambda f: json.loads(f.read_text())["simulation"]["runs"][0].get("speed_band")
banded = any(band(s) for _, s in runs())
print("| run | TTFT P50 ms | TTFT P99 ms | ITL P50 ms | ITL P99 ms |" + (" sim TTFT P99 range ms |" if banded else ""))
print("| --- | --- | --- | --- | --- |" + (" --- |" if banded else ""))
for live_file, sim_file in runs():
    live = json.loads(live_file.read_text())["runs"][0]["summary"]
    sim = json.loads(sim_file.read_text())["runs"][0]["summary"]
    cells = []
    for key, q in (("ttft_s", "p50"), ("ttft_s", "p99"), ("itl_s", "p50"), ("itl_s", "p99")):
        a, b = live[key][q] * 1e3, sim[key][q] * 1e3
        cells.append(f"{a:.1f} / {b:.1f} ({(b / a - 1) * 100:+.0f}%)")
    speed = band(sim_file) if banded else None
    if speed:
        lo, hi = speed["faster"]["ttft_p99_s"] * 1e3, speed["slower"]["ttft_p99_s"] * 1e3
        inside = "live inside" if lo <= live["ttft_s"]["p99"] * 1e3 <= hi else "live outside"
        cells.append(f"{lo:.0f}–{hi:.0f} at ±{speed['spread'] * 100:.0f} % ({inside})")
    print(f"| {live_file.stem} | " + " | ".join(cells) + " |")
# The engine step times (hop counters, mean ms per step), where the live run recorded them.
print()
print("| run | prefill step ms | tokens per step | decode step ms | sequences per step |")
print("| --- | --- | --- | --- | --- |")
for live_file, sim_file in runs():
    hops = json.loads(live_file.read_text())["bench"].get("ttft_hops", {})
    c = json.loads(sim_file.read_text())["simulation"]["runs"][0]["counters"]
    sim = {
        "prefill.hop_step": c.get("prefill.hop_step_us", 0) / 1e3 / max(c.get("prefill.hop_step_count", 0), 1),
        "prefill.tokens_per_step": c.get("prefill.tokens", 0) / max(c.get("prefill.hop_step_count", 0), 1),
        "decode.hop_step": c.get("decode.hop_step_us", 0) / 1e3 / max(c.get("decode.hop_step_count", 0), 1),
        "decode.mean_batch": c.get("decode.batched_sequences", 0) / max(c.get("decode.steps", 0), 1),
    }
    cells = []
    for key in sim:
        a = hops.get(key, -1.0)
        cells.append(f"{a:.1f} / {sim[key]:.1f} ({(sim[key] / a - 1) * 100:+.0f}%)" if a > 0 else f"- / {sim[key]:.1f}")
    print(f"| {live_file.stem} | " + " | ".join(cells) + " |")
# Runs with a deployment but no live figures yet: the prediction alone, to be written down before
# the run (e.g. docs/data/h200-serve-2026-12-04/predictions.md).
pending = [d for d in sorted(out.iterdir()) if (d / "summary.json").exists() and not (data / f"{d.name}.json").exists()]
if pending:
    print()
    print("| run | TTFT P50 / P99 ms" + (" (P99 range)" if banded else "") + " | ITL P50 / P99 ms | P99/P50 ITL "
          "| 2nd token P50 / P99 ms | TPOT P99 ms | goodput req/s | prefill step ms (tokens) | decode step ms (batch) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for d in pending:
    doc = json.loads((d / "summary.json").read_text())
    s, c = doc["runs"][0]["summary"], doc["simulation"]["runs"][0]["counters"]
    ms = lambda key, q: s[key][q] * 1e3
    per = lambda num, den: c.get(num, 0) / max(c.get(den, 0), 1)
    speed = doc["simulation"]["runs"][0].get("speed_band")
    rng = (f' ({speed["faster"]["ttft_p99_s"] * 1e3:.0f}–{speed["slower"]["ttft_p99_s"] * 1e3:.0f})' if speed else "")
    print(f'| {d.name} | {ms("ttft_s", "p50"):.0f} / {ms("ttft_s", "p99"):.0f}{rng} | {ms("itl_s", "p50"):.1f} / '
          f'{ms("itl_s", "p99"):.1f} | {ms("itl_s", "p99") / ms("itl_s", "p50"):.2f} | '
          f'{ms("second_token_s", "p50"):.1f} / {ms("second_token_s", "p99"):.1f} | {ms("tpot_s", "p99"):.1f} | '
          f'{s["goodput_rps"]:.2f} | {per("prefill.hop_step_us", "prefill.hop_step_count") / 1e3:.1f} '
          f'({per("prefill.tokens", "prefill.hop_step_count"):.0f}) | '
          f'{per("decode.hop_step_us", "decode.hop_step_count") / 1e3:.1f} ({per("decode.batched_sequences", "decode.steps"):.1f}) |')
PY
