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
  compare-steps.py beside RUN --calibration CAL [--duet BIN] [--traces DIR]
      A stored serving run's decode steps (RUN.steps.*decode*.csv.gz, after RUN.replay-start-ms)
      by rows, alone and beside a prefill step (one ran for more than half the decode step's
      wall), live (engine time) and simulated with CAL on the run's deployment and window (wall:
      the simulator's delays beside prefill are in it); the delay is beside minus alone.
  compare-steps.py prefill-loss RUN... --calibration CAL [--model PRESET] [--duet BIN]
      What the live prefill steps of stored runs lost beside decode: each step's engine time
      minus its mix priced alone (`duet bench engine --engine sim`), fitted by least squares to
      the decode time overlapping it (d), the decode steps overlapping it (n) and d x their rows;
      then what the d, d x rows fit leaves, by the step's prior context.
  compare-steps.py lone RUN... --calibration CAL [--model PRESET] [--duet BIN]
      The decode steps of stored runs that no prefill step overlapped at all, each against the
      same step (rows, context per row to 64 tokens) priced alone on the decode worker's SMs (the
      green context of its sm_share, named in RUN.up.log, or the whole GPU) by `duet bench engine
      --engine sim --sm-share`: live and priced means by band of rows, per run, and the RMS of
      log(priced / live) over every step of 9+ rows.
"""
import argparse
import bisect
import csv
import gzip
import json
import math
import os
import re
import pathlib
import statistics
import subprocess
import sys
import tempfile
import tomllib

import serve_runs

BANDS = ((1, 256), (257, 512), (513, 1024), (1025, 2048), (2049, 1 << 30))


def steps(files, role, after_ms):
    out = []
    for f in files:
        with (gzip.open if str(f).endswith(".gz") else open)(f, "rt", newline="") as fh:
            for row in csv.DictReader(fh):
                if row["role"] != role or int(row["begin_ms"]) < after_ms:
                    continue
                out.append({"begin_ms": int(row["begin_ms"]), "end_ms": int(row["end_ms"]),
                            "wall_ms": int(row["end_ms"]) - int(row["begin_ms"]),
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


ROW_BANDS = ((1, 1), (2, 3), (4, 8), (9, 32), (33, 96), (97, 160), (161, 256))


def by_neighbour(decode, prefill, value):
    """{(row band, beside): [value(step)]}: beside when prefill steps overlap more than half the
    decode step's wall."""
    prefill = sorted(prefill, key=lambda p: p["begin_ms"])
    starts = [p["begin_ms"] for p in prefill]
    out = {}
    for d in decode:
        i = bisect.bisect_right(starts, d["end_ms"]) - 1
        overlap = 0
        for p in prefill[max(0, i - 4):i + 1]:
            overlap += max(0, min(d["end_ms"], p["end_ms"]) - max(d["begin_ms"], p["begin_ms"]))
        band = next((b for b in ROW_BANDS if b[0] <= d["sequences"] <= b[1]), None)
        if band:
            out.setdefault((band, 2 * overlap > max(d["wall_ms"], 1)), []).append(value(d))
    return out


def simulate(run, calibration, duet, traces, folder):
    """The run's deployment and window through `duet sim` with step logs; their files."""
    argv, env = serve_runs.sim_command(run, duet, traces, calibration, f"{folder}/out")
    env["DUET_STEP_LOG"] = f"{folder}/s"
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    return sorted(pathlib.Path(folder).glob("s.*decode*.csv")), sorted(pathlib.Path(folder).glob("s.*prefill*.csv"))


