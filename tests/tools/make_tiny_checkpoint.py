#!/usr/bin/env python3
"""Writes a random-weight Hugging Face checkpoint, bit for bit the one duet's C++ writer
(runtime/random_checkpoint.cpp, `duet model random`) writes for the same arguments.

It exists so the HF fixtures (tests/tools/make_hf_fixtures.py) can be made on a machine that
has torch and transformers but no duet build: both writers produce the same config.json and
the same .safetensors bytes, so the fixtures describe the checkpoint the C++ test regenerates.

Needs numpy only. The generator (see runtime/random_checkpoint.hpp):
    key   = mix64(fnv1a64(name) ^ mix64(seed))
    z     = mix64(key + (i + 1) * 0x9e3779b97f4a7c15)
    s     = sum of the four 16-bit fields of z
    value = float32((s - 131070) * (stddev * sqrt(3) / 65536))       (norms: 1 + that)

Usage: make_tiny_checkpoint.py OUT_DIR [--arch llama|qwen2] [--size tiny|small|full]
       [--seed N] [--dtype bf16|f16|f32] [--norm-stddev X] [--tokenizer-dir DIR] ...
"""
import argparse
import json
import math
import os
import shutil
import struct
import sys

import numpy as np

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix64_int(z):
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def mix64_np(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def fnv1a64(name):
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & MASK
    return h


def tensor_key(seed, name):
    return mix64_int(fnv1a64(name) ^ mix64_int(seed))


def tensor_values(key, first, n, mean, stddev):
    """float32 values of elements [first, first + n)."""
    if stddev == 0.0:
        return np.full(n, mean, dtype=np.float32)
    i = np.arange(first, first + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = mix64_np(np.uint64(key) + (i + np.uint64(1)) * np.uint64(GOLDEN))
    m16 = np.uint64(0xFFFF)
    s = (z & m16) + ((z >> np.uint64(16)) & m16) + ((z >> np.uint64(32)) & m16) + (z >> np.uint64(48))
    k = stddev * math.sqrt(3.0) / 65536.0
    deviate = (s.astype(np.float64) - 131070.0) * k
    return (deviate if mean == 0.0 else mean + deviate).astype(np.float32)


def to_dtype_bytes(values, dtype):
    if dtype == "f32":
        return values.astype("<f4").tobytes()
    if dtype == "f16":
        return values.astype("<f2").tobytes()
    bits = values.view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return ((bits + rounding) >> np.uint32(16)).astype("<u2").tobytes()


DTYPE = {"bf16": ("BF16", 2, "bfloat16"), "f16": ("F16", 2, "float16"), "f32": ("F32", 4, "float32")}


def preset(arch, size):
    if arch == "llama":
        if size == "small":  # SmolLM2-135M
            c = dict(hidden=576, ffn=1536, layers=30, heads=9, kv_heads=3, vocab=49152, max_position=8192,
                     eps=1e-5, theta=100000.0, scaling=None, tie=True, bos=1, eos=[2])
        else:  # DeepSeek-R1-Distill-Llama-8B
            c = dict(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, vocab=128256, max_position=131072,
                     eps=1e-5, theta=500000.0,
                     scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192),
                     tie=False, bos=128000, eos=[128001])
        c.update(arch="llama", architecture="LlamaForCausalLM", qkv_bias=False)
    elif arch == "qwen2":
        if size == "small":  # Qwen2.5-0.5B
            c = dict(hidden=896, ffn=4864, layers=24, heads=14, kv_heads=2, max_position=32768, theta=1000000.0,
                     tie=True)
        else:  # DeepSeek-R1-Distill-Qwen-1.5B
            c = dict(hidden=1536, ffn=8960, layers=28, heads=12, kv_heads=2, max_position=131072, theta=10000.0,
                     tie=False)
        c.update(arch="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True, vocab=151936, eps=1e-6,
                 scaling=None, bos=151643, eos=[151643])
    else:
        sys.exit(f"unknown arch {arch!r} (llama, qwen2)")
    if size == "tiny":
        c.update(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2)
    elif size not in ("full", "small"):
        sys.exit(f"unknown size {size!r} (full, small, tiny)")
    return c


def config_json(c, dtype):
    """The text hf_config_json() writes (runtime/hf_model.cpp)."""
    j = {
        "architectures": [c["architecture"]],
        "model_type": c["arch"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": c["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": c["ffn"],
        "max_position_embeddings": c["max_position"],
        "num_attention_heads": c["heads"],
        "num_hidden_layers": c["layers"],
        "num_key_value_heads": c["kv_heads"],
        "rms_norm_eps": c["eps"],
        "rope_theta": c["theta"],
        "rope_scaling": c["scaling"],
        "tie_word_embeddings": c["tie"],
        "torch_dtype": DTYPE[dtype][2],
        "use_cache": True,
        "vocab_size": c["vocab"],
    }
    if c["bos"] is not None:
        j["bos_token_id"] = c["bos"]
    if len(c["eos"]) == 1:
        j["eos_token_id"] = c["eos"][0]
    elif c["eos"]:
        j["eos_token_id"] = c["eos"]
    if c["head_dim"] * c["heads"] != c["hidden"]:
        j["head_dim"] = c["head_dim"]
    if c["arch"] == "llama":
        j.update(attention_bias=c["qkv_bias"], mlp_bias=False, pretraining_tp=1)
    else:
        j.update(max_window_layers=c["layers"], sliding_window=4096, use_mrope=False, use_sliding_window=False)
    return json.dumps(j, indent=2, sort_keys=True) + "\n"


def tensor_specs(c):
    """(name, shape, kind) in model order, as hf_tensor_specs() lists them."""
    h, f, q, kv = c["hidden"], c["ffn"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    out = [("model.embed_tokens.weight", [c["vocab"], h], "embedding")]
    for layer in range(c["layers"]):
        p = f"model.layers.{layer}."
        out.append((p + "input_layernorm.weight", [h], "norm"))
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((p + f"self_attn.{name}.weight", [rows, h], "linear"))
            if c["qkv_bias"]:
                out.append((p + f"self_attn.{name}.bias", [rows], "bias"))
        out.append((p + "self_attn.o_proj.weight", [h, q], "linear"))
        if c["qkv_bias"] and c["arch"] == "llama":
            out.append((p + "self_attn.o_proj.bias", [h], "bias"))
        out.append((p + "post_attention_layernorm.weight", [h], "norm"))
        out.append((p + "mlp.gate_proj.weight", [f, h], "linear"))
        out.append((p + "mlp.up_proj.weight", [f, h], "linear"))
        out.append((p + "mlp.down_proj.weight", [h, f], "linear"))
    out.append(("model.norm.weight", [h], "norm"))
    if not c["tie"]:
        out.append(("lm_head.weight", [c["vocab"], h], "linear"))
    return out


def write_safetensors(path, entries, dtype, args):
    """entries: sorted (name, shape, kind); the layout safetensors_header() makes."""
    st_name, size, _ = DTYPE[dtype]
    header, offset = {}, 0
    for name, shape, _ in entries:
        n = math.prod(shape) * size
        header[name] = {"dtype": st_name, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":"), sort_keys=True)
    text += " " * (-len(text) % 8)
    tmp = str(path) + ".tmp"
    piece = (16 << 20) // size
    with open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text.encode())
        for name, shape, kind in entries:
            key = tensor_key(args.seed, name)
            mean, stddev = (1.0, args.norm_stddev) if kind == "norm" else (0.0, args.stddev)
            total = math.prod(shape)
            for first in range(0, total, piece):
                n = min(piece, total - first)
                out.write(to_dtype_bytes(tensor_values(key, first, n, mean, stddev), dtype))
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPE))
    ap.add_argument("--stddev", type=float, default=0.02)
    ap.add_argument("--norm-stddev", type=float, default=0.0)
    ap.add_argument("--tokenizer-dir", default="")
    ap.add_argument("--max-shard-bytes", type=int, default=5_000_000_000)
    ap.add_argument("--config-only", action="store_true", help="write config.json alone")
    for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "max_position"):
        ap.add_argument("--" + key.replace("_", "-"), type=int, dest=key)
    args = ap.parse_args()

    c = preset(args.arch, args.size)
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_position"):
        if getattr(args, key) is not None:
            c[key] = getattr(args, key)
    c["head_dim"] = args.head_dim if args.head_dim is not None else c["hidden"] // c["heads"]
    if c["bos"] is not None and c["bos"] >= c["vocab"]:
        c["bos"] = None
    c["eos"] = [e for e in c["eos"] if e < c["vocab"]]

    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):
        if name in ("model.safetensors", "model.safetensors.index.json") or (
                name.startswith("model-") and name.endswith(".safetensors")):
            os.remove(os.path.join(args.out, name))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        f.write(config_json(c, args.dtype))
    if args.config_only:
        print(f"wrote {args.out}/config.json")
        return

    entries = sorted(tensor_specs(c))
    size = DTYPE[args.dtype][1]
    total = sum(math.prod(s) * size for _, s, _ in entries)
    if total <= args.max_shard_bytes:
        write_safetensors(os.path.join(args.out, "model.safetensors"), entries, args.dtype, args)
    else:
        shards, used = [[]], 0
        for e in entries:
            n = math.prod(e[1]) * size
            if used > 0 and used + n > args.max_shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append(e)
            used += n
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(os.path.join(args.out, name), shard, args.dtype, args)
            weight_map.update({e[0]: name for e in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if args.tokenizer_dir:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            src = os.path.join(args.tokenizer_dir, name)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(args.out, name))
    print(f"wrote {args.out}: {args.arch}/{args.size}, {total} bytes of {args.dtype} weights")


if __name__ == "__main__":
    main()
