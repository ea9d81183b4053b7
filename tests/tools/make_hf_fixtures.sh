#!/usr/bin/env bash
# Regenerates tests/data/hf-fixtures/ (the CPU engine's Hugging Face references) into OUT_DIR:
# writes the tiny random checkpoints with the Python twin of duet's writer, then runs
# transformers on them. Needs python3 with numpy, torch, transformers and safetensors; the GPU
# machine has them (docs/cpu-engine.md). Usage: tests/tools/make_hf_fixtures.sh OUT_DIR [WORK_DIR]
set -euo pipefail
out=${1:?usage: make_hf_fixtures.sh OUT_DIR [WORK_DIR]}
work=${2:-$(mktemp -d)}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
# The same arguments as tiny_params() in tests/test_cpu_engine.cpp.
for arch in llama qwen2; do
  python3 "$here/make_tiny_checkpoint.py" "$work/$arch" --arch "$arch" --size tiny --seed 1 --dtype bf16 --norm-stddev 0.1
  python3 "$here/make_hf_fixtures.py" model "$work/$arch" "$out/${arch}_tiny.json" \
    --arch "$arch" --size tiny --seed 1 --dtype bf16 --norm-stddev 0.1
  sha256sum "$work/$arch/model.safetensors" "$work/$arch/config.json"
done
# The rotary embedding of the full R1-Distill-Llama-8B config (no weights needed).
python3 "$here/make_tiny_checkpoint.py" "$work/llama8b" --arch llama --size full --config-only
python3 "$here/make_hf_fixtures.py" rope "$work/llama8b" "$out/rope_llama3_8b.json"
