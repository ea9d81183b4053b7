#!/usr/bin/env python3
"""Hugging Face transformers reference for the CUDA engine's end-to-end check (scripts/gpu-check.sh).

  cuda_hf_reference.py CHECKPOINT_DIR OUT_DIR [--steps N]

Loads CHECKPOINT_DIR (written by `cuda_e2e write`) as LlamaForCausalLM in bf16 with SDPA attention
on the GPU, and for each fixed prompt runs the prompt, then N greedy steps with the KV cache
(argmax = first maximum). Writes OUT_DIR/ref.json (prompts, greedy tokens, per-step top-2 margin
and logit RMS) and OUT_DIR/logits_<i>.f32: (N + 1) x vocab float32 logits (row 0: the prompt's
last position; row s: after feeding token s - 1).

Then the same model in float32 (no TF32) runs each prompt followed by the N greedy tokens in one
pass: OUT_DIR/logits32_<i>.f32 holds the same N + 1 rows, the reference that measures how far
bf16 arithmetic itself moves the logits (ref.json "bf16_rel": ||hf_bf16 - fp32|| / ||fp32|| per row).
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import transformers

PROMPT_LENGTHS = (1, 100, 517, 2000)


def load(path, dtype):
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", device_map="cuda")
    except TypeError:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation="sdpa", device_map="cuda")
    return model.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t = time.time()
    model = load(args.checkpoint, torch.bfloat16)
    load_s = time.time() - t
    vocab = model.config.vocab_size
    rng = np.random.RandomState(20261201)
    prompts = [rng.randint(0, min(vocab, 128000), size=n).tolist() for n in PROMPT_LENGTHS]
    result = {"checkpoint": args.checkpoint, "steps": args.steps, "vocab": vocab, "load_s": load_s,
              "transformers": transformers.__version__, "torch": torch.__version__, "prompts": prompts,
              "tokens": [], "margins": [], "rms": []}
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt], device="cuda")
            out = model(ids, use_cache=True)
            past = out.past_key_values
            rows = [out.logits[0, -1].float()]
            tokens = [int(rows[-1].argmax())]
            for _ in range(args.steps):
                out = model(torch.tensor([[tokens[-1]]], device="cuda"), past_key_values=past, use_cache=True)
                past = out.past_key_values
                rows.append(out.logits[0, -1].float())
                tokens.append(int(rows[-1].argmax()))
            logits = torch.stack(rows)
            top2 = logits.topk(2, dim=-1).values
            result["tokens"].append(tokens)
            result["margins"].append((top2[:, 0] - top2[:, 1]).tolist())
            result["rms"].append(logits.pow(2).mean(-1).sqrt().tolist())
            logits.cpu().numpy().astype(np.float32).tofile(os.path.join(args.out, f"logits_{i}.f32"))
            print(f"prompt {i}: {len(prompt)} tokens, greedy {tokens[:8]}...", flush=True)
    del model
    torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model = load(args.checkpoint, torch.float32)
    result["bf16_rel"] = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt + result["tokens"][i][: args.steps]], device="cuda")
            out = model(ids, use_cache=False, logits_to_keep=args.steps + 1)
            ref32 = out.logits[0].float()
            bf = torch.from_numpy(np.fromfile(os.path.join(args.out, f"logits_{i}.f32"), dtype=np.float32)).view(args.steps + 1, -1).cuda()
            rel = ((bf - ref32).norm(dim=-1) / ref32.norm(dim=-1)).tolist()
            result["bf16_rel"].append(rel)
            ref32.cpu().numpy().astype(np.float32).tofile(os.path.join(args.out, f"logits32_{i}.f32"))
            print(f"prompt {i}: HF bf16 against fp32: mean rel {np.mean(rel):.4g}, max {np.max(rel):.4g}", flush=True)
    with open(os.path.join(args.out, "ref.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
