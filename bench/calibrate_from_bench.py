#!/usr/bin/env python3
"""A simulator calibration file (docs/sim.md, "Calibration files") from bench_cuda_engine's JSON.

    python3 bench/calibrate_from_bench.py BENCH_JSON... [--gpu h200] [--serving FILE]
        [--exclude-decode BATCHxCONTEXT ...] > calibration.toml

Inverts the simulator's cost model (runtime/model_shape.cpp) on what the benchmark measured
for R1-Distill-Llama-8B on one GPU:
  gemm       fraction of peak FLOP/s of the compute-bound GEMMs: the cuBLASLt model mix at
             M = 8192, and at M = T the one-sequence prefill rows of T < 8192 tokens once
             their attention time is taken out. The memory-bound rates (M = 1..64, FLOP/byte = M, below the GPU's ridge)
             are printed as a comment only: there the cost model's memory term, from the decode
             rows, decides, and a log-interpolated curve through them would underrate every
             prefill chunk between 64 and 8192 tokens;
  attention  fraction of peak per mean keys per query, from the prefill rows of 8192 tokens
             and more once their GEMM time (at the M = 8192 fraction) is taken out;
  memory     fraction of peak bandwidth per bytes read, from the decode rows (weights + KV of
             every cached token; decode is memory-bound at every measured batch);
  step_overhead_s is kept from --serving (else 60 us).
Several JSONs merge (later ones win: kernels by name, prefill rows by length, decode rows by
batch and context), so a --prefill-only run adds its rows to a full one.
Keys only serving runs can measure (split_*, decode_sequence_overhead_s, concurrent_*,
reserve_*, shared_prefill_delay_s, front_end_s, and prefill_memory, fitted on prefill-mix steps)
are copied from --serving, a calibration file fitted on them.
"""
import argparse
import datetime
import json
import math
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# R1-Distill-Llama-8B (its config.json): layers, hidden, heads, kv heads, head dim, FFN, vocab.
L, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
SHAPE_PARAMS = {"qkv": HIDDEN * (Q + 2 * KV), "o": Q * HIDDEN, "gate_up": HIDDEN * 2 * FFN, "down": FFN * HIDDEN}
LINEAR_PARAMS = L * sum(SHAPE_PARAMS.values()) + VOCAB * HIDDEN  # + LM head
WEIGHT_BYTES = 2 * (LINEAR_PARAMS + VOCAB * HIDDEN)               # + untied embedding
KV_BYTES_PER_TOKEN = 2 * L * KV * 2
SERVING_KEYS = ("step_overhead_s", "decode_sequence_overhead_s", "split_bandwidth", "split_kv_bandwidth", "split_compute",
                "concurrent_decode_slowdown", "concurrent_prefill_slowdown",
                "concurrent_decode_delay_s", "concurrent_decode_tile_keys", "concurrent_decode_delay_by_overlap",
                "concurrent_overlap_on_prefill_start", "concurrent_prefill_yield",
                "concurrent_prefill_attention_yield", "concurrent_prefill_yield_scale",
                "concurrent_decode_delay_scale", "concurrent_decode_slowdown_scale",
                "concurrent_decode_delay_batch_scale", "shared_prefill_delay_s", "shared_decode_lag_s",
                "prefill_memory", "split_decode_slowdown", "split_prefill_slowdown", "front_end_s", "front_end_token_s", "sm_shares",
                "reserve_decode_delay_scale", "reserve_decode_delay_batch_scale", "reserve_prefill_yield_scale",
                "reserve_prefill_yield_batch_scale", "reserve_prefill_attention_yield")


def gpu_spec(name):
    specs = tomllib.loads((ROOT / "config" / "gpus.toml").read_text())["gpus"]
    if name not in specs:
        sys.exit(f"calibrate_from_bench: no GPU '{name}' in config/gpus.toml")
    return specs[name]


def gemm_curve(kernels, peak_flops, skinny):
    points = []
    for m, prefix in ((1, "gemv_{}"), (4, "gemm_M4_{}"), (8, "gemm_M8_{}"), (64, "gemm_M64_{}")):
        seconds_per_byte = 0.0
        for shape, params in SHAPE_PARAMS.items():
            base = prefix.format(shape)
            # The engine takes the skinny kernel at m = 1 when it is on, cuBLASLt otherwise.
            key = f"{base}_skinny_TBps" if (m == 1 and skinny) else f"{base}_cublaslt_TBps"
            if key not in kernels:
                break
            seconds_per_byte += params / (kernels[key] * 1e12)
        else:
            rate = sum(SHAPE_PARAMS.values()) / seconds_per_byte  # bytes/s over all weights
            points.append([m, m * rate / peak_flops])
    if "gemm_M8192_model_mix_TFLOPs" in kernels:
        points.append([8192, kernels["gemm_M8192_model_mix_TFLOPs"] * 1e12 / peak_flops])
    return points


def attention_terms(t):
    linear = 2.0 * LINEAR_PARAMS * t
    attention = 4.0 * L * HEADS * HEAD_DIM * t * (t + 1) / 2
    return linear, attention, (t + 1) / 2


def attention_curve(prefill_rows, gemm_large, peak_flops, overhead_s):
    points = []
    for row in sorted(prefill_rows, key=lambda r: r["tokens"]):
        if row["tokens"] < 8192:
            continue
        linear, attention, keys = attention_terms(row["tokens"])
        left = row["ms"] * 1e-3 - overhead_s - linear / (peak_flops * gemm_large)
        if left > 0:
            points.append([keys, min(1.0, attention / (peak_flops * left))])
    return points


