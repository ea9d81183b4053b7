#!/usr/bin/env bash
# config/single-gpu.toml on the GPU machine (issue 5, "In the pipeline"; docs/cuda-engine.md):
# `duet up` with the router, broker, a prefill and a decode actor on GPU 0, the two workers in
# one KV pool (a handover moves block ownership: path same_pool), requests end to end.
#   1. The 8B-shaped checkpoint: the Hugging Face reference prompts (tests/cuda_hf_reference.py)
#      through the pipeline, greedy; their tokens against HF's under the rule of tests/cuda_e2e.cpp
#      (equal wherever HF's top-2 margin exceeds 8 sigma of the bf16 noise; after the first
#      step below it the two may part, and the rest is not compared).
#   2. A tiny Llama (2 layers, the real vocabulary): the same deployment on the cuda engine and on
#      the cpu engine (the fp32 reference); their greedy tokens must be equal.
#   3. One /v1/completions request over HTTP, and the handover counters (duet stats).
# Usage (gpu-check.sh stage pipeline): scripts/gpu-pipeline.sh BUILD CKPT HFREF
# Results: $OUT/pipeline.md, $OUT/pipeline.json, $OUT/pipeline-*.log.
set -u
BUILD=$1 CKPT=$2 HFREF=$3
OUT=${OUT:-$PWD/gpu-out}
DUET=$BUILD/duet
TINY=$BUILD/tiny-llama-random
fail=0

deploy() {  # deploy NAME MODEL_DIR ENGINE HTTP_PORT: config/single-gpu.toml with those changed
  sed -e "s|^path = .*|path = \"$2\"|" -e "s|^kind = .*|kind = \"$3\"|" \
      -e "s|ipc:///tmp/duet-single-gpu.sock|ipc:///tmp/duet-pipe-$1.sock|" -e "s|127.0.0.1:8080|127.0.0.1:$4|" \
      config/single-gpu.toml >"$BUILD/pipe-$1.toml"
  echo "$BUILD/pipe-$1.toml"
}

completion() {  # completion PORT < JSON body: one /v1/completions request (the body may be MBs of ids)
  timeout 120 curl -s "127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' -d @-
}

start_up() {  # start_up NAME CONFIG: `duet up` in the background (pid in up_pid), until it serves (240 s at most)
  "$DUET" up --config "$2" >"$OUT/pipeline-$1.log" 2>&1 &
  up_pid=$!
  local t0=$SECONDS
  while [ $((SECONDS - t0)) -lt 240 ] && kill -0 $up_pid 2>/dev/null; do
    if timeout 20 "$DUET" client --config "$2" --tokens 1,2,3 --ids --max-new-tokens 1 --timeout-ms 15000 \
        >/dev/null 2>&1; then
      echo "--- $1: ready after $((SECONDS - t0)) s"
      return 0
    fi
    sleep 2
  done
  echo "--- $1: not ready after $((SECONDS - t0)) s"
  tail -20 "$OUT/pipeline-$1.log"
  return 1
}

stop_up() { kill $up_pid 2>/dev/null; wait $up_pid 2>/dev/null; }

prepare_8b() {
  # cuda_e2e writes no tokenizer; the pipeline's front end needs one, and its load check wants
  # the tokenizer's eos (<|eot_id|>) among the model's (as the real checkpoint has): eos ids
  # change no logit, so HF's reference stands.
  [ -f "$CKPT/tokenizer.json" ] ||
    cp tests/data/tokenizers/llama3_1/tokenizer.json tests/data/tokenizers/llama3_1/tokenizer_config.json "$CKPT/"
  python3 - "$CKPT/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
eos = c.get("eos_token_id")
eos = eos if isinstance(eos, list) else [eos]
if 128009 not in eos:
    c["eos_token_id"] = eos + [128009]
    json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
}

