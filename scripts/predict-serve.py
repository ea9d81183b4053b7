#!/usr/bin/env python3
"""The simulator's prediction of serving runs before they run: each deployment file given (a
stored run's NAME.toml, whose name gives its trace window: scripts/serve_runs.py) through
`duet sim` with each calibration, the engine also 3 % slower and faster, as the rows of a
predictions table (docs/data/*/predictions.md).

  scripts/predict-serve.py docs/data/h100-serve-conv4s900-2026-12-07/conv4s900-pd-reserve70-b256-c1024-fd-42s.toml \\
      --calibration config/calibration-duet/h100-cuda-engine-2026-12-07f.toml \\
      --calibration config/calibration-duet/h100-cuda-engine-2026-12-07e.toml

One row per deployment and calibration (the run's name on its first row): calibration, TTFT P50 /
P99 ms, TTFT P99 at the speed spread, ITL P50 / P99 ms, ITL P99/P50, goodput req/s (share of
requests within the SLO). The SLO is issue 9's: TTFT <= 2 s, TPOT <= 50 ms.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import serve_runs

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ("| run | calibration | TTFT P50 / P99 ms | TTFT P99 at ±{spread} % speed | ITL P50 / P99 ms | "
          "ITL P99/P50 | goodput req/s (SLO met) |\n| --- | --- | --- | --- | --- | --- | --- |")


def label(calibration):
    """'12-07f' for .../h100-cuda-engine-2026-12-07f.toml; the file's stem otherwise."""
    stem = pathlib.Path(calibration).stem
    parts = stem.rsplit("-2026-", 1)
    return parts[1] if len(parts) == 2 else stem


def simulate(toml, calibration, args, folder):
    """`duet sim` of one deployment with one calibration; its summary.json as a dict."""
    out = pathlib.Path(folder) / "out"
    argv, env = serve_runs.sim_command(toml.with_suffix(""), args.duet, args.traces, calibration, out, args.spread)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"predict-serve.py: duet sim failed on {toml}: {done.stderr.strip()[-400:]}")
    return json.loads((out / "summary.json").read_text())


def row(name, calibration, summary):
    """One table row of a simulated run."""
    s = summary["runs"][0]["summary"]
    band = summary["simulation"]["runs"][0].get("speed_band")
    ttft, itl = s["ttft_s"], s["itl_s"]
    spread = (f"{band['faster']['ttft_p99_s'] * 1e3:.0f}–{band['slower']['ttft_p99_s'] * 1e3:.0f}"
              if band else "–")
    return (f"| {name} | {label(calibration)} | {ttft['p50'] * 1e3:.0f} / {ttft['p99'] * 1e3:.0f} | {spread} | "
            f"{itl['p50'] * 1e3:.1f} / {itl['p99'] * 1e3:.1f} | {itl['p99'] / itl['p50']:.2f} | "
            f"{s['goodput_rps']:.2f} ({s['slo_attainment'] * 100:.0f} %) |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("deployments", nargs="+", help="NAME.toml files of runs to predict")
    ap.add_argument("--calibration", action="append", required=True,
                    help="a calibration TOML; give several for one row each")
    ap.add_argument("--spread", type=float, default=0.03, help="engine speed spread (0: none)")
    ap.add_argument("--duet", default=os.environ.get("DUET_BIN", str(ROOT / "build/duet")))
    ap.add_argument("--traces", default=os.environ.get("DUET_TRACES", str(ROOT.parent / "shared/traces")))
    args = ap.parse_args()
    for path in args.deployments + args.calibration:
        if pathlib.Path(path).suffix != ".toml" or not pathlib.Path(path).is_file():
            sys.exit(f"predict-serve.py: {path} is not a .toml file")
    for deployment in args.deployments:
        serve_runs.window(pathlib.Path(deployment).stem)  # exits naming a run with no known window
    print(HEADER.format(spread=f"{args.spread * 100:g}"))
    for deployment in args.deployments:
        toml = pathlib.Path(deployment)
        for i, calibration in enumerate(args.calibration):
            with tempfile.TemporaryDirectory() as folder:
                print(row(toml.stem if i == 0 else "", calibration, simulate(toml, calibration, args, folder)), flush=True)


if __name__ == "__main__":
    main()
