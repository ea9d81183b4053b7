# Sourced by the scripts/gpu-*.sh scripts on the GPU machine: our Debian libraries from
# .devdeps/ (../shared/device/fetch-debs.sh) when present, NVLink multicast off for NCCL, and prompt().
if [ -d .devdeps ]; then
  source .devdeps/unpack-debs.sh .devdeps
  # libzmq.pc names private requirements whose -dev packages are not carried: empty stand-ins.
  mkdir -p /opt/deps/stub-pc
  for pc in krb5-gssapi libsodium openpgm-5.3 norm libbsd; do
    printf 'Name: %s\nDescription: stand-in\nVersion: 99\n' "$pc" > "/opt/deps/stub-pc/$pc.pc"
  done
  export PKG_CONFIG_PATH=/opt/deps/stub-pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
fi
export NCCL_NVLS_ENABLE=0

# run NAME TIMEOUT CMD...: CMD under a time limit; a failure is added to the caller's `failed`
# array and never stops the script.
run() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "--- $name: exit $rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || failed+=("$name($rc)")
  return $rc
}

# prompt N SEED: N random token ids, comma separated (the same for the same seed).
prompt() {
  python3 -c "import random; r=random.Random($2); print(','.join(str(r.randrange(1000,120000)) for _ in range($1)))"
}

# gpu_build_duet BUILD: duet built for Hopper (Release, sm_90) into BUILD unless it is there;
# logs in $OUT/configure.log and build.log, and the script exits on a failure.
gpu_build_duet() {
  [ -x "$1/duet" ] && return 0
  echo "=== build ($(date +%T))"
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDUET_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  cmake --build "$1" -j"$(nproc)" --target duet >"$OUT/build.log" 2>&1 ||
    { grep -B2 -A8 -E 'error|FAILED' "$OUT/build.log" | head -80; exit 1; }
  echo "--- built in ${SECONDS}s"
}

# gpu_random_checkpoint BUILD CKPT: the R1-Distill-Llama-8B-shaped random checkpoint (16 GB),
# written by BUILD's duet unless CKPT has one.
gpu_random_checkpoint() {
  [ -f "$2/config.json" ] && return 0
  echo "=== checkpoint ($(date +%T))"
  "$1/duet" model random --preset r1-distill-llama-8b --out "$2" >/dev/null || exit 1
}
