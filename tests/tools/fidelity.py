"""scripts/fit-concurrency.py's score of one calibration on stored serving runs, for the
fidelity checks (check_h100_fidelity.py, check_h200_fidelity.py)."""
import pathlib
import re
import subprocess
import sys


def arguments():
    """(repository root, duet binary, traces folder) from the command line; exits 77 (skipped)
    without the Azure traces in ../shared/traces."""
    root, duet = pathlib.Path(sys.argv[1]), sys.argv[2]
    traces = root.parent / "shared/traces"
    if not (traces / "AzureLLMInferenceTrace_conv_2023.csv").exists():
        print(f"skipped: {traces} has no Azure traces")
        sys.exit(77)
    return root, duet, traces


def score(root, duet, traces, calibration, run_list):
    """(misses over 15 %, of them outside the ±3 % speed band, {run: {figure: miss in %}})"""
    out = subprocess.run([sys.executable, str(root / "scripts/fit-concurrency.py"), "--base",
                          str(root / "config/calibration-duet" / calibration), "--score-steps", "--speed-spread", "0.03",
                          "--duet", duet, "--traces", str(traces), "--detail", "--runs", *run_list],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"fit-concurrency.py failed: {out.stderr[-400:]}")
    base = re.search(r"^\| base \| (\d+) \| (\d+) \|", out.stdout, re.M)
    detail = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\| (\S+/(\S+)) \| (.+) \|$", line)
        if m:
            cells = [int(c.strip().split()[0]) for c in m.group(3).split("|")]
            detail[m.group(2)] = dict(zip(("ttft p50", "ttft p99", "itl p50", "itl p99", "prefill", "decode"), cells))
    return int(base.group(1)), int(base.group(2)), detail


def leave_one_out(root, duet, traces, calibration, run_list, grids):
    """scripts/fit-concurrency.py --leave-one-out's closing line as numbers: (held-out misses over
    15 %, worst %, in-sample best point's misses, runs whose absence moved the fit)."""
    grid_args = [a for g in grids for a in ("--grid", g)]
    out = subprocess.run([sys.executable, str(root / "scripts/fit-concurrency.py"), "--base",
                          str(root / "config/calibration-duet" / calibration), "--score-steps",
                          "--duet", duet, "--traces", str(traces), "--leave-one-out", *grid_args,
                          "--runs", *run_list], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"fit-concurrency.py failed: {out.stderr[-400:]}")
    m = re.search(r"^held out: (\d+) of \d+ figures over 15 %, worst (\d+) %.*in-sample best point: (\d+),"
                  r".*; (\d+) of \d+ runs left out moved the fit$", out.stdout, re.M)
    return tuple(int(g) for g in m.groups())


def lone_decode(root, duet, calibration, run_list):
    """(steps, RMS %, mean %) of log(priced / live) over the runs' decode steps that no prefill
    step overlapped (scripts/compare-steps.py lone)."""
    out = subprocess.run([sys.executable, str(root / "scripts/compare-steps.py"), "lone", *run_list, "--calibration",
                          str(root / "config/calibration-duet" / calibration), "--duet", str(duet)],
                         check=True, capture_output=True, text=True).stdout
    found = re.search(r"(\d+) steps; RMS of log\(priced / live\) ([\d.]+) %, mean ([+-][\d.]+) %", out)
    return int(found[1]), float(found[2]), float(found[3])
