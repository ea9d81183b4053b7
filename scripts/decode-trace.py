#!/usr/bin/env python3
"""Stage times of the one-kernel batch-1 decode step (kernels/decode_layers.cu) from its barrier
trace: `DUET_DECODE_TRACE=PREFIX` makes the CUDA engine write PREFIX.<context>.csv (one line per
barrier and CTA: the CTA's start, its arrival at the barrier and its release, in GPU global-timer
ns). Per stage kind, averaged over the layers: the mean and slowest CTA's work (release of the
barrier before to arrival), the span from the first release to the last arrival, and the time
from the last arrival to the last release.

  scripts/decode-trace.py docs/data/h100-decode-layers-2026-12-06/call2-trace.1024.csv.gz
"""
import collections
import csv
import gzip
import sys

STAGES = ["norm + QKV GEMV", "attention", "o GEMV", "norm + gate/up GEMV", "down GEMV"]


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return list(csv.DictReader(f))


def report(path):
    rows = load(path)
    arrive = collections.defaultdict(dict)
    release = collections.defaultdict(dict)
    start = {}
    for r in rows:
        b, c = int(r["barrier"]), int(r["cta"])
        arrive[b][c] = int(r["arrive_ns"])
        release[b][c] = int(r["release_ns"])
        start[c] = int(r["start_ns"])
    barriers = max(arrive) + 1
    sums = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    before = dict(start)
    for b in range(barriers):
        work = [arrive[b][c] - before[c] for c in arrive[b]]
        last_arrival = max(arrive[b].values())
        s = sums[STAGES[b % len(STAGES)]]
        s[0] += 1
        s[1] += sum(work) / len(work)
        s[2] += max(work)
        s[3] += last_arrival - min(before.values())
        s[4] += max(release[b].values()) - last_arrival
        before = release[b]
    total = max(release[barriers - 1].values()) - min(start.values())
    print(f"{path}: {barriers} barriers, {len(start)} CTAs, {total / 1e3:.0f} us to the last release")
    print("| stage | mean CTA us | slowest CTA us | span us | last arrival to release us |")
    print("| --- | --- | --- | --- | --- |")
    for name in STAGES:
        n, mean, worst, span, rel = sums[name]
        if n:
            print(f"| {name} | {mean / n / 1e3:.1f} | {worst / n / 1e3:.1f} | {span / n / 1e3:.1f} | {rel / n / 1e3:.1f} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        report(p)
