#!/usr/bin/env python3
"""Fit calibration keys of engines on streams of their own (PD streams) to H200 serving runs.

Each grid point is the base calibration with some keys replaced; every run named is simulated
with it (`duet sim`, the run's deployment TOML and trace window as scripts/resim-serve.sh has
them), and the point is scored against the live figures: TTFT and ITL P50/P99 (how many miss by more
than 15 %, the worst, their root mean square) and the mean prefill and decode steps
(prefill.hop_step, decode.hop_step: the worst; with --score-steps they count in the RMS too).
Points sort by misses, then RMS. No GPU needed; ~0.5 s per run and point (three times that
with --speed-spread, which also counts the misses whose live figure lies outside the range the
simulator gives with the engine that much slower and faster: lent machines differ by a few
per cent, and near a prefill-bound load TTFT moves many times as much).

  scripts/fit-concurrency.py --base config/calibration-duet/h200-cuda-engine-2026-12-03.toml \\
      --runs docs/data/h200-serve-2026-12-03e/conv4-pd-streams-b256-c512 ... \\
      --grid 'concurrent_prefill_yield_scale=[[512,1.5],[2048,1]],[[512,1.7],[2048,1]]' \\
      --grid 'concurrent_decode_delay_scale=[[1024,0.7],[2048,1]]'

Each --grid gives one key and its candidate values (TOML values, separated by ",,"; a value
"-" leaves the key out); the points are their product. Prints one row per point, best first,
and with --detail the runs of the best point.

--leave-one-out asks how far the fit carries to a run it has not seen: for each run in turn the
point that scores best on the other runs is picked, and the held-out run's figures at that point
are kept. Their misses, against the in-sample best point's on the same runs, estimate what a
prediction made before a run misses by. Runs of one deployment repeated (names ending -rep-...)
still leak into each other's fits.
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from calibration_grid import grid_points, with_keys
from serve_runs import sim_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURES = (("ttft_s", "p50"), ("ttft_s", "p99"), ("itl_s", "p50"), ("itl_s", "p99"))


def simulate(duet, traces, run, cal_file, out_dir, spread=0.0):
    run = pathlib.Path(run)
    out = pathlib.Path(out_dir) / run.parent.name / run.name
    argv, env = sim_command(run, duet, traces, cal_file, out, spread)
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    sim = summary["runs"][0]
    live = json.loads(run.with_suffix(".json").read_text())
    band = summary["simulation"]["runs"][0].get("speed_band")
    misses, outside = {}, {}
    for key, q in FIGURES:
        name, measured = f"{key[:-2]} {q}", live["runs"][0]["summary"][key][q]
        misses[name] = sim["summary"][key][q] / measured - 1
        if band:
            ends = sorted(band[side][f"{key[:-2]}_{q}_s"] for side in ("faster", "slower"))
            outside[name] = not ends[0] <= measured <= ends[1]
    c = summary["simulation"]["runs"][0]["counters"]
    for role in ("prefill", "decode"):
        live_step = live["bench"].get("ttft_hops", {}).get(f"{role}.hop_step", 0)
        sim_step = c.get(f"{role}.hop_step_us", 0) / 1e3 / max(c.get(f"{role}.hop_step_count", 0), 1)
        if live_step > 0:
            misses[f"{role} step"] = sim_step / live_step - 1
    return str(run.relative_to(ROOT) if run.is_absolute() else run), (misses, outside)


def score(runs, names, score_steps):
    """Misses over 15 %, worst and RMS of the figures (and with score_steps the steps) of runs."""
    figures = [m for r in names for k, m in runs[r].items() if not k.endswith("step")]
    steps = [abs(m) for r in names for k, m in runs[r].items() if k.endswith("step")]
    scored = figures + (steps if score_steps else [])
    rms = (sum(m * m for m in scored) / len(scored)) ** 0.5
    return sum(abs(m) > 0.15 for m in figures), max(abs(m) for m in figures), rms


def leave_one_out(rows, score_steps):
    """Each run scored at the point that fits the other runs best (rows as main() keeps them)."""
    names = list(rows[0][3])
    held, moved = {}, 0
    print()
    print("| held-out run | point fitted on the others | ttft p50 | ttft p99 | itl p50 | itl p99 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for run in names:
        others = [r for r in names if r != run]

        def fit_on_others(row):
            over, _, rms = score(row[3], others, score_steps)
            return over, rms

        picked = min(rows, key=fit_on_others)
        keys, runs = picked[2], picked[3]
        held[run] = runs[run]
        moved += picked is not rows[0]
        shown = ("the in-sample best" if picked is rows[0]
                 else "; ".join(f"{k} = {v}" for k, v in keys.items()) or "base")
        print(f"| {run} | {shown} | " + " | ".join(f"{runs[run][f'{k[:-2]} {q}'] * 100:+.0f} %"
                                                 for k, q in FIGURES) + " |")
    over, worst, rms = score(held, names, score_steps)
    over_in, worst_in, rms_in = score(rows[0][3], names, score_steps)
    print()
    print(f"held out: {over} of {len(names) * 4} figures over 15 %, worst {worst * 100:.0f} %, RMS {rms * 100:.1f} %"
          f" (the in-sample best point: {over_in}, {worst_in * 100:.0f} %, {rms_in * 100:.1f} %);"
          f" {moved} of {len(names)} runs left out moved the fit")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--runs", nargs="+", required=True, help="run paths without .toml/.json")
    ap.add_argument("--grid", action="append", default=[], help="KEY=V1,,V2,,...")
    ap.add_argument("--duet", default=os.environ.get("DUET_BIN", str(ROOT / "build/duet")))
    ap.add_argument("--traces", default=os.environ.get("DUET_TRACES", str(ROOT.parent / "shared/traces")))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--detail", action="store_true", help="print every run of the best point")
    ap.add_argument("--score-steps", action="store_true",
                    help="the RMS also counts the mean prefill and decode step of every run")
    ap.add_argument("--leave-one-out", action="store_true",
                    help="score each run at the point fitted on the other runs")
    ap.add_argument("--speed-spread", type=float, default=0.0, metavar="F",
                    help="also count the misses over 15 %% whose live figure is outside the "
                         "simulated range with the engine F slower and faster (duet sim --speed-spread)")
    args = ap.parse_args()
    base = pathlib.Path(args.base).read_text()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for i, point in enumerate(grid_points(args.grid)):
            keys = dict(point)
            cal = pathlib.Path(tmp) / f"point{i}.toml"
            cal.write_text(with_keys(base, keys))
            jobs = [pool.submit(simulate, args.duet, args.traces, r, str(cal), f"{tmp}/out{i}",
                                args.speed_spread) for r in args.runs]
            results = dict(f.result() for f in jobs)
            runs = {r: m for r, (m, _) in results.items()}
            over, worst, rms = score(runs, runs, args.score_steps)
            over_band = sum(abs(runs[r][k]) > 0.15 and out for r, (_, o) in results.items()
                            for k, out in o.items())
            steps = [abs(m) for r in runs.values() for k, m in r.items() if k.endswith("step")]
            rows.append((over, worst, keys, runs, max(steps, default=0), rms, over_band))
            if sys.stderr.isatty():
                print(f"\rpoint {i + 1}", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    rows.sort(key=lambda r: (r[0], r[5]))
    spread = f" | of them outside ±{args.speed_spread * 100:g} %" if args.speed_spread else ""
    print(f"| keys | over 15 % (of {len(args.runs) * 4}){spread} | worst | RMS | worst step |")
    print("| --- | --- |" + (" --- |" if spread else "") + " --- | --- | --- |")
    for over, worst, keys, _, step, rms, over_band in rows:
        shown = "; ".join(f"{k} = {v}" for k, v in keys.items()) or "base"
        band = f" {over_band} |" if spread else ""
        print(f"| {shown} | {over} |{band} {worst * 100:.0f} % | {rms * 100:.1f} % | {step * 100:.0f} % |")
    if args.detail:
        _, _, keys, runs, _, _, _ = rows[0]
        names = list(next(iter(runs.values())).keys())
        print()
        print("| run | " + " | ".join(names) + " |")
        print("| --- |" + " --- |" * len(names))
        for run, misses in runs.items():
            print(f"| {run} | " + " | ".join(f"{misses.get(n, float('nan')) * 100:+.0f} %" for n in names) + " |")
    if args.leave_one_out:
        leave_one_out(rows, args.score_steps)


if __name__ == "__main__":
    main()
