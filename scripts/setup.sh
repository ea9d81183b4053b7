#!/usr/bin/env bash
# Installs every Debian package duet builds and tests with. Idempotent; needs root (or sudo).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libcaf-dev libzmq3-dev cppzmq-dev libmsgpack-cxx-dev doctest-dev libtomlplusplus-dev
  nlohmann-json3-dev libcli11-dev libpcre2-dev libxxhash-dev libutf8proc-dev libboost-dev libbenchmark-dev
  python3 python3-venv python3-zmq python3-msgpack clang libclang-rt-dev curl
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
