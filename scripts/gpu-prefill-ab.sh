#!/usr/bin/env bash
# The prefill side of scripts/gpu-engine-ab.sh (the name the notes of 2026-12-05 use).
GPU_AB_PHASE=prefill exec bash "$(dirname "$0")/gpu-engine-ab.sh" "$@"
