#!/usr/bin/env python3
"""Encode throughput of HF `tokenizers` on one thread, the peer of bench/bench_tokenizer.cpp.

Measures the same files on the same text (bench/data/tokenizer-bench.txt) in the same two
shapes: the whole text in one call, and 4 KiB chunks (cut at line ends) one call each; warm
(the BPE cache filled by earlier runs, as in a server) and cold (a freshly loaded tokenizer);
also the chunks through encode_batch_fast, HF's fastest path. Rates are per CPU second of
this process (as Google Benchmark reports them), bytes in MiB as Google Benchmark counts.

  TOKENIZERS_PARALLELISM=false RAYON_NUM_THREADS=1 .venv/bin/python bench/tokenizer_hf.py

`--make-text` rebuilds the bench text from files every Debian machine with python3 has, plus
the repo's tokenizer test texts (English prose, Python code, Chinese/English notes, unicode).
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import tokenizers  # noqa: E402  (the environment must be set first)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "bench", "data", "tokenizer-bench.txt")
MODELS = {
    "llama3_1": os.path.join(ROOT, "tests", "data", "tokenizers", "llama3_1", "tokenizer.json"),
    "qwen3": os.path.join(ROOT, "tests", "data", "tokenizers", "qwen3", "tokenizer.json"),
}
SOURCES = [
    "/usr/share/common-licenses/GPL-3",
    "/usr/share/common-licenses/Apache-2.0",
    "/usr/share/common-licenses/LGPL-2.1",
    "/usr/share/common-licenses/GFDL-1.3",
    "/usr/lib/python3.11/difflib.py",
    "/usr/lib/python3.11/textwrap.py",
]


def make_text(path):
    parts = []
    for source in SOURCES:
        with open(source, encoding="utf-8", newline="") as f:
            parts.append(f.read())
    with open(os.path.join(ROOT, "tests", "data", "tokenizer-corpus.txt"), encoding="utf-8") as f:
        parts.append(f.read())
    for name in ("llama3_1", "qwen3"):
        golden = os.path.join(ROOT, "tests", "data", "tokenizer-golden", name + ".jsonl")
        with open(golden, encoding="utf-8") as f:
            parts.append("\n".join(json.loads(line)["text"] for line in f if line.strip()))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("\n\n".join(parts))


def chunks(text, size=4096):
    """Cuts at the first line end at or after `size` bytes; the same rule as the C++ bench."""
    data = text.encode("utf-8")
    out, start = [], 0
    while start < len(data):
        end = data.find(b"\n", start + size)
        end = len(data) if end < 0 else end + 1
        out.append(data[start:end].decode("utf-8"))
        start = end
    return out


def measure(fn, min_seconds=2.0):
    """Median CPU seconds per call (this process, one thread) over repetitions lasting at least
    min_seconds in all. CPU time, as Google Benchmark reports, so a busy machine counts less."""
    times = []
    begin = time.perf_counter()
    while time.perf_counter() - begin < min_seconds or len(times) < 5:
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--make-text", action="store_true", help="rebuild the bench text")
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per case")
    args = parser.parse_args()
    if args.make_text:
        make_text(TEXT)
        print(f"wrote {TEXT} ({os.path.getsize(TEXT)} bytes)")
        return

    with open(TEXT, encoding="utf-8", newline="") as f:
        text = f.read()
    size = len(text.encode("utf-8"))
    pieces = chunks(text)
    results = {"tokenizers": tokenizers.__version__, "bytes": size, "chunks": len(pieces)}
    for name, path in MODELS.items():
        t0 = time.perf_counter()
        tok = tokenizers.Tokenizer.from_file(path)
        load = time.perf_counter() - t0
        t0 = time.process_time()
        n_tokens = len(tok.encode(text, add_special_tokens=False).ids)
        cold = time.process_time() - t0
        whole = measure(lambda: tok.encode(text, add_special_tokens=False), args.seconds)
        chunked = measure(lambda: [tok.encode(p, add_special_tokens=False) for p in pieces],
                          args.seconds)
        # HF's fastest path: a batch without offsets (on one thread, given RAYON_NUM_THREADS=1).
        batch = measure(lambda: tok.encode_batch_fast(pieces, add_special_tokens=False),
                        args.seconds)
        mib = 1024.0 * 1024.0  # the unit of Google Benchmark's bytes_per_second
        results[name] = {
            "tokens": n_tokens,
            "load_s": round(load, 3),
            "cold_MiBps": round(size / cold / mib, 2),
            "whole_MiBps": round(size / whole / mib, 2),
            "whole_Mtokps": round(n_tokens / whole / 1e6, 3),
            "chunks_MiBps": round(size / chunked / mib, 2),
            "chunks_Mtokps": round(n_tokens / chunked / 1e6, 3),
            "batch_fast_MiBps": round(size / batch / mib, 2),
            "batch_fast_Mtokps": round(n_tokens / batch / 1e6, 3),
        }
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
