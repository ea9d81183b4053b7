#!/usr/bin/env bash
# Installs the Debian packages (scripts/setup.sh), configures and builds duet into build/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
jobs=${DUET_JOBS:-$(nproc)}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=${DUET_BUILD_TYPE:-RelWithDebInfo} ${DUET_CMAKE_ARGS:-} >/dev/null
cmake --build build -j "$jobs"
