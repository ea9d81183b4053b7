#!/usr/bin/env python3
"""Reference outputs of Hugging Face transformers for duet's CPU engine tests.

Two modes:

  make_hf_fixtures.py model CHECKPOINT_DIR OUT.json --arch A --size S --seed N --dtype D \
      [--stddev X] [--norm-stddev Y]
      CHECKPOINT_DIR was written by duet's random-checkpoint writer or its Python twin
      (tests/tools/make_tiny_checkpoint.py) with the given arguments, which are recorded in the
      JSON so the C++ test can regenerate the same weights. Loads it with
      AutoModelForCausalLM (float32, attn_implementation="eager", on the CPU so no TF32 is
      involved), runs fixed prompts (token id lists) and records, per prompt, the last-position
      logits (top 64 ids and values, the L2 norm, a 256-entry slice) and a 32-token greedy
      continuation (full recomputation each step, argmax = first maximum). Also records each
      tensor's float64 sum and first values, and the rotary inverse frequencies.

  make_hf_fixtures.py rope CONFIG_DIR OUT.json
      The rotary embedding of CONFIG_DIR/config.json: inv_freq, and cos/sin at a few positions.

tests/tools/make_hf_fixtures.sh runs both for the committed fixtures (tests/data/hf-fixtures/).
Needs torch, transformers, safetensors and numpy (the GPU machine has them).
"""
import argparse
import glob
import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors import safe_open

PROMPT_LENGTHS = (1, 7, 33, 300)
CONTINUATION = 32
TOP = 64
SLICE_START = 1000
SLICE = 256


def prompts(vocab, bos):
    rng = np.random.RandomState(20261129)
    out = []
    for i, n in enumerate(PROMPT_LENGTHS):
        ids = rng.randint(0, min(vocab, 128000), size=n).tolist()
        if i == 2 and bos is not None:
            ids[0] = bos
        out.append(ids)
    return out


def load_model(path):
    kwargs = dict(attn_implementation="eager")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kwargs)
    model.eval()
    assert next(model.parameters()).dtype == torch.float32
    return model


def tensor_summaries(path):
    out = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).to(torch.float32).flatten()
                out[name] = {"sum": float(t.double().sum()), "first": [float(v) for v in t[:4]]}
    return out


def model_mode(args):
    torch.set_num_threads(os.cpu_count() or 1)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(args.path)
    cfg = model.config
    bos = getattr(cfg, "bos_token_id", None)
    records = []
    with torch.no_grad():
        for ids in prompts(cfg.vocab_size, bos):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            values, top_ids = torch.topk(logits, TOP)
            record = {
                "ids": ids,
                "top_ids": top_ids.tolist(),
                "top_values": [float(v) for v in values],
                "l2": float(logits.double().norm()),
                "slice": [float(v) for v in logits[SLICE_START:SLICE_START + SLICE]],
            }
            history = list(ids)
            greedy, gaps = [], []
            for _ in range(CONTINUATION):
                step = model(torch.tensor([history])).logits[0, -1].float()
                token = int(torch.argmax(step))
                two = torch.topk(step, 2).values
                greedy.append(token)
                gaps.append(float(two[0] - two[1]))
                history.append(token)
            record["greedy"] = greedy
            record["greedy_top2_gaps"] = gaps
            records.append(record)
            print(f"prompt of {len(ids)}: top {record['top_ids'][:3]}, greedy {greedy[:8]}..., "
                  f"smallest top-2 gap {min(gaps):.3g}", flush=True)
    result = {
        "made_by": "tests/tools/make_hf_fixtures.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "model": {"class": type(model).__name__, "attn_implementation": cfg._attn_implementation,
                  "dtype": "float32", "device": "cpu"},
        "checkpoint": {"arch": args.arch, "size": args.size, "seed": args.seed, "dtype": args.dtype,
                       "stddev": args.stddev, "norm_stddev": args.norm_stddev},
        "inv_freq": [float(v) for v in model.model.rotary_emb.inv_freq],
        "tensors": tensor_summaries(args.path),
        "slice_start": SLICE_START,
        "prompts": records,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


def rope_mode(args):
    cfg = transformers.AutoConfig.from_pretrained(args.path)
    if cfg.model_type == "llama":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
    else:
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding as Rotary
    rotary = Rotary(config=cfg)
    positions = [1, 4095, 32767]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    x = torch.zeros(1, len(positions), head_dim)
    cos, sin = rotary(x, torch.tensor([positions]))
    half = head_dim // 2
    result = {
        "made_by": "tests/tools/make_hf_fixtures.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "inv_freq": [float(v) for v in rotary.inv_freq],
        "attention_scaling": float(rotary.attention_scaling),
        "positions": positions,
        "cos": [[float(v) for v in row[:half]] for row in cos[0]],
        "sin": [[float(v) for v in row[:half]] for row in sin[0]],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["model", "rope"])
    ap.add_argument("path")
    ap.add_argument("out")
    ap.add_argument("--arch")
    ap.add_argument("--size")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--dtype")
    ap.add_argument("--stddev", type=float, default=0.02)
    ap.add_argument("--norm-stddev", type=float, default=0.0)
    args = ap.parse_args()
    if args.mode == "model":
        if None in (args.arch, args.size, args.seed, args.dtype):
            sys.exit("model mode needs --arch, --size, --seed and --dtype (the checkpoint's writer arguments)")
        model_mode(args)
    else:
        rope_mode(args)


if __name__ == "__main__":
    main()
