#!/usr/bin/env python3
"""scripts/predict-serve.py: its rows for stored deployments equal the predictions committed before
those runs ran (docs/data/h100-serve-conv4s900-2026-12-07 and -conv5s900-2026-12-07,
predictions.md), and it refuses a deployment whose name gives no trace window. Should the
simulator change on purpose, the expected rows here become what it predicts now; the
predictions files stay as written. Exits 77 (skipped) without the Azure traces in ../shared/traces.

    check_predict_serve.py REPO_ROOT DUET
"""
import pathlib
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from expectations import expect, finish  # noqa: E402
from fidelity import arguments  # noqa: E402

root, duet, traces = arguments()
calibrations = root / "config/calibration-duet"
data = root / "docs/data"


def predict(*deployments, calibrations_used=("h100-cuda-engine-2026-12-07f.toml", "h100-cuda-engine-2026-12-07e.toml")):
    args = [a for c in calibrations_used for a in ("--calibration", str(calibrations / c))]
    return subprocess.run([sys.executable, str(root / "scripts/predict-serve.py"), *map(str, deployments), *args,
                           "--duet", duet, "--traces", str(traces)], capture_output=True, text=True, timeout=900)


out = predict(data / "h100-serve-conv4s900-2026-12-07/conv4s900-pd-reserve70-b256-c1024-fd-42s.toml")
expect(f"predict-serve.py exits 0 ({out.stderr.strip()[-300:]})", out.returncode == 0)
rows = [line for line in out.stdout.splitlines() if line.startswith("| conv4s900") or line.startswith("|  |")]
committed = [line.rsplit(" | ", 1)[0] + " |" for line in
             (data / "h100-serve-conv4s900-2026-12-07/predictions.md").read_text().splitlines()
             if line.startswith("| conv4s900") or line.startswith("|  | 12-07")]
expect(f"its two rows are the committed prediction, mean decode rows aside (got {rows}, committed {committed})",
       rows == committed and len(rows) == 2)
out = predict(data / "h100-serve-conv5s900-2026-12-07/conv5s900-pd-streams-b256-c2048-fd-42s.toml",
              calibrations_used=("h100-cuda-engine-2026-12-07e.toml",))
expect("PD streams with 2,048-token chunks at x5 with 12-07e: 409 / 1618 ms TTFT, 20.53 req/s (100 %)",
       "| conv5s900-pd-streams-b256-c2048-fd-42s | 12-07e | 409 / 1618 | 1035–2598 | 38.3 / 40.9 | 1.07 | 20.53 (100 %) |"
       in out.stdout.splitlines())
with tempfile.TemporaryDirectory() as folder:
    unnamed = pathlib.Path(folder) / "mystery-run.toml"
    shutil.copy(data / "h100-serve-conv4s900-2026-12-07/conv4s900-pd-reserve70-b256-c1024-fd-42s.toml", unnamed)
    out = predict(unnamed)
    expect(f"a deployment named for no trace window is refused by name (got rc {out.returncode}: {out.stderr.strip()})",
           out.returncode != 0 and "no trace window known for run 'mystery-run'" in out.stderr and not out.stdout)
finish()
