#!/usr/bin/env python3
"""scripts/fit-prefill-mix.py on the H200's prefill steps (docs/data/h200-prefill-mix-2026-12-05):
the calibration fitted to them prices every step within its stated error, the one fitted with the
decode share busy does not, and a grid ranks the fitted point first. Exits non-zero on any
mismatch.

    check_fit_prefill_mix.py REPO_ROOT DUET_BINARY
"""
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from expectations import expect, finish  # noqa: E402

root = pathlib.Path(sys.argv[1])
duet = sys.argv[2]
measured = root / "docs/data/h200-prefill-mix-2026-12-05"
fitted = root / "config/calibration-duet/h200-cuda-engine-2026-12-05.toml"
busy = root / "config/calibration-duet/h200-cuda-engine-2026-12-04b.toml"


def fit(base, *extra):
    out = subprocess.run([sys.executable, str(root / "scripts/fit-prefill-mix.py"), "--base", str(base),
                          "--measured", str(measured), "--duet", duet, "--jobs", "2", *extra],
                         capture_output=True, text=True)
    expect(f"fit-prefill-mix.py exits 0 ({out.stderr.strip()[-200:]})", out.returncode == 0)
    rows = []
    for line in out.stdout.splitlines():
        m = re.match(r"\| (.+?) \| (\d+) \| (\d+) % \| ([\d.]+) % \|$", line)
        if m:
            rows.append((m.group(1), int(m.group(2)), int(m.group(3)), float(m.group(4))))
    return rows, out.stdout


rows, text = fit(fitted, "--detail")
expect("one point, the base", len(rows) == 1 and rows[0][0] == "base")
if rows:
    _, over, worst, rms = rows[0]
    expect(f"12-05: RMS {rms} % < 4 % over the 72 steps", rms < 4.0)
    expect(f"12-05: worst {worst} % <= 15 %", worst <= 15)
    expect(f"12-05: {over} steps over 10 % <= 3", over <= 3)
detail = [l for l in text.splitlines() if re.match(r"\| \d+x\d+", l)]
expect(f"the detail has the 18 steps ({len(detail)})", len(detail) == 18)
expect("16x64 at share 0.5 measured 36.32 ms", any(l.startswith("| 16x64 |") and "36.32 /" in l for l in detail))

rows, _ = fit(busy)
expect("12-04b (share keys fitted with decode busy) misses the steps alone by RMS > 20 %", rows and rows[0][3] > 20.0)

# A grid: the fitted split_compute against 12-04b's; the fitted one must rank first.
rows, _ = fit(fitted, "--grid",
              "split_compute=[[0.5, 0.89], [0.6, 0.94], [0.7, 0.875], [1, 1.000]],,[[0.5, 1.29], [0.6, 1.19], [0.7, 1.08], [1, 1.000]]")
expect("two grid points", len(rows) == 2)
expect("the fitted split_compute ranks first", rows and "1.29" in rows[0][0] and rows[0][3] < rows[-1][3])

finish()
