#!/usr/bin/env python3
"""scripts/repeat-spread.py on the stored serving runs: it pairs the runs that replayed one
deployment (same TOML, window and decode graphs) and no others, and each cell is the second
run's figure against the first's, read here from the runs' JSON. Exits non-zero on a mismatch.

    check_repeat_spread.py REPO_ROOT
"""
import json
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from expectations import expect, finish  # noqa: E402

root = pathlib.Path(sys.argv[1])
data = root / "docs/data"
folders = [data / f"h200-serve-2026-12-{d}" for d in ("03c", "03d", "03e", "03g", "04", "04b", "04c")]


out = subprocess.run([sys.executable, str(root / "scripts/repeat-spread.py"), *map(str, folders)],
                     capture_output=True, text=True)
expect(f"repeat-spread.py exits 0 ({out.stderr.strip()[-200:]})", out.returncode == 0)
rows = {}
for line in out.stdout.splitlines():
    m = re.match(r"\| (\S+/\S+) \| (\S+/\S+) \| (.+) \|$", line)
    if m:
        rows[(m.group(1), m.group(2))] = [c.strip() for c in m.group(3).split("|")]


def ttft_p99(run):
    return json.loads((data / f"{run}.json").read_text())["runs"][0]["summary"]["ttft_s"]["p99"]


same_machine = ("h200-serve-2026-12-03c/conv4-pd-streams-b256-r2", "h200-serve-2026-12-03c/conv4-pd-streams-b256")
expect("the same-machine repeat of 12-03c is paired", same_machine in rows)
if same_machine in rows:
    want = f"{(ttft_p99(same_machine[1]) / ttft_p99(same_machine[0]) - 1) * 100:+.0f} %"
    expect(f"its TTFT P99 cell is {want} (got {rows[same_machine][1]})", rows[same_machine][1] == want)
expect("a split run and its repeat on another machine are paired",
       ("h200-serve-2026-12-04/code1-pd-green60-b256-c1024",
        "h200-serve-2026-12-04c/code1-pd-green60-b256-c1024-rep") in rows)
# 12-03c ran powers-of-two decode graphs, 12-03d/e graphs every 32 rows: not one deployment.
expect("runs of other decode graphs are not paired",
       not any(a.startswith("h200-serve-2026-12-03c/") and not b.endswith("-pow2") and "-03c/" not in b
               for a, b in rows))
expect("runs of other deployments are not paired",
       all(re.sub(r"-(r2|rep)$", "", a.split("/")[1]).removesuffix("-pow2") ==
           re.sub(r"-(r2|rep)$", "", b.split("/")[1]).removesuffix("-pow2") for a, b in rows))
largest = next((line for line in out.stdout.splitlines() if line.startswith("| largest")), "")
cells = [abs(int(c.split()[0])) for r in rows.values() for c in r[1:2] if c != "–"]
expect(f"the largest TTFT P99 difference is the largest cell ({max(cells, default=-1)} %)",
       largest.split("|")[4].strip() == f"{max(cells, default=-1)} %")
# The same deployment on an H100 (engine.gpu and pools differ) is another card, not a repeat.
h100 = data / "h100-serve-2026-12-05"
both = subprocess.run([sys.executable, str(root / "scripts/repeat-spread.py"), str(data / "h200-serve-2026-12-04"),
                       str(h100)], capture_output=True, text=True)
expect("repeat-spread.py reads the H100 runs (code07-: code 180-240 s at x0.7)", both.returncode == 0)
expect("no H100 run is paired with an H200 run", "h100-serve" not in both.stdout)
finish()
