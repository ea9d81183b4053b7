#!/usr/bin/env python3
"""Fit the prefill keys of a calibration to prefill steps timed by composition on the GPU.

The measured side is `duet bench engine --prefill-mix ... --sm-share S --json` on the GPU
machine (scripts/gpu-prefill-mix.sh: one JSON per share). Each grid point is the base
calibration with some keys replaced; for every share it prices the same rows with
`duet bench engine --engine sim` (the simulator's cost model, as `duet sim` prices a step) and
scores the point by the rows' errors: how many miss by more than 10 %, the worst, and their
root mean square. Points sort by RMS. No GPU needed; milliseconds per point and share.

  scripts/fit-prefill-mix.py --base config/calibration-duet/h200-cuda-engine-2026-12-04b.toml \\
      --measured docs/data/h200-prefill-mix-2026-12-05 \\
      --grid 'attention=[[1024,0.35],[8192,0.5]],,[[1024,0.3],[8192,0.55]]' --detail

Each --grid gives one key and its candidate values (TOML values, separated by ",,"; a value
"-" leaves the key out); the points are their product. With --detail, the best point's rows
print as a table of measured and priced milliseconds per share.
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
MISS = 0.10


def measured_runs(folder):
    """{share: {mix: median ms}} from every JSON of prefill-mix rows in `folder`."""
    runs = {}
    for f in sorted(pathlib.Path(folder).glob("*.json")):
        j = json.loads(f.read_text())
        rows = {r["mix"]: r["ms_median"] for r in j.get("rows", []) if r.get("kind") == "prefill_mix"}
        if rows:  # files at one share add up (a mix in two files: the later one's time)
            runs.setdefault(float(j.get("sm_share", 1.0)), {}).update(rows)
    if not runs:
        raise SystemExit(f"fit-prefill-mix: no prefill_mix rows in {folder}/*.json")
    return runs


def price(duet, model, cal_file, share, mixes, out_file):
    """{mix: priced ms} for the rows at this share."""
    subprocess.run([duet, "bench", "engine", "--engine", "sim", "--model", model, "--calibration", str(cal_file),
                    "--sm-share", str(share), "--prefill-mix", ",".join(mixes), "--repeats", "1",
                    "--json", str(out_file)], check=True, stdout=subprocess.DEVNULL)
    j = json.loads(pathlib.Path(out_file).read_text())
    return {r["mix"]: r["ms_median"] for r in j["rows"]}


def score(errors):
    values = [e for per_share in errors.values() for e in per_share.values()]
    rms = (sum(e * e for e in values) / len(values)) ** 0.5
    return sum(abs(e) > MISS for e in values), max(abs(e) for e in values), rms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="calibration TOML the points start from")
    ap.add_argument("--measured", required=True, help="folder of `duet bench engine --prefill-mix` JSON files")
    ap.add_argument("--model", default="r1-distill-llama-8b", help="model preset the rows ran on")
    ap.add_argument("--grid", action="append", default=[], help="KEY=V1,,V2,,...")
    ap.add_argument("--duet", default=os.environ.get("DUET_BIN", str(ROOT / "build/duet")))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--top", type=int, default=10, help="points printed")
    ap.add_argument("--detail", action="store_true", help="print the best point's rows")
    args = ap.parse_args()
    runs = measured_runs(args.measured)
    base = pathlib.Path(args.base).read_text()
    points = grid_points(args.grid)
    results = []
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        def evaluate(i, point):
            cal = pathlib.Path(tmp) / f"point{i}.toml"
            cal.write_text(with_keys(base, dict(point)))
            priced = {s: price(args.duet, args.model, cal, s, list(rows), f"{tmp}/p{i}-{s}.json")
                      for s, rows in runs.items()}
            errors = {s: {m: priced[s][m] / ms - 1 for m, ms in rows.items()} for s, rows in runs.items()}
            return dict(point), priced, errors

        futures = [pool.submit(evaluate, i, p) for i, p in enumerate(points)]
        for n, f in enumerate(concurrent.futures.as_completed(futures), 1):
            results.append(f.result())
            if sys.stderr.isatty():
                print(f"\rpoint {n} of {len(points)}", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    results.sort(key=lambda r: score(r[2])[2])
    rows_total = sum(len(r) for r in runs.values())
    print(f"| keys | over {MISS * 100:.0f} % (of {rows_total}) | worst | RMS |")
    print("| --- | --- | --- | --- |")
    for keys, _, errors in results[:args.top]:
        over, worst, rms = score(errors)
        shown = "; ".join(f"{k} = {v}" for k, v in keys.items()) or "base"
        print(f"| {shown} | {over} | {worst * 100:.0f} % | {rms * 100:.1f} % |")
    if args.detail:
        _, priced, errors = results[0]
        shares = sorted(runs, reverse=True)
        print()
        print("| mix | " + " | ".join(f"share {s:g}: measured / priced ms" for s in shares) + " |")
        print("| --- |" + " --- |" * len(shares))
        for mix in runs[shares[0]]:
            cells = [f"{runs[s][mix]:.2f} / {priced[s][mix]:.2f} ({errors[s][mix] * 100:+.0f} %)"
                     if mix in runs[s] else "" for s in shares]
            print(f"| {mix} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
