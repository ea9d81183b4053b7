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

# prompt N SEED: N random token ids, comma separated (the same for the same seed).
prompt() {
  python3 -c "import random; r=random.Random($2); print(','.join(str(r.randrange(1000,120000)) for _ in range($1)))"
}
