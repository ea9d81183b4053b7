#!/usr/bin/env bash
# Sets up everything the tests need on a fresh Debian 12 machine and runs every test:
# Debian packages, a Python venv with pinned test tools, the embedded model, the build, ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -x .venv/bin/python ] || ! cmp -s tests/requirements.txt .venv/requirements.txt; then
  python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt
  cp tests/requirements.txt .venv/requirements.txt
fi
if [ -x scripts/fetch-model.sh ]; then bash scripts/fetch-model.sh; fi
bash scripts/build.sh
cd build
ctest --output-on-failure -j "${DUET_TEST_JOBS:-2}" "$@"
