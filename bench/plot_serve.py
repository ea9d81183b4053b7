#!/usr/bin/env python3
"""Latency CDFs of several `duet bench serve` runs in one SVG (docs/benchmarks.md).

    python3 bench/plot_serve.py --out docs/img/serve-conv.svg --title "..." RUN_DIR...

Reads each RUN_DIR/requests.csv (the live run only: the first run name in the file) and
draws, side by side, the CDF of TTFT and of TPOT per request, log time axis, one colour per
run. Standard library only, so it runs wherever the benchmark ran.
"""
import argparse
import csv
import math
import pathlib

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"]
PANEL_W, PANEL_H, PAD_L, PAD_B, PAD_T = 420, 260, 60, 40, 30


def live_values(run_dir: pathlib.Path, column: str):
    rows = list(csv.DictReader(open(run_dir / "requests.csv")))
    live = rows[0]["run"] if rows else ""
    return sorted(float(r[column]) * 1e3 for r in rows if r["run"] == live and r[column] not in ("", None))


def panel(x0, title, series, unit="ms"):
    values = [v for _, vs in series for v in vs if v > 0]
    lo = 10 ** math.floor(math.log10(min(values))) if values else 1
    hi = 10 ** math.ceil(math.log10(max(values))) if values else 10
    span = math.log10(hi) - math.log10(lo)

    def px(v):
        return x0 + PAD_L + (math.log10(max(v, lo)) - math.log10(lo)) / span * PANEL_W

    def py(f):
        return PAD_T + (1 - f) * PANEL_H

    out = [f'<text x="{x0 + PAD_L + PANEL_W / 2}" y="18" text-anchor="middle" font-weight="bold">{title}</text>',
           f'<rect x="{x0 + PAD_L}" y="{PAD_T}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#888"/>']
    decade = lo
    while decade <= hi * 1.0001:
        x = px(decade)
        out.append(f'<line x1="{x}" y1="{PAD_T}" x2="{x}" y2="{PAD_T + PANEL_H}" stroke="#eee"/>')
        out.append(f'<text x="{x}" y="{PAD_T + PANEL_H + 15}" text-anchor="middle" font-size="11">{decade:g}</text>')
        decade *= 10
    for f in (0, 0.5, 0.9, 0.99, 1):
        out.append(f'<text x="{x0 + PAD_L - 5}" y="{py(f) + 4}" text-anchor="end" font-size="11">{f:g}</text>')
        out.append(f'<line x1="{x0 + PAD_L}" y1="{py(f)}" x2="{x0 + PAD_L + PANEL_W}" y2="{py(f)}" stroke="#eee"/>')
    out.append(f'<text x="{x0 + PAD_L + PANEL_W / 2}" y="{PAD_T + PANEL_H + 32}" text-anchor="middle" font-size="12">{unit} (log)</text>')
    for i, (name, vs) in enumerate(series):
        if not vs:
            continue
        pts = " ".join(f"{px(v):.1f},{py((k + 1) / len(vs)):.1f}" for k, v in enumerate(vs))
        out.append(f'<polyline fill="none" stroke="{COLOURS[i % len(COLOURS)]}" stroke-width="1.6" points="{pts}"/>')
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=pathlib.Path)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    names = [r.name for r in a.runs]
    ttft = [(n, live_values(r, "ttft_s")) for n, r in zip(names, a.runs)]
    tpot = [(n, live_values(r, "tpot_s")) for n, r in zip(names, a.runs)]
    width = 2 * (PANEL_W + PAD_L + 20)
    legend_y = PAD_T + PANEL_H + PAD_B + 10
    height = legend_y + 18 * len(names) + (20 if a.title else 0)
    body = panel(0, "TTFT per request (CDF)", ttft) + panel(PANEL_W + PAD_L + 20, "TPOT per request (CDF)", tpot)
    for i, n in enumerate(names):
        y = legend_y + 18 * i
        body.append(f'<rect x="{PAD_L}" y="{y - 9}" width="14" height="4" fill="{COLOURS[i % len(COLOURS)]}"/>')
        body.append(f'<text x="{PAD_L + 20}" y="{y - 4}" font-size="12">{n}</text>')
    if a.title:
        body.append(f'<text x="{PAD_L}" y="{height - 6}" font-size="12" fill="#555">{a.title}</text>')
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                     f'font-family="sans-serif" font-size="13"><rect width="100%" height="100%" fill="white"/>'
                     + "".join(body) + "</svg>\n")


if __name__ == "__main__":
    main()
