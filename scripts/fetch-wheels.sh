#!/usr/bin/env bash
# Fetches locust (the version tests/requirements.txt pins) and everything it needs as binary
# wheels for the GPU machine's Python (CPython 3.12, manylinux x86_64) into .devwheels/ at the
# repository root, plus pip itself (to bootstrap a venv made without ensurepip). The GPU
# machine has no package registry: a run carries .devwheels and installs from it offline
# (scripts/gpu-serve.sh, stage fidelity):
#   python3 -m venv V && V/bin/pip install --no-index --find-links .devwheels locust
#
#   scripts/fetch-wheels.sh                      # here, with PyPI reachable
#   DUET_WHEELS_DIR=/tmp/w scripts/fetch-wheels.sh
#
# Then checks that the set alone resolves locust for that target (pip --dry-run --no-index)
# and prints its size. .devwheels/ is git-excluded (never commit wheels).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${DUET_WHEELS_DIR:-$root/.devwheels}"
python="${PYTHON:-python3}"
say() { printf 'fetch-wheels: %s\n' "$*"; }

locust=$(grep -E '^locust==' "$root/tests/requirements.txt" || true)
[ -n "$locust" ] || { say "error: no locust== pin in tests/requirements.txt" >&2; exit 1; }

# pip matches manylinux_2_N tags exactly: list every N a wheel of these packages may carry
# (Ubuntu 24.04's glibc is 2.39, so any of them installs there).
target=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 5 12 17 24 26 27 28 31 34 35 36 38 39; do target+=(--platform "manylinux_2_${n}_x86_64"); done

mkdir -p "$dir"
if [ "$dir" = "$root/.devwheels" ] && ! grep -qxF '/.devwheels/' "$root/.git/info/exclude" 2>/dev/null; then
  echo '/.devwheels/' >>"$root/.git/info/exclude"
fi
# Only PyPI: a local --find-links (PIP_FIND_LINKS) could offer wheels of another version.
export PIP_FIND_LINKS=
"$python" -m pip download --quiet --disable-pip-version-check --no-cache-dir --dest "$dir" \
  "${target[@]}" "$locust" pip

# One version of each project, or an offline install may pick the wrong one.
wheels=("$dir"/*.whl)
dupes=$(printf '%s\n' "${wheels[@]##*/}" | awk -F- '{print tolower($1)}' | sort | uniq -d)
[ -z "$dupes" ] || { say "error: several versions of: $dupes (empty $dir and run again)" >&2; exit 1; }

"$python" -m pip install --quiet --disable-pip-version-check --dry-run --ignore-installed \
  --no-index --find-links "$dir" --target "$(mktemp -d)" "${target[@]}" "$locust"
say "${#wheels[@]} wheels, $(du -sh "$dir" | cut -f1) in $dir; $locust resolves offline for cp312"
