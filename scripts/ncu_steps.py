#!/usr/bin/env python3
"""Tables of where one engine step's GPU time goes, from Nsight Compute CSV files.

Reads `ncu --csv --page raw --metrics gpu__time_duration.sum` output (scripts/gpu-profile.sh
writes one file per step, ncu-NAME.csv) and prints, per step, the kernels grouped by family with
their count, total time and share, and the sum per layer (the checkpoint's layers are all alike).

    scripts/ncu_steps.py --layers 2 gpu-out/ncu-*.csv
"""
import argparse
import csv
import re
import sys
from collections import OrderedDict
from pathlib import Path

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def family(kernel_name):
    """A short family name: the function without namespaces, template arguments or parameters."""
    # Anonymous namespaces read "(anonymous namespace)::", "<unnamed>::" or "unnamed>::".
    name = re.sub(r"\(anonymous namespace\)::|<?unnamed>::", "", kernel_name)
    name = re.sub(r"\(.*$", "", name)
    depth, out = 0, []
    for ch in name:  # drop <...> at any depth
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    name = "".join(out).strip()
    name = name.split("::")[-1]
    name = re.sub(r"^void ", "", name)
    return name or kernel_name[:40]


def read_kernels(path):
    """[(family and grid, microseconds)] in launch order: one GEMM kernel serves several shapes,
    which its grid tells apart."""
    lines = [l for l in Path(path).read_text(errors="replace").splitlines() if l.startswith('"')]
    if len(lines) < 2:
        return []
    rows = list(csv.reader(lines))
    header, units = rows[0], rows[1]
    try:
        name_col = header.index("Kernel Name")
        time_col = header.index("gpu__time_duration.sum")
    except ValueError:
        return []
    grid_col = header.index("Grid Size") if "Grid Size" in header else None
    if units[name_col] == "" and units[time_col] not in UNITS:
        raise SystemExit(f"{path}: unknown time unit {units[time_col]!r}")
    scale = UNITS.get(units[time_col], 1.0) if units[name_col] == "" else 1.0
    data = rows[2:] if units[name_col] == "" else rows[1:]
    out = []
    for r in data:
        try:
            grid = f" grid {r[grid_col].replace(' ', '')}" if grid_col is not None else ""
            out.append((family(r[name_col]) + grid, float(r[time_col].replace(",", "")) * scale))
        except (ValueError, IndexError):
            continue
    return out


def table(name, kernels, layers):
    total = sum(t for _, t in kernels)
    groups = OrderedDict()
    for fam, t in kernels:
        n, s = groups.get(fam, (0, 0.0))
        groups[fam] = (n + 1, s + t)
    lines = [f"### {name}: {len(kernels)} kernels, {total:.1f} us of GPU time ({layers} layers)", "",
             "| kernel | launches | total us | share | us per launch |", "| --- | --- | --- | --- | --- |"]
    for fam, (n, s) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {fam} | {n} | {s:.1f} | {100 * s / total:.1f} % | {s / n:.1f} |")
    lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=0, help="layers of the profiled checkpoint (for the header)")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    status = 0
    for f in args.files:
        kernels = read_kernels(f)
        name = re.sub(r"^ncu-|\.csv$", "", Path(f).name)
        if not kernels:
            print(f"### {name}: no kernel rows in {f}\n")
            status = 1
            continue
        print(table(name, kernels, args.layers))
    return status


if __name__ == "__main__":
    sys.exit(main())
