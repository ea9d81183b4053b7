#!/usr/bin/env python3
"""scripts/scan-targets.py: its rows for conversation seconds 600- on the H100's deployments equal
the scan committed before those loads ran (docs/data/h100-serve-conv5s300-2026-12-07/predictions.md),
each load's verdict follows from its figures, the worst-case ratio (colocated 4 % faster, PD 4 %
slower) is the one docs/benchmarks.md gives, and bad arguments are refused by name. Should the
simulator change on purpose, the expected cells here become what it predicts now. Exits 77
(skipped) without the Azure traces in ../shared/traces.

    check_scan_targets.py REPO_ROOT DUET
"""
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from expectations import expect, finish  # noqa: E402
from fidelity import arguments  # noqa: E402

root, duet, traces = arguments()
data = root / "docs/data/h100-serve-conv5s300-2026-12-07"


def scan(*extra, colocated="conv4s600-colocated-b256-42s.toml"):
    argv = [sys.executable, str(root / "scripts/scan-targets.py"), "--colocated", str(data / colocated),
            "--pd", str(data / "conv4s600-pd-streams-b256-c2048-fd-42s.toml"),
            "--calibration", str(root / "config/calibration-duet/h100-cuda-engine-2026-12-07f.toml"),
            "--trace", str(traces / "AzureLLMInferenceTrace_conv_2023.csv"), "--duet", duet, "--jobs", "2", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


out = scan("--starts", "600", "--rates", "3.5,4,4.25")
expect(f"scan-targets.py exits 0 ({out.stderr.strip()[-300:]})", out.returncode == 0)
rows = [line for line in out.stdout.splitlines() if line.startswith("| 600 |")]
expected = ["| 600 | ×3.5 | 14.83 (100 %) 3.91 | 15.14 (100 %) 1.30 | 1.02× | 0.99× | tail |",
            "| 600 | ×4 | 10.65 (66 %) 3.26 | 17.22 (100 %) 1.09 | 1.62× | 0.95× | both |",
            "| 600 | ×4.25 | 6.79 (41 %) 3.24 | 12.66 (71 %) 1.07 | 1.87× | 0.80× | both |"]
expect(f"the three loads are the committed scan, verdicts and 4 % worst cases included (got {rows})", rows == expected)
out = scan("--starts", "600", "--rates", "4", "--speed-spread", "0")
expect(f"with no speed spread the worst-case column is empty (got {out.stdout.splitlines()[-1:]})",
       out.stdout.splitlines()[-1:] == ["| 600 | ×4 | 10.65 (66 %) 3.26 | 17.22 (100 %) 1.09 | 1.62× | – | both |"])
committed = (data / "predictions.md").read_text()
expect("the committed scan holds the same cells",
       all(c in committed for c in ("14.83 (100 %) 3.91", "10.65 (66 %) 3.26", "17.22 (100 %) 1.09", "12.66 (71 %) 1.07")))
out = scan("--rates", "4,fast")
expect(f"a rate that is no number is refused by name (got rc {out.returncode}: {out.stderr.strip()})",
       out.returncode != 0 and "--rates takes numbers separated by commas, got '4,fast'" in out.stderr and not out.stdout)
out = scan("--rates", "0")
expect(f"a zero rate is refused (got rc {out.returncode}: {out.stderr.strip()})",
       out.returncode != 0 and "positive" in out.stderr and not out.stdout)
out = scan("--rates", "4", "--speed-spread", "-0.5")
expect(f"a negative speed spread is refused before any simulation (got rc {out.returncode}: {out.stderr.strip()})",
       out.returncode != 0 and "--speed-spread takes 0 to 0.5, got -0.5" in out.stderr and not out.stdout)
out = scan("--rates", "4", colocated="no-such-deployment.toml")
expect(f"a missing deployment file is refused by path (got rc {out.returncode}: {out.stderr.strip()})",
       out.returncode != 0 and "no-such-deployment.toml is not a .toml file" in out.stderr and not out.stdout)
finish()
