#!/usr/bin/env bash
# Fuzzes the message decoder (tests/fuzz/fuzz_decode.cpp) with libFuzzer, ASan and UBSan.
#   scripts/fuzz.sh [seconds]      default 20 seconds
# Builds into build-fuzz/ (rebuilt only when a source changed), seeds build-fuzz/corpus with
# one valid message of every type, then fuzzes with inputs of up to 4096 bytes. Exits
# non-zero when the fuzzer finds a crash, a leak, undefined behaviour or a broken property;
# the input that did it is saved under build-fuzz/crashes/ (replay: build-fuzz/fuzz_decode FILE).
# Environment: CXX_FUZZ (default clang++), DUET_FUZZ_DIR (default <repo>/build-fuzz).
set -euo pipefail

seconds=${1:-20}
if ! [[ $seconds =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "fuzz.sh: seconds must be a positive whole number, got '$seconds'" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${DUET_FUZZ_DIR:-$root/build-fuzz}
cxx=${CXX_FUZZ:-clang++}
bin=$out/fuzz_decode

command -v "$cxx" >/dev/null || { echo "fuzz.sh: $cxx not found (install clang)" >&2; exit 2; }
runtime=$("$cxx" -print-file-name=libclang_rt.fuzzer-x86_64.a)
[[ -f $runtime ]] || { echo "fuzz.sh: libFuzzer runtime not found (install libclang-rt-dev)" >&2; exit 2; }

mkdir -p "$out/corpus" "$out/crashes"
sources=("$root/tests/fuzz/fuzz_decode.cpp" "$root/messages/codec.cpp" "$root/messages/catalogue.cpp")
inputs=("${sources[@]}" "$root"/messages/*.hpp "$root/tests/message_samples.hpp" "$0")
stale=0
[[ -x $bin ]] || stale=1
for f in "${inputs[@]}"; do [[ $f -nt $bin ]] && stale=1; done
if ((stale)); then
  echo "fuzz.sh: building $bin"
  "$cxx" -std=c++20 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    -DMSGPACK_NO_BOOST -I"$root" "${sources[@]}" -o "$bin.tmp"
  mv "$bin.tmp" "$bin"
fi

# Seeds: written by the target itself, then run once (-runs=0 executes the corpus only).
DUET_FUZZ_WRITE_SEEDS="$out/corpus" "$bin" -runs=0 "$out/corpus" 2>&1 | tail -n 3

echo "fuzz.sh: fuzzing for ${seconds}s"
"$bin" -max_len=4096 -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
  -artifact_prefix="$out/crashes/" "$out/corpus"
