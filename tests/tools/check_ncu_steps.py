#!/usr/bin/env python3
"""scripts/ncu_steps.py against a real Nsight Compute CSV (tests/data/ncu/ncu-decode1.csv: every
kernel of a batch-1 decode step of a 2-layer 8B-shaped checkpoint on the H200, 2026-12-02, columns
trimmed): kernel families and grids are grouped, nanoseconds become microseconds, and the totals
are the sums of the file's rows. Exits non-zero on any mismatch.

    check_ncu_steps.py REPO_ROOT
"""
import csv
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from expectations import expect, finish  # noqa: E402

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
fixture = root / "tests/data/ncu/ncu-decode1.csv"
script = root / "scripts/ncu_steps.py"


out = subprocess.run([sys.executable, str(script), "--layers", "2", str(fixture)], capture_output=True, text=True)
expect("exit 0", out.returncode == 0)
table = {}
for line in out.stdout.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) == 5 and cells[1].isdigit():
        table[cells[0]] = (int(cells[1]), float(cells[2]))

# The same sums, straight from the file's rows (nanoseconds).
rows = list(csv.reader(l for l in fixture.read_text().splitlines() if l.startswith('"')))[2:]
total_us = sum(float(r[4].replace(",", "")) for r in rows) / 1e3
expect(f"header counts {len(rows)} kernels and {total_us:.1f} us",
       f"20 kernels, {total_us:.1f} us of GPU time (2 layers)" in out.stdout and len(rows) == 20)
# One skinny GEMV shape per grid: the two gate_up launches (3,584 CTAs) are 55,296 + 55,264 ns.
expect("gate_up GEMVs grouped by grid", table.get("skinny_kernel grid (3584,1,1)") == (2, 110.6))
expect("the four 512-CTA GEMVs (o and down) grouped", table.get("skinny_kernel grid (512,1,1)", (0,))[0] == 4)
expect("graph-node names lose their namespace", table.get("decode_kernel_v2 grid (48,8,1)") == (2, 29.4))
expect("one sampling launch of 66 us", table.get("sample_kernel grid (1,1,1)") == (1, 66.0))
expect("families add up to the total", abs(sum(s for _, s in table.values()) - total_us) < 0.5)

# A time unit the script does not know is an error, not a silent scale.
with tempfile.TemporaryDirectory() as d:
    odd = pathlib.Path(d) / "ncu-odd.csv"
    odd.write_text(fixture.read_text().replace('"","","","","ns"', '"","","","","cycle"'))
    bad = subprocess.run([sys.executable, str(script), str(odd)], capture_output=True, text=True)
    expect("unknown unit refused", bad.returncode != 0 and "unknown time unit" in (bad.stderr + bad.stdout))

finish()
