#!/usr/bin/env bash
# KV handover on the GPU machine, in one command (docs/benchmarks.md, "KV handover"):
#   build duet + bench_kv_handover -> the gather kernel's test -> handover time per path (bytes checked) ->
#   a live prefill/decode pipeline of CUDA engines on one GPU, three ways: one process (the
#   decode engine copies from the prefill pool's address), two processes over CUDA IPC, two
#   processes over the stream path; their greedy tokens must be identical.
# Needs .devdeps/ (../shared/device/fetch-debs.sh with EXTRA_DEBS="libboost1.74-dev
# libutf8proc-dev libutf8proc2 libbenchmark-dev libxxhash-dev libxxhash0"). Results in $OUT.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/handover.log") 2>&1
BUILD=${GPU_BUILD:-build-gpu}
source "$(dirname "$0")/gpu-env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "=== build ($(date +%T))"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DDUET_BENCH=ON >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build "$BUILD" -j16 --target duet bench_kv_handover test_cuda_kernels >"$OUT/build.log" 2>&1 || { grep -B2 -A8 error "$OUT/build.log" | head -80; exit 1; }

echo "=== kv_copy kernel test ($(date +%T))"
timeout 120 "$BUILD/tests/test_cuda_kernels" -tc='*kv_copy*' | tail -3

echo "=== bench_kv_handover ($(date +%T))"
timeout 300 "$BUILD/bench/bench_kv_handover" --json "$OUT/kv_handover.json" ${HANDOVER_ARGS:-}
echo "--- bench exit $?"

echo "=== pipeline ($(date +%T))"
CKPT=/tmp/duet-pipe-ckpt
# The 8B's attention shape (32 heads, 8 KV heads, head_dim 128) and vocabulary, two layers.
"$BUILD/duet" model random --preset r1-distill-llama-8b --layers 2 --ffn 1024 --out "$CKPT" >/dev/null || exit 1
common() {
  cat <<EOF
[model]
name = "pipe-8b-2l"
path = "$CKPT"
max_context = 8192
[engine]
kind = "cuda"
[broker]
transfer = "$1"
lease_ms = 20000
transfer_timeout_ms = 20000
EOF
}
actor() {  # actor NAME ROLE
  printf '[[nodes.actors]]\nname = "%s"\nrole = "%s"\n' "$1" "$2"
  case $2 in prefill|decode) printf 'device = 0\nkv_blocks = 2048\nmax_batch = 8\n' ;; esac
}
run_mode() {  # run_mode NAME TRANSFER NODES(1|2)
  local name=$1 transfer=$2 nodes=$3 cfg=/tmp/duet-pipe-$1.toml
  {
    common "$transfer"
    printf '[[nodes]]\nname = "p"\nendpoint = "ipc:///tmp/duet-pipe-%s-p.sock"\n' "$name"
    actor router router; actor broker broker; actor prefill0 prefill
    if [ "$nodes" = 2 ]; then printf '[[nodes]]\nname = "d"\nendpoint = "ipc:///tmp/duet-pipe-%s-d.sock"\n' "$name"; fi
    actor decode0 decode
  } >"$cfg"
  "$BUILD/duet" node --config "$cfg" --name p >"$OUT/node-$name-p.log" 2>&1 &
  local pids=$!
  if [ "$nodes" = 2 ]; then "$BUILD/duet" node --config "$cfg" --name d >"$OUT/node-$name-d.log" 2>&1 & pids="$pids $!"; fi
  sleep 8
  for i in 1 2 3 4; do
    timeout 60 "$BUILD/duet" client --config "$cfg" --tokens "$(prompt $((i * 1500)) $i)" --ids --temperature 0 \
      --max-new-tokens 24 >"$OUT/tokens-$name-$i.txt" 2>&1 || echo "client $name $i failed"
  done
  timeout 20 "$BUILD/duet" stats --config "$cfg" >"$OUT/stats-$name.txt" 2>&1
  grep -E "transfers_|path_|imported_bytes|stream_bytes|transfer_failures|free_blocks" "$OUT/stats-$name.txt" | head -20
  kill $pids 2>/dev/null; wait $pids 2>/dev/null
}
run_mode one-process auto 1
run_mode ipc auto 2
run_mode stream stream 2
same=yes
for i in 1 2 3 4; do
  for m in ipc stream; do cmp -s "$OUT/tokens-one-process-$i.txt" "$OUT/tokens-$m-$i.txt" || same=no; done
  head -c 300 "$OUT/tokens-one-process-$i.txt"; echo
done
echo "=== pipeline tokens identical across one-process / cuda_ipc / stream: $same ($(date +%T))"
