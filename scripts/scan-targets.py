#!/usr/bin/env python3
"""Where on a trace the simulator puts issue 9's targets: colocated against PD, each window start
and rate scale through `duet sim` with one calibration, as a markdown table. A load meets the
tail target when colocated's ITL P99 is over 3x its median and PD's within 1.5x; the goodput
target when PD's goodput (TTFT <= 2 s, TPOT <= 50 ms) is at least 1.5x colocated's. Used to pick
the loads a device call replays (docs/data/*/predictions.md), never as a measurement.

  scripts/scan-targets.py --colocated docs/data/h100-serve-conv5s300-2026-12-07/conv4s600-colocated-b256-42s.toml \\
      --pd docs/data/h100-serve-conv5s300-2026-12-07/conv4s600-pd-streams-b256-c2048-fd-42s.toml \\
      --calibration config/calibration-duet/h100-cuda-engine-2026-12-07f.toml --starts 600 --rates 3.5,4,4.25

With --speed-spread F (default 0.04, the most the H100's colocated steps have been priced long on
one day) each load also gets the ratio with colocated's engine F faster and PD's F slower: the
goodput verdict by that ratio is the one to trust before a run.

Each window replays --replay-seconds of the scaled trace (its duration in trace seconds is that
times the rate), on today's engine (decode graphs every 32 rows, prefill and decode steps on
threads of their own).
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import serve_runs

ROOT = pathlib.Path(__file__).resolve().parent.parent
TAIL_COLOCATED, TAIL_PD, GOODPUT_RATIO = 3.0, 1.5, 1.5
ENGINE_ENV = {"DUET_PREFILL_THREAD": "1", "DUET_DECODE_THREAD": "1", "DUET_DECODE_BUCKET_STEP": "32"}


def numbers(text, what):
    """'3.5,4' -> [3.5, 4.0]; a clear exit on anything else."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sys.exit(f"scan-targets.py: --{what} takes numbers separated by commas, got '{text}'")
    if not values or any(v < 0 for v in values) or (what == "rates" and 0 in values):
        sys.exit(f"scan-targets.py: --{what} needs at least one {'positive' if what == 'rates' else 'non-negative'} number, got '{text}'")
    return values


def simulate(args, config, start, rate):
    """The run summary of one deployment on one window: goodput, SLO share, ITL P50 and P99."""
    with tempfile.TemporaryDirectory() as folder:
        argv = [args.duet] + serve_runs.sim_argv(config, args.trace, f"{start:g}", round(args.replay_seconds * rate),
                                                 f"{rate:g}", args.calibration, pathlib.Path(folder) / "out",
                                                 args.speed_spread)
        done = subprocess.run(argv, env=dict(os.environ, **ENGINE_ENV), capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            sys.exit(f"scan-targets.py: duet sim failed on {config} at {start:g} s x{rate:g}: {done.stderr.strip()[-400:]}")
        summary = json.loads((pathlib.Path(folder) / "out/summary.json").read_text())
        run = summary["runs"][0]["summary"]
        band = summary["simulation"]["runs"][0].get("speed_band")
        if band:
            run["goodput_faster"], run["goodput_slower"] = band["faster"]["goodput"], band["slower"]["goodput"]
        return run


def cell(summary):
    """'10.65 (66 %) 3.26': goodput, share within the SLO, ITL P99/P50."""
    itl = summary["itl_s"]
    return f"{summary['goodput_rps']:.2f} ({summary['slo_attainment'] * 100:.0f} %) {itl['p99'] / itl['p50']:.2f}"


def ratio_text(pd, colocated):
    """'1.62×' (inf where colocated serves nothing within the SLO)."""
    return f"{pd / colocated:.2f}×" if colocated else "inf"


def verdict(colocated, pd):
    """Which targets the load meets, by the simulator: 'both', 'tail', 'goodput' or '–'."""
    ratio = lambda s: s["itl_s"]["p99"] / s["itl_s"]["p50"]
    tail = ratio(colocated) > TAIL_COLOCATED and ratio(pd) <= TAIL_PD
    goodput = pd["goodput_rps"] >= GOODPUT_RATIO * colocated["goodput_rps"]
    return "both" if tail and goodput else "tail" if tail else "goodput" if goodput else "–"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--colocated", required=True, help="the colocated deployment file")
    ap.add_argument("--pd", required=True, help="the PD deployment file")
    ap.add_argument("--calibration", required=True, help="a calibration TOML")
    ap.add_argument("--starts", default="0", help="window starts in trace seconds, comma separated")
    ap.add_argument("--rates", required=True, help="rate scales, comma separated")
    ap.add_argument("--speed-spread", type=float, default=0.04,
                    help="colocated this much faster and PD this much slower for the worst-case ratio (0: none)")
    ap.add_argument("--replay-seconds", type=float, default=42, help="seconds of scaled replay per window")
    ap.add_argument("--trace", default=str(ROOT.parent / "shared/traces/AzureLLMInferenceTrace_conv_2023.csv"))
    ap.add_argument("--duet", default=os.environ.get("DUET_BIN", str(ROOT / "build/duet")))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    starts, rates = numbers(args.starts, "starts"), numbers(args.rates, "rates")
    if not 0 <= args.speed_spread <= 0.5:  # duet sim's range
        sys.exit(f"scan-targets.py: --speed-spread takes 0 to 0.5, got {args.speed_spread:g}")
    for path in (args.colocated, args.pd, args.calibration):
        if pathlib.Path(path).suffix != ".toml" or not pathlib.Path(path).is_file():
            sys.exit(f"scan-targets.py: {path} is not a .toml file")
    if not pathlib.Path(args.trace).is_file():
        sys.exit(f"scan-targets.py: no trace at {args.trace}")
    loads = [(s, r) for s in starts for r in rates]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = {(s, r, kind): pool.submit(simulate, args, config, s, r)
                for s, r in loads for kind, config in (("colocated", args.colocated), ("pd", args.pd))}
        spread = f"{args.speed_spread * 100:g} %"
        print("| window start s | rate | colocated goodput (SLO met) ITL P99/P50 | PD goodput (SLO met) ITL P99/P50 "
              f"| PD / colocated goodput | the same, colocated {spread} faster, PD {spread} slower | targets |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
        for s, r in loads:
            colocated, pd = runs[(s, r, "colocated")].result(), runs[(s, r, "pd")].result()
            worst = (ratio_text(pd["goodput_slower"], colocated["goodput_faster"]) if "goodput_faster" in colocated
                     else "–")
            print(f"| {s:g} | ×{r:g} | {cell(colocated)} | {cell(pd)} | {ratio_text(pd['goodput_rps'], colocated['goodput_rps'])} "
                  f"| {worst} | {verdict(colocated, pd)} |", flush=True)


if __name__ == "__main__":
    main()
