"""Two re-simulations of the same stored runs side by side (scripts/resim-serve.sh's $OUT
folders, e.g. with RESIM_FIRST_TOKEN=prefill and =decode): per run, the figures that moved.

  python3 scripts/resim-compare.py OUT_A OUT_B
"""
import json
import pathlib
import sys


def summary(folder):
    return json.loads((folder / "summary.json").read_text())["runs"][0]["summary"]


def main(a_dir, b_dir):
    a_dir, b_dir = pathlib.Path(a_dir), pathlib.Path(b_dir)
    print("| run | ITL P99 / P50 | ITL P50 ms | 2nd token P50 ms | TTFT P50 ms | TTFT P99 ms | goodput req/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for a_run in sorted(p for p in a_dir.iterdir() if (p / "summary.json").exists()):
        b_run = b_dir / a_run.name
        if not (b_run / "summary.json").exists():
            continue
        a, b = summary(a_run), summary(b_run)
        ms = lambda s, key, q: s[key][q] * 1e3
        ratio = lambda s: s["itl_s"]["p99"] / s["itl_s"]["p50"]
        cells = [f"{ratio(a):.2f} → {ratio(b):.2f}"]
        for key, q, digits in (("itl_s", "p50", 1), ("second_token_s", "p50", 1), ("ttft_s", "p50", 0),
                               ("ttft_s", "p99", 0)):
            cells.append(f"{ms(a, key, q):.{digits}f} → {ms(b, key, q):.{digits}f}")
        cells.append(f"{a['goodput_rps']:.2f} → {b['goodput_rps']:.2f}")
        print(f"| {a_run.name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