serve() {  # serve NAME CONFIG PROMPTS MAX_NEW PORT: one line of greedy ids per prompt line
  local name=$1 cfg=$2 prompts=$3 max_new=$4 port=$5
  : >"$OUT/pipeline-$name.tokens"
  if start_up "$name" "$cfg"; then
    while read -r line; do
      timeout 120 "$DUET" client --config "$cfg" --tokens "$line" --ids --temperature 0 --max-new-tokens "$max_new" \
        --timeout-ms 100000 2>&1 | head -1 >>"$OUT/pipeline-$name.tokens"
    done <"$prompts"
    echo '{"model":"r1-distill-llama-8b","prompt":"Hello","max_tokens":8,"temperature":0}' |
      completion "$port" >"$OUT/pipeline-$name-http.json" 2>&1
    if [ "${LOGPROBS:-0}" = 1 ]; then
      # The same greedy requests over HTTP with the top-2 log-probabilities of every step.
      : >"$OUT/pipeline-$name-lp.jsonl"
      while read -r line; do
        echo "{\"model\":\"r1-distill-llama-8b\",\"prompt\":[$line],\"max_tokens\":$max_new,\"temperature\":0,\"logprobs\":2}" |
          completion "$port" >>"$OUT/pipeline-$name-lp.jsonl"
        echo >>"$OUT/pipeline-$name-lp.jsonl"
      done <"$prompts"
    fi
    echo "--- $name: HTTP $(head -c 300 "$OUT/pipeline-$name-http.json")"
    timeout 20 "$DUET" stats --config "$cfg" >"$OUT/pipeline-$name-stats.txt" 2>&1
    grep -E "transfers_|path_|handover_us|moved_blocks|imported_bytes|free_blocks|total_blocks" \
      "$OUT/pipeline-$name-stats.txt" | head -24
  else
    fail=1
  fi
  stop_up
}

if [ -n "${HANDOVER_LENGTHS:-}" ]; then
  # Handover time against prompt length (docs/benchmarks.md, "KV handover"): one prompt per
  # length through the 8B pipeline; the decode worker's handover_us_same_pool grows by each
  # request's time from its pull to its KV in place.
  prepare_8b
  cfg=$(deploy lengths "$PWD/$CKPT" cuda 8184)
  start_up lengths "$cfg" || exit 1
  counter() { timeout 20 "$DUET" stats --config "$cfg" 2>/dev/null | awk -v k="$1" '$1 == k {s += $2} END {print s + 0}'; }
  echo "| prompt tokens | KV bytes (8B shape) | handover µs (pull to KV in place) |" | tee "$OUT/handover-lengths.md"
  echo "| --- | --- | --- |" | tee -a "$OUT/handover-lengths.md"
  for n in $HANDOVER_LENGTHS; do
    for rep in 1 2 3; do
      before=$(counter handover_us_same_pool)
      # Over HTTP, the body on stdin: 32K ids on a command line pass the kernel's 128 KiB per argument.
      python3 -c "import json,random; r=random.Random($n*10+$rep); print(json.dumps({'model':'r1-distill-llama-8b','prompt':[r.randrange(128000) for _ in range($n)],'max_tokens':2,'temperature':0}))" |
        completion 8184 | head -c 200 >>"$OUT/pipeline-lengths-http.txt"
      after=$(counter handover_us_same_pool)
      echo "| $n | $(( (n + 15) / 16 * 2 ))  MiB | $((after - before)) |" | tee -a "$OUT/handover-lengths.md"
    done
  done
  timeout 20 "$DUET" stats --config "$cfg" >"$OUT/pipeline-lengths-stats.txt" 2>&1
  stop_up
  exit 0
fi

# 1. The 8B shape against HF.
prepare_8b
python3 -c "import json,sys; [print(','.join(map(str,p))) for p in json.load(open(sys.argv[1]))['prompts']]" \
  "$HFREF/ref.json" >"$BUILD/pipe-8b.prompts" || exit 1
serve 8b "$(deploy 8b "$PWD/$CKPT" cuda 8181)" "$BUILD/pipe-8b.prompts" 65 8181

# 2. A tiny Llama: cuda against cpu. Two layers, the 8B's head_dim (the only one the cuda engine
# takes) and GQA group of 4, the real vocabulary. Weights of stddev 0.1 make its logits' std ~2
# over 128K tokens, so top-2 margins are far above bf16 rounding: greedy is the model's.
"$DUET" model random --preset tiny-llama --hidden 512 --heads 4 --kv-heads 1 --head-dim 128 --ffn 1024 \
  --stddev 0.1 --seed 7 --out "$TINY" >/dev/null || exit 1
python3 -c "
import random
r = random.Random(5)
for n in (7, 300, 2100, 40): print(','.join(str(r.randrange(128000)) for _ in range(n)))" >"$BUILD/pipe-tiny.prompts"
LOGPROBS=1 serve tiny-cuda "$(deploy tiny-cuda "$TINY" cuda 8182)" "$BUILD/pipe-tiny.prompts" 48 8182
LOGPROBS=1 serve tiny-cpu "$(deploy tiny-cpu "$TINY" cpu 8183)" "$BUILD/pipe-tiny.prompts" 48 8183