def at(curve, x):
    """The curve's value at x, held flat beyond its ends (log interpolation between)."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return curve[-1][1]


def prefill_gemm_points(prefill_rows, attention, peak_flops, overhead_s):
    points = []
    for row in sorted(prefill_rows, key=lambda r: r["tokens"]):
        if row["tokens"] >= 8192:
            continue
        linear, attention_flops, keys = attention_terms(row["tokens"])
        left = row["ms"] * 1e-3 - overhead_s - attention_flops / (peak_flops * at(attention, keys))
        if left > 0:
            points.append([row["tokens"], min(1.0, linear / (peak_flops * left))])
    return points


def memory_curve(decode_rows, bandwidth, overhead_s, excluded):
    by_bytes = {}
    for row in decode_rows:
        if f"{row['batch']}x{row['context']}" in excluded:
            continue
        tokens = row["batch"] * row["context"]
        nbytes = WEIGHT_BYTES + KV_BYTES_PER_TOKEN * tokens
        by_bytes.setdefault(nbytes, []).append(nbytes / (bandwidth * (row["ms"] * 1e-3 - overhead_s)))
    return [[b, min(1.0, sum(f) / len(f))] for b, f in sorted(by_bytes.items())]


def toml_value(value):
    """A serving key's value as TOML: a curve, a flag, a word or a number."""
    if isinstance(value, list):
        return toml_curve(value, '{:g}', '{:.4g}')  # some curves hold seconds, not fractions
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return format(value, 'g')


def toml_curve(points, x_format, y_format='{:.3f}'):
    return "[" + ", ".join(f"[{x_format.format(x)}, {y_format.format(f)}]" for x, f in points) + "]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json", type=pathlib.Path, nargs="+")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--serving", type=pathlib.Path, help="calibration file whose serving-fitted keys are kept")
    ap.add_argument("--exclude-decode", action="append", default=[], metavar="BATCHxCONTEXT",
                    help="a decode row not to use, e.g. 4x1024")
    a = ap.parse_args()
    bench = {"kernels": {}, "prefill": {}, "decode": {}}
    for path in a.bench_json:
        part = json.loads(path.read_text())
        bench["kernels"].update(part.get("kernels", {}))
        bench["prefill"].update({r["tokens"]: r for r in part.get("prefill", [])})
        bench["decode"].update({(r["batch"], r["context"]): r for r in part.get("decode", [])})
        for key in ("device", "skinny_gemm"):
            bench[key] = part.get(key, bench.get(key))
    bench["prefill"] = list(bench["prefill"].values())
    bench["decode"] = list(bench["decode"].values())
    spec = gpu_spec(a.gpu)
    serving = tomllib.loads(a.serving.read_text()) if a.serving else {}
    overhead = serving.get("step_overhead_s", 60e-6)
    peak, bandwidth = float(spec["bf16_flops"]), float(spec["memory_bandwidth"])
    kernels = bench["kernels"]
    all_gemm = gemm_curve(kernels, peak, bool(bench.get("skinny_gemm", False)))
    ridge = peak / bandwidth
    gemm = [p for p in all_gemm if p[0] >= ridge]
    memory_bound = [p for p in all_gemm if p[0] < ridge]
    if not gemm or gemm[-1][0] != 8192:
        sys.exit("calibrate_from_bench: the bench JSON has no M=8192 GEMM rate (kernels.gemm_M8192_model_mix_TFLOPs)")
    attention = attention_curve(bench.get("prefill", []), gemm[-1][1], peak, overhead)
    if attention:
        gemm = prefill_gemm_points(bench["prefill"], attention, peak, overhead) + gemm
    memory = memory_curve(bench.get("decode", []), bandwidth, overhead, set(a.exclude_decode))
    if not attention or not memory:
        sys.exit("calibrate_from_bench: the bench JSON needs prefill and decode rows")
    names = " + ".join(p.name for p in a.bench_json)
    print(f"# Written by bench/calibrate_from_bench.py from {names} ({bench.get('device', '?')}, "
          f"{datetime.date.today().isoformat()}).")
    print("# gemm: prefill rows below 8192 tokens and the cuBLASLt model mix (M = 8192); memory-bound")
    print("# GEMMs below the ridge")
    print(f"# (M < {ridge:.0f}) reached, as fractions of peak FLOP/s: "
          + ", ".join(f"M={m}: {f:.3f}" for m, f in memory_bound))
    print("# attention: prefill rows of 8192+ tokens less their GEMM time; memory: decode rows.")
    if a.exclude_decode:
        print(f"# decode rows left out: {', '.join(a.exclude_decode)}")
    print(f'gpu = "{a.gpu}"')
    print(f'measured = "{datetime.date.today().isoformat()}"')
    print(f'source = "bench_cuda_engine {names} via bench/calibrate_from_bench.py"')
    print(f"gemm = {toml_curve(gemm, '{:g}')}")
    print(f"attention = {toml_curve(attention, '{:.0f}')}")
    print(f"memory = {toml_curve(memory, '{:.4g}')}")
    if serving:
        print(f"# Fitted on serving runs (copied from {a.serving}):")
    for key in SERVING_KEYS:
        if key in serving:
            print(f"{key} = {toml_value(serving[key])}")


if __name__ == "__main__":
    main()
