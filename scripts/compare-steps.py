#!/usr/bin/env python3
"""Engine steps of a serving run one by one: live, alone on the GPU, priced by the simulator.

The step logs come from DUET_STEP_LOG (runtime/step_log.hpp; scripts/gpu-serve.sh writes them
with GPU_SERVE_STEP_LOG=1), one CSV per worker: role, begin_ms, end_ms, engine_us (live: the
engine call's wall time; simulated: its modelled time), sequences, tokens, context, mix.

  compare-steps.py sample STEPS.csv... [--after MS] [--count N]
      N prefill mixes of the logged steps, spread evenly over their token counts, joined by
      commas: the argument of `duet bench engine --prefill-mix` that times them alone.
  compare-steps.py report STEPS.csv... [--after MS] --measured BENCH.json --priced BENCH.json
      [--sim SIM_STEPS.csv...]
      Per sampled step: its live engine time, the same mix timed alone (--measured, `duet bench
      engine --engine cuda` on the GPU) and priced alone (--priced, `duet bench engine --engine
      sim` with the run's calibration); then by band of tokens: live / alone (what the other
      engine on the GPU added) and alone / priced (the cost model), and, with --sim, the
      simulated run's steps (virtual wall and modelled time) beside the live ones.
"""
import argparse
import csv
import json
import statistics
import sys

BANDS = ((1, 256), (257, 512), (513, 1024), (1025, 2048), (2049, 1 << 30))


def steps(files, role, after_ms):
    out = []
    for f in files:
        with open(f, newline="") as fh:
            for row in csv.DictReader(fh):
                if row["role"] != role or int(row["begin_ms"]) < after_ms:
                    continue
                out.append({"wall_ms": int(row["end_ms"]) - int(row["begin_ms"]),
                            "engine_ms": int(row["engine_us"]) / 1e3, "tokens": int(row["tokens"]),
                            "sequences": int(row["sequences"]), "context": int(row["context"]),
                            "mix": row["mix"]})
    return out


def band_of(tokens):
    return next(b for b in BANDS if b[0] <= tokens <= b[1])


def band_label(b):
    return f"{b[0]}+" if b[1] >= 1 << 30 else f"{b[0]}-{b[1]}"


def sample(prefill, count):
    """`count` distinct mixes spread over the steps sorted by tokens."""
    ordered = sorted(prefill, key=lambda s: (s["tokens"], s["mix"]))
    picked = []
    for i in range(count):
        s = ordered[min(len(ordered) - 1, round(i * (len(ordered) - 1) / max(count - 1, 1)))]
        if s["mix"] not in picked:
            picked.append(s["mix"])
    return picked


def bench_rows(path):
    return {r["mix"]: r["ms_median"] for r in json.load(open(path))["rows"] if r.get("kind") == "prefill_mix"}


def mean(values):
    return statistics.fmean(values) if values else float("nan")


def report(args):
    live = steps(args.steps, "prefill", args.after)
    measured, priced = bench_rows(args.measured), bench_rows(args.priced)
    by_mix = {}
    for s in live:
        by_mix.setdefault(s["mix"], []).append(s)
    rows = []
    for mix, alone in measured.items():
        if mix not in by_mix or mix not in priced:
            continue
        ms = statistics.median(s["engine_ms"] for s in by_mix[mix])
        rows.append((by_mix[mix][0]["tokens"], mix, ms, alone, priced[mix]))
    rows.sort()
    print("| step (chunks: tokens@cached) | tokens | live engine ms | alone ms | priced ms | live / alone | alone / priced |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for tokens, mix, ms, alone, p in rows:
        print(f"| {mix} | {tokens} | {ms:.2f} | {alone:.2f} | {p:.2f} | {ms / alone:.2f} | {alone / p:.2f} |")
    print()
    print("| tokens | sampled steps | live / alone (median) | alone / priced (median) |")
    print("| --- | --- | --- | --- |")
    for b in BANDS:
        inside = [r for r in rows if b[0] <= r[0] <= b[1]]
        if inside:
            print(f"| {band_label(b)} | {len(inside)} | {statistics.median(r[2] / r[3] for r in inside):.2f} | "
                  f"{statistics.median(r[3] / r[4] for r in inside):.2f} |")
    if args.sim:
        sim = steps(args.sim, "prefill", 0)
        print()
        print("| tokens | live steps | live wall ms | live engine ms | sim steps | sim wall ms | sim modelled ms |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for b in BANDS:
            lv = [s for s in live if band_of(s["tokens"]) == b]
            sv = [s for s in sim if band_of(s["tokens"]) == b]
            if lv or sv:
                print(f"| {band_label(b)} | {len(lv)} | {mean([s['wall_ms'] for s in lv]):.1f} | "
                      f"{mean([s['engine_ms'] for s in lv]):.1f} | {len(sv)} | {mean([s['wall_ms'] for s in sv]):.1f} | "
                      f"{mean([s['engine_ms'] for s in sv]):.1f} |")
        print(f"| all | {len(live)} | {mean([s['wall_ms'] for s in live]):.1f} | {mean([s['engine_ms'] for s in live]):.1f} | "
              f"{len(sim)} | {mean([s['wall_ms'] for s in sim]):.1f} | {mean([s['engine_ms'] for s in sim]):.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample")
    s.add_argument("steps", nargs="+")
    s.add_argument("--after", type=int, default=0, help="leave out steps that began before this (ms)")
    s.add_argument("--count", type=int, default=30)
    r = sub.add_parser("report")
    r.add_argument("steps", nargs="+")
    r.add_argument("--after", type=int, default=0)
    r.add_argument("--measured", required=True)
    r.add_argument("--priced", required=True)
    r.add_argument("--sim", nargs="*")
    args = ap.parse_args()
    if args.command == "sample":
        prefill = steps(args.steps, "prefill", args.after)
        if not prefill:
            sys.exit("compare-steps.py: no prefill steps in the logs")
        print(",".join(sample(prefill, args.count)))
    else:
        report(args)


if __name__ == "__main__":
    main()
