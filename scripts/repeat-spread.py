#!/usr/bin/env python3
"""How far a live H200 serving run reproduces: every pair of runs in the folders given that
replayed the same trace window on the same deployment (identical TOML, the window its name
gives, and the same decode graphs: scripts/serve_runs.py), and how far apart their
TTFT and ITL P50/P99 and mean prefill and decode steps came out. The simulator's misses
(scripts/fit-concurrency.py, scripts/resim-serve.sh) read against this: a figure the live
runs themselves reproduce only to 20 % cannot be held to 15 % by any model.

  scripts/repeat-spread.py docs/data/h200-serve-2026-12-0{3d,3e,3f,3g,3h,3j,4,4b,4c,5,5b}

Prints one row per pair (the second run against the first, in folder order) and the largest
difference of each figure over the pairs.
"""
import collections
import itertools
import json
import pathlib
import sys

from serve_runs import bucket_step, window

FIGURES = (("ttft_s", "p50"), ("ttft_s", "p99"), ("itl_s", "p50"), ("itl_s", "p99"))
STEPS = ("prefill.hop_step", "decode.hop_step")


def figures(run):
    """TTFT/ITL P50/P99 and the mean steps of a run's bench JSON (steps absent: None)."""
    live = json.loads(run.with_suffix(".json").read_text())
    summary = live["runs"][0]["summary"]
    hops = live.get("bench", {}).get("ttft_hops", {})
    return [summary[k][q] for k, q in FIGURES] + [hops.get(s) or None for s in STEPS]


def deployment_key(run):
    """Runs with equal keys replayed the same window on the same deployment and decode graphs."""
    return tuple(window(run.name)), bucket_step(run), run.with_suffix(".toml").read_text()


def main(folders):
    groups = collections.defaultdict(list)
    for folder in folders:
        for toml in sorted(pathlib.Path(folder).glob("*.toml")):
            if toml.with_suffix(".json").exists():
                groups[deployment_key(toml.with_suffix(""))].append(toml.with_suffix(""))
    names = [f"{k[:-2].upper()} {q.upper()}" for k, q in FIGURES] + ["prefill step", "decode step"]
    print("| first run | again | " + " | ".join(names) + " |")
    print("| --- | --- |" + " --- |" * len(names))
    largest = [0.0] * len(names)
    for runs in groups.values():
        for a, b in itertools.combinations(runs, 2):
            cells = []
            for i, (x, y) in enumerate(zip(figures(a), figures(b))):
                if not x or not y:
                    cells.append("–")
                    continue
                largest[i] = max(largest[i], abs(y / x - 1))
                cells.append(f"{(y / x - 1) * 100:+.0f} %")
            print(f"| {a.parent.name}/{a.name} | {b.parent.name}/{b.name} | " + " | ".join(cells) + " |")
    print("| largest | | " + " | ".join(f"{v * 100:.0f} %" for v in largest) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
