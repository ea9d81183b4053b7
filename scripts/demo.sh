#!/usr/bin/env bash
# The quick start: installs, builds, starts a local cluster on the built-in sim deployment
# (router, KV-handle broker, prefill and decode actors over ZeroMQ), serves a burst of
# requests and prints the latency summary. No GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
exec ./build/duet demo "$@"
