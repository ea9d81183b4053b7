#!/usr/bin/env bash
# Decode preemption on the CUDA engine, on the GPU machine (docs/architecture.md, "KV on demand"):
# one process with a prefill and a decode actor on one GPU, a decode pool too small for four
# concurrent sequences at full length. kv_allocation = "reserve" (each sequence reserves its whole
# length up front: they queue) and "on_demand" (they all start; the youngest is preempted and
# recomputed). Every request must finish with all its tokens and the pool must be full again; the
# stats show the preemptions, and the greedy tokens of the two runs are compared.
# Needs .devdeps/ as scripts/gpu-check.sh does. Results in $OUT.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/preempt.log") 2>&1
BUILD=${GPU_BUILD:-build-gpu}
source "$(dirname "$0")/gpu-env.sh"
echo "=== build ($(date +%T))"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build "$BUILD" -j16 --target duet >"$OUT/build.log" 2>&1 || { grep -B2 -A8 error "$OUT/build.log" | head -80; exit 1; }

CKPT=/tmp/duet-preempt-ckpt
# The 8B's attention shape (32 heads, 8 KV heads, head_dim 128) and vocabulary, two layers.
"$BUILD/duet" model random --preset r1-distill-llama-8b --layers 2 --ffn 1024 --out "$CKPT" >/dev/null || exit 1
run_mode() {  # run_mode ALLOCATION
  local mode=$1 cfg=/tmp/duet-preempt-$1.toml
  cat >"$cfg" <<EOF
[model]
name = "preempt-8b-2l"
path = "$CKPT"
max_context = 8192
[engine]
kind = "cuda"
[broker]
lease_ms = 30000
transfer_timeout_ms = 30000
[[nodes]]
name = "p"
endpoint = "ipc:///tmp/duet-preempt-$mode.sock"
[[nodes.actors]]
name = "router"
role = "router"
[[nodes.actors]]
name = "broker"
role = "broker"
[[nodes.actors]]
name = "prefill0"
role = "prefill"
kv_blocks = 2048
max_batch = 8
[[nodes.actors]]
name = "decode0"
role = "decode"
kv_blocks = 300
max_batch = 8
kv_allocation = "$mode"
EOF
  "$BUILD/duet" node --config "$cfg" --name p >"$OUT/node-$mode.log" 2>&1 &
  local node=$!
  sleep 8
  # Four requests at once: 1,500-token prompts and 300 new tokens need 113 blocks each at full
  # length, so 300 blocks hold two of them reserved, three (then two) on demand.
  local clients=()
  for i in 1 2 3 4; do
    timeout 120 "$BUILD/duet" client --config "$cfg" --tokens "$(prompt 1500 $i)" --ids --temperature 0 \
      --max-new-tokens 300 >"$OUT/tokens-$mode-$i.txt" 2>&1 &
    clients+=($!)
  done
  for c in "${clients[@]}"; do wait "$c" || echo "a client of $mode failed"; done
  timeout 20 "$BUILD/duet" stats --config "$cfg" >"$OUT/stats-$mode.txt" 2>&1
  grep -E "decode0|preempt|recomputed|resumed|free_blocks|finished_" "$OUT/stats-$mode.txt" | head -30
  kill $node 2>/dev/null; wait $node 2>/dev/null
}
echo "=== reserve ($(date +%T))"
run_mode reserve
echo "=== on_demand ($(date +%T))"
run_mode on_demand
# Where each request's greedy tokens first differ. On the GPU the batch a sequence shares a step
# with picks the GEMM path and its bf16 rounding (m = 1 skinny vs cuBLASLt), and random weights
# leave top-2 logit margins inside that noise, so tokens may part after the batches part; the
# CPU engine's test (tests/test_cores.cpp) asserts exact equality.
python3 - "$OUT" <<'PY'
import re, sys
out = sys.argv[1]
bad = False
def ids(path):
    return [int(t) for t in re.findall(r"-?\d+", open(path).read().split("[")[0])]
for i in range(1, 5):
    a, b = ids(f"{out}/tokens-reserve-{i}.txt"), ids(f"{out}/tokens-on_demand-{i}.txt")
    first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"request {i}: {len(a)} / {len(b)} ids; " +
          ("identical" if first is None and len(a) == len(b) else f"first difference at id {first}"))
    bad = bad or len(a) != 300 or len(b) != 300
sys.exit(1 if bad else 0)
PY
