#!/usr/bin/env python3
"""scripts/compare-steps.py beside on stored serving runs: its live cells are recomputed here from
the run's step logs by a second, plain reading of them, and the simulated cells show what
docs/sim.md says of the one-row decode step beside a prefill step (12-07c / 12-07d). Exits 77
(skipped) without the Azure traces in ../shared/traces, non-zero on a mismatch.

    check_compare_steps_beside.py REPO_ROOT DUET
"""
import csv
import gzip
import pathlib
import re
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from expectations import expect, finish  # noqa: E402
from fidelity import arguments  # noqa: E402

root, duet, traces = arguments()
calibrations = root / "config/calibration-duet"


def beside(run, calibration):
    """{rows band: (live alone, live beside, live delay, sim alone, sim beside, sim delay)} in ms."""
    out = subprocess.run([sys.executable, str(root / "scripts/compare-steps.py"), "beside", str(run),
                          "--calibration", str(calibrations / calibration), "--duet", duet, "--traces", str(traces)],
                         capture_output=True, text=True, timeout=600)
    expect(f"compare-steps.py beside {run.name} exits 0 ({out.stderr.strip()[-200:]})", out.returncode == 0)
    table = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\| (\d+-\d+) \| \d+ / \d+ \| (\S+) / (\S+) \| (\S+) \| \d+ / \d+ \| (\S+) / (\S+) \| (\S+) \|$", line)
        if m:
            table[m.group(1)] = [float(v) for v in m.groups()[1:]]
    return table


def live_means(run, rows):
    """Mean engine ms of the run's decode steps of `rows` rows after the replay began, alone and
    beside a prefill step (overlapping more than half the step's wall), read plainly."""
    start = int(run.with_name(run.name + ".replay-start-ms").read_text())

    def read(role):
        (path,) = run.parent.glob(f"{run.name}.steps.*{role}*.csv.gz")
        with gzip.open(path, "rt") as f:
            return [r for r in csv.DictReader(f) if int(r["begin_ms"]) >= start - (1000 if role == "prefill" else 0)]

    prefill = [(int(p["begin_ms"]), int(p["end_ms"])) for p in read("prefill")]
    alone, near = [], []
    for d in read("decode"):
        if not rows[0] <= int(d["sequences"]) <= rows[1]:
            continue
        b, e = int(d["begin_ms"]), int(d["end_ms"])
        overlap = sum(max(0, min(e, pe) - max(b, pb)) for pb, pe in prefill)
        (near if 2 * overlap > max(e - b, 1) else alone).append(int(d["engine_us"]) / 1e3)
    return statistics.fmean(alone), statistics.fmean(near)


h100 = root / "docs/data/h100-serve-fixed-2026-12-06/code1-pd-streams-b256-c1024-fd"
h200 = root / "docs/data/h200-serve-2026-12-06q/code1-pd-streams-b256-c1024-fd"
for run, old, new in ((h100, "h100-cuda-engine-2026-12-07.toml", "h100-cuda-engine-2026-12-07d.toml"),
                      (h200, "h200-cuda-engine-2026-12-07b.toml", "h200-cuda-engine-2026-12-07c.toml")):
    before, after = beside(run, old), beside(run, new)
    for band, rows in (("1-1", (1, 1)), ("4-8", (4, 8))):
        alone, near = live_means(run, rows)
        got = before[band][:2]
        expect(f"{run.parent.name}/{run.name} rows {band}: live alone / beside {got} = {alone:.1f} / {near:.1f}",
               [round(alone, 1), round(near, 1)] == got)
    one, more = before["1-1"][2], before["4-8"][2]
    expect(f"{run.name} on {run.parent.name[:4]}: live, one row waits under half what 4-8 rows wait beside "
           f"prefill ({one} against {more} ms)", one < 0.5 * more)
    expect(f"{old} prices the one-row wait over 1.5x the live one ({before['1-1'][5]} against {one} ms), "
           f"{new} within 30 % ({after['1-1'][5]})",
           before["1-1"][5] > 1.5 * one and abs(after["1-1"][5] - one) <= 0.3 * one)
# prefill-loss: on five H100 PD-streams runs the live prefill step's loss beside decode follows the
# decode rows overlapping it better than the decode time alone (docs/sim.md, 12-07e).
d = root / "docs/data"
loss_runs = [d / "h100-serve-fixed-2026-12-06" / f"{w}-pd-streams-b256-c1024-fd-42s" for w in ("conv4", "conv5")]
loss_runs += [d / "h100-serve-fixed-2026-12-06/code1-pd-streams-b256-c1024-fd"]
loss_runs += [d / "h100-serve-conv45s300-2026-12-07" / f"conv45s300-pd-streams-b256-c{c}-fd-42s" for c in (1024, 768)]
out = subprocess.run([sys.executable, str(root / "scripts/compare-steps.py"), "prefill-loss", *map(str, loss_runs),
                      "--calibration", str(calibrations / "h100-cuda-engine-2026-12-07d.toml"), "--duet", duet],
                     capture_output=True, text=True, timeout=600)
fits = dict(re.findall(r"^\| (d|d, d x rows) \| [^|]+ \| (\S+) \|$", out.stdout, re.M))
expect(f"prefill-loss: 5,331 steps, RMS 3.90 ms on the decode time alone, 2.80 with its rows (got {fits}; "
       f"{out.stderr.strip()[-200:]})", "5331 prefill steps" in out.stdout and fits == {"d": "3.90", "d, d x rows": "2.80"})
# By prior context: after the d, d x rows fit, prefill steps with 2,048-8,191 prompt tokens already
# in KV ran 9 % under their price alone at the median, steps of new prompts 3 % over (the same on
# the runs of 2026-12-07; docs/sim.md, "12-07e out of sample").
context_runs = [d / "h100-serve-fixed-2026-12-06" / r for r in ("conv4-pd-streams-b256-c1024-fd-42s",
                "conv4-pd-streams-b256-c1024-fd-rep-42s", "conv5-pd-streams-b256-c1024-fd-42s",
                "code1-pd-streams-b256-c1024-fd", "code07-pd-streams-b256-c1024-fd")]
out = subprocess.run([sys.executable, str(root / "scripts/compare-steps.py"), "prefill-loss", *map(str, context_runs),
                      "--calibration", str(calibrations / "h100-cuda-engine-2026-12-07f.toml"), "--duet", duet],
                     capture_output=True, text=True, timeout=600)
left = dict(re.findall(r"^\| (\d+-\d+|\d+\+) \| \d+ \| \S+ / (\S+) % \|$", out.stdout, re.M))
expect(f"prefill-loss by context: median left +3.3 % with no prior context, -8.9 % at 2,048-8,191 (got {left})",
       left.get("0-0") == "+3.3" and left.get("2048-8191") == "-8.9")
finish()