python3 - "$OUT" "$HFREF/ref.json" <<'PY' || fail=1
import json, math, sys
out, ref_path = sys.argv[1], sys.argv[2]
def lines(name):
    try:
        return [[int(t) for t in l.split()] if l.strip() and l.split()[0].lstrip('-').isdigit() else None
                for l in open(f"{out}/pipeline-{name}.tokens")]
    except OSError:
        return []
ref = json.load(open(ref_path))
report = {"8b": [], "tiny": []}
ok = True
md = ["| 8B prompt | tokens | steps compared | first difference (step, HF margin, bound) | rule |", "| --- | --- | --- | --- | --- |"]
got = lines("8b")
for i, hf in enumerate(ref["tokens"]):
    ours = got[i] if i < len(got) else None
    row = {"prompt": i, "prompt_tokens": len(ref["prompts"][i])}
    if ours is None:
        ok = False
        row["error"] = "no tokens"
        md.append(f"| {i} | - | - | - | FAILED (no tokens) |")
        report["8b"].append(row)
        continue
    compared, diff, violation = 0, None, False
    for s, tok in enumerate(ours[: len(hf)]):
        tau = 8.0 * ref["bf16_rel"][i][s] * ref["rms"][i][s]
        compared += 1
        if tok != hf[s]:
            diff = (s, ref["margins"][i][s], tau)
            violation = ref["margins"][i][s] > tau
            break
    ok &= not violation
    row.update({"tokens": len(ours), "compared": compared, "first_difference": diff, "violation": violation})
    report["8b"].append(row)
    d = "none" if diff is None else f"{diff[0]}, {diff[1]:.4f}, {diff[2]:.4f}"
    md.append(f"| {i} ({len(ref['prompts'][i])} tok) | {len(ours)} | {compared} | {d} | {'VIOLATION' if violation else 'ok'} |")
cuda, cpu = lines("tiny-cuda"), lines("tiny-cpu")
def logprobs(name):
    try:
        return [json.loads(l)["choices"][0]["logprobs"] if l.strip() else None for l in open(f"{out}/pipeline-{name}-lp.jsonl")]
    except (OSError, ValueError, KeyError, IndexError):
        return []
lp_cuda, lp_cpu = logprobs("tiny-cuda"), logprobs("tiny-cpu")
def margin(lp, s):
    top = sorted(lp["top_logprobs"][s].values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")
# The tiny rule, as the 8B's: equal wherever the cpu engine's top-2 margin exceeds 8 sigma of the
# noise between the engines, sigma measured on the prompt's agreeing steps (the rms difference of
# the two engines' log-probabilities of the same greedy token).
md += ["", "| tiny prompt | tokens (cuda / cpu) | equal steps | first difference: cpu margin, cuda margin, 8 sigma | rule |",
       "| --- | --- | --- | --- | --- |"]
for i in range(max(len(cuda), len(cpu), 4)):
    a = cuda[i] if i < len(cuda) else None
    b = cpu[i] if i < len(cpu) else None
    row = {"prompt": i, "cuda": a, "cpu": b}
    if not a or not b:
        ok = False
        md.append(f"| {i} | - | - | - | FAILED (no tokens) |")
        report["tiny"].append(row)
        continue
    first = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    verdict, detail = "ok", "none"
    if first is not None:
        try:
            la, lb = lp_cuda[i], lp_cpu[i]
            diffs = [la["token_logprobs"][k] - lb["token_logprobs"][k] for k in range(first)]
            sigma = math.sqrt(sum(d * d for d in diffs) / len(diffs)) if diffs else abs(
                max(la["top_logprobs"][0].values()) - max(lb["top_logprobs"][0].values()))
            m_cpu, m_cuda = margin(lb, first), margin(la, first)
            row.update({"sigma": sigma, "cpu_margin": m_cpu, "cuda_margin": m_cuda})
            detail = f"step {first}: {m_cpu:.4f}, {m_cuda:.4f}, {8 * sigma:.4f}"
            if m_cpu > 8 * sigma:
                verdict, ok = "VIOLATION", False
        except (TypeError, KeyError, IndexError, ValueError) as e:
            verdict, ok = f"FAILED (logprobs: {e})", False
    row.update({"first_difference": first, "verdict": verdict})
    report["tiny"].append(row)
    md.append(f"| {i} | {len(a)} / {len(b)} | {first if first is not None else len(a)} | {detail} | {verdict} |")
report["ok"] = bool(ok)
json.dump(report, open(f"{out}/pipeline.json", "w"), indent=1)
open(f"{out}/pipeline.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
print("PIPELINE:", "ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
exit $fail