def beside(args):
    run = pathlib.Path(args.run)
    after = int(run.with_name(run.name + ".replay-start-ms").read_text())
    live_d = sorted(run.parent.glob(run.name + ".steps.*decode*.csv*"))
    live_p = sorted(run.parent.glob(run.name + ".steps.*prefill*.csv*"))
    if not live_d:
        sys.exit(f"compare-steps.py: {run} has no decode step log")
    live = by_neighbour(steps(live_d, "decode", after), steps(live_p, "prefill", after - 1000),
                        lambda d: d["engine_ms"])
    with tempfile.TemporaryDirectory() as folder:
        sim_d, sim_p = simulate(run, args.calibration, args.duet, args.traces, folder)
        sim = by_neighbour(steps(sim_d, "decode", 0), steps(sim_p, "prefill", 0), lambda d: d["wall_ms"])
    print("| rows | live steps alone / beside | live ms alone / beside | live delay | sim steps alone / beside | sim ms alone / beside | sim delay |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for b in ROW_BANDS:
        cells = []
        for side in (live, sim):
            alone, near = side.get((b, False), []), side.get((b, True), [])
            cells += [f"{len(alone)} / {len(near)}", f"{mean(alone):.1f} / {mean(near):.1f}",
                      f"{mean(near) - mean(alone):.1f}"]
        if any(side.get((b, True)) for side in (live, sim)):
            print(f"| {b[0]}-{b[1]} | " + " | ".join(cells) + " |")


def least_squares(rows, targets):
    """Coefficients c minimising |rows c - targets| (normal equations; a few columns)."""
    k = len(rows[0])
    m = [[sum(r[a] * r[b] for r in rows) for b in range(k)] + [sum(r[a] * t for r, t in zip(rows, targets))]
         for a in range(k)]
    for c in range(k):
        for other in range(k):
            if other != c:
                f = m[other][c] / m[c][c]
                m[other] = [x - f * y for x, y in zip(m[other], m[c])]
    return [m[c][k] / m[c][c] for c in range(k)]


def prefill_loss(args):
    samples = []  # (loss ms, overlapping decode ms, overlapping decode steps, decode ms x rows / 1000)
    for name in args.runs:
        run = pathlib.Path(name)
        after = int(run.with_name(run.name + ".replay-start-ms").read_text())
        prefill = steps(sorted(run.parent.glob(run.name + ".steps.*prefill*.csv*")), "prefill", after)
        decode = sorted(steps(sorted(run.parent.glob(run.name + ".steps.*decode*.csv*")), "decode", after - 2000),
                        key=lambda d: d["begin_ms"])
        with tempfile.TemporaryDirectory() as folder:
            out = pathlib.Path(folder) / "priced.json"
            subprocess.run([args.duet, "bench", "engine", "--engine", "sim", "--model", args.model,
                            "--calibration", args.calibration, "--prefill-mix", ",".join(sorted({p["mix"] for p in prefill})),
                            "--repeats", "1", "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
            priced = {r["mix"]: r["ms_median"] for r in json.loads(out.read_text())["rows"]}
        starts = [d["begin_ms"] for d in decode]
        for p in prefill:
            begin, end = p["begin_ms"], p["begin_ms"] + p["engine_ms"]
            overlap = count = row_ms = 0.0
            for d in decode[max(0, bisect.bisect_left(starts, begin - 1000)):bisect.bisect_right(starts, end)]:
                o = max(0.0, min(end, d["begin_ms"] + d["engine_ms"]) - max(begin, d["begin_ms"]))
                if o > 0:
                    overlap, count, row_ms = overlap + o, count + 1, row_ms + o * d["sequences"] / 1000
            samples.append((p["engine_ms"] - priced[p["mix"]], overlap, count, row_ms, p["context"], priced[p["mix"]]))
    loss = [s[0] for s in samples]
    average = mean(loss)
    print(f"{len(samples)} prefill steps; loss beside decode {average:.2f} ms on average, "
          f"standard deviation {statistics.pstdev(loss):.2f}")
    print("| fitted to | coefficients | RMS ms |")
    print("| --- | --- | --- |")
    for columns, label in (((1,), "d"), ((2,), "n"), ((1, 2), "d, n"), ((1, 3), "d, d x rows"), ((1, 2, 3), "d, n, d x rows")):
        rows = [[s[c] for c in columns] for s in samples]
        coef = least_squares(rows, loss)
        rms = (mean([(t - sum(a * b for a, b in zip(r, coef))) ** 2 for r, t in zip(rows, loss)])) ** 0.5
        print(f"| {label} | {', '.join(f'{c:.4g}' for c in coef)} | {rms:.2f} |")
    by_context(samples)


LONE_BANDS = ((9, 32), (33, 96), (97, 160), (161, 256))


def decode_share(run):
    """(share of the GPU's SMs, their count) the decode worker ran on: the green context of its
    configured sm_share named in the run's up.log, or the whole GPU without one."""
    config = tomllib.loads(run.with_name(run.name + ".toml").read_text())
    wanted = [a.get("sm_share", 1.0) for n in config.get("nodes", []) for a in n.get("actors", []) if a.get("role") == "decode"]
    if not wanted or wanted[0] >= 1.0:
        return 1.0, "all"
    text = run.with_name(run.name + ".up.log").read_text()
    for sms, total, share in re.findall(r"green context of (\d+) of (\d+) SMs \(sm_share ([\d.]+)\)", text):
        if abs(float(share) - wanted[0]) < 1e-6:
            return int(sms) / int(total), sms
    sys.exit(f"compare-steps.py: {run}.up.log names no green context of sm_share {wanted[0]}")


def lone_steps(run):
    """(rows, context per row to 64 tokens, engine ms) of the decode steps no prefill step overlapped."""
    after = int(run.with_name(run.name + ".replay-start-ms").read_text())
    prefill = steps(sorted(run.parent.glob(run.name + ".steps.*prefill*.csv*")), "prefill", after - 5000)
    spans = sorted((p["begin_ms"], p["end_ms"]) for p in prefill)
    starts = [a for a, _ in spans]
    out = []
    for d in steps(sorted(run.parent.glob(run.name + ".steps.*decode*.csv*")), "decode", after):
        i = bisect.bisect_right(starts, d["end_ms"] + 2)
        near = spans[max(0, i - 8):i]  # prefill steps do not overlap each other: the last few suffice
        if d["sequences"] >= 9 and not any(b > d["begin_ms"] - 2 and a < d["end_ms"] + 2 for a, b in near):
            out.append((d["sequences"], max(64, round(d["context"] / d["sequences"] / 64) * 64), d["engine_ms"]))
    return out


def price_decode(args, share, pairs):
    """{(rows, context per row): ms} from `duet bench engine --engine sim` on that share."""
    rows, contexts = sorted({r for r, _ in pairs}), sorted({c for _, c in pairs})
    priced = {}
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / "priced.json"
        for i in range(0, len(rows), 32):
            subprocess.run([args.duet, "bench", "engine", "--engine", "sim", "--model", args.model,
                            "--calibration", args.calibration, "--sm-share", f"{share:.6f}", "--prefill", "16",
                            "--repeats", "1", "--steps", "1", "--batch", ",".join(map(str, rows[i:i + 32])),
                            "--context", ",".join(map(str, contexts)), "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
            priced.update({(r["batch"], r["tokens"]): r["ms_median"]
                           for r in json.loads(out.read_text())["rows"] if r["kind"] == "decode"})
    return priced


def lone(args):
    logs = []
    print("| run | decode SMs | " + " | ".join(f"{lo}-{hi} rows: steps, live / priced ms" for lo, hi in LONE_BANDS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in LONE_BANDS) + " |")
    for name in args.runs:
        run = pathlib.Path(name)
        share, sms = decode_share(run)
        found = lone_steps(run)
        priced = price_decode(args, share, {(r, c) for r, c, _ in found})
        cells = []
        for lo, hi in LONE_BANDS:
            band = [(ms, priced[(r, c)]) for r, c, ms in found if lo <= r <= hi]
            cells.append(f"{len(band)}, {mean([a for a, _ in band]):.1f} / {mean([b for _, b in band]):.1f}" if band else "")
        logs += [math.log(priced[(r, c)] / ms) for r, c, ms in found if ms > 0]
        print(f"| {run.name} | {sms} ({share:.3f}) | " + " | ".join(cells) + " |")
    if logs:
        print(f"\n{len(logs)} steps; RMS of log(priced / live) {math.sqrt(mean([x * x for x in logs])) * 100:.1f} %, "
              f"mean {(math.exp(mean(logs)) - 1) * 100:+.1f} %")


# Prompt tokens already in KV before a prefill step (its longest prior context).
CONTEXT_BANDS = ((0, 0), (1, 2047), (2048, 8191), (8192, 1 << 30))


def by_context(samples):
    """What the (d, d x rows) fit leaves of each step, over its price alone, by prior context: where
    the loss beside decode is not the same for every prefill step."""
    coef = least_squares([[s[1], s[3]] for s in samples], [s[0] for s in samples])
    print("\n| prior context | steps | left after the d, d x rows fit, of the price alone: mean / median |")
    print("| --- | --- | --- |")
    for lo, hi in CONTEXT_BANDS:
        left = [(s[0] - coef[0] * s[1] - coef[1] * s[3]) / s[5] for s in samples if lo <= s[4] <= hi and s[5] > 0]
        if left:
            label = f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}"
            print(f"| {label} | {len(left)} | {mean(left) * 100:+.1f} / {statistics.median(left) * 100:+.1f} % |")


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
    root = pathlib.Path(__file__).resolve().parent.parent
    b = sub.add_parser("beside")
    b.add_argument("run", help="a stored serving run, without .toml")
    b.add_argument("--calibration", required=True)
    b.add_argument("--duet", default=os.environ.get("DUET_BIN", str(root / "build/duet")))
    b.add_argument("--traces", default=os.environ.get("DUET_TRACES", str(root.parent / "shared/traces")))
    pl = sub.add_parser("prefill-loss")
    pl.add_argument("runs", nargs="+", help="stored serving runs, without .toml")
    pl.add_argument("--calibration", required=True)
    pl.add_argument("--model", default="r1-distill-llama-8b", help="model preset the runs served")
    pl.add_argument("--duet", default=os.environ.get("DUET_BIN", str(root / "build/duet")))
    lo = sub.add_parser("lone")
    lo.add_argument("runs", nargs="+", help="stored serving runs, without .toml")
    lo.add_argument("--calibration", required=True)
    lo.add_argument("--model", default="r1-distill-llama-8b", help="model preset the runs served")
    lo.add_argument("--duet", default=os.environ.get("DUET_BIN", str(root / "build/duet")))
    args = ap.parse_args()
    if args.command == "lone":
        lone(args)
    elif args.command == "prefill-loss":
        prefill_loss(args)
    elif args.command == "beside":
        beside(args)
    elif args.command == "sample":
        prefill = steps(args.steps, "prefill", args.after)
        if not prefill:
            sys.exit("compare-steps.py: no prefill steps in the logs")
        print(",".join(sample(prefill, args.count)))
    else:
        report(args)


if __name__ == "__main__":
    main()
