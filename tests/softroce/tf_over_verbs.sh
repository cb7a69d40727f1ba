#!/usr/bin/env bash
# TensorFlow over verbs, end to end, on Soft-RoCE: boots the qemu VM (TCG)
# into this host's own root file system (9p, read-only; see
# build_hostroot_initrd in common.sh), so the guest runs the venv's Python
# with TensorFlow and the installed rdma_device plugin against its own
# kernel and rxe0. Inside, tf_over_verbs.py trains the TF1 graph of
# tests/python (chief, worker, ps on 10.0.2.15) under "grpc" and then under
# "grpc+rdma_device" with RDMA_DEVICE_TRANSPORTS=verbs RDMA_DEVICE_STRICT=1
# and prints "tf-over-verbs: ..." (steps, bit-identity, verbs counters).
#
#   tests/softroce/tf_over_verbs.sh
#   RDMA_DEVICE_VENV=...   the venv with tensorflow and the plugin
#                          (default ~/.cache/rdma_device/venv, .ci/setup.sh)
#   TF_VERBS_STEPS=5       training steps per run
#   SOFTROCE_TIMEOUT=2400  bound on the whole run, in seconds
#
# Slow: TCG emulation makes every `import tensorflow` take minutes (see
# README.md in this directory for measured times); not part of .ci/test.sh.
set -euo pipefail

deadline=$((SECONDS + ${SOFTROCE_TIMEOUT:-2400}))
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
venv="${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}"
steps="${TF_VERBS_STEPS:-5}"

ensure_packages
ensure_kernel
"$venv/bin/python" - <<'EOF' || { say "no usable rdma_device plugin in $venv: run .ci/setup.sh (RDMA_DEVICE_VENV=$venv)"; exit 1; }
import os, rdma_device
assert os.path.exists(os.path.join(rdma_device.lib_dir(), "librdma_device_tf.so"))
EOF

initrd="$cache/initrd-hostroot.cpio.gz"
build_hostroot_initrd "$initrd"

# The guest's script lives in the cache (the guest sees the host's files,
# except /tmp, /run and /dev/shm, which are its own).
guest="$cache/tf-over-verbs.guest.sh"
cat >"$guest" <<EOF
set -u
cd "$root"
echo "=== SOFTROCE-EVIDENCE"
ibv_devices; rdma link show
t0=\$(cut -d' ' -f1 /proc/uptime)
"$venv/bin/python" -c "import tensorflow as tf; print('tensorflow', tf.__version__)"
t1=\$(cut -d' ' -f1 /proc/uptime)
echo "tf-over-verbs-progress: one import tensorflow took \$(echo "\$t0 \$t1" | awk '{printf "%.0f", \$2 - \$1}') s"
"$venv/bin/python" tests/softroce/tf_over_verbs.py 10.0.2.15 $steps /tmp/tf-logs
EOF

log="$cache/tf-over-verbs.console.log"
say "booting qemu (TCG, 6 GiB) into the host's root; console log: $log"
start=$SECONDS
set +e
timeout "$(left)" "${qemu_tcg[@]}" -m 6144 -initrd "$initrd" "${hostroot_share[@]}" \
    -append "$kargs RDEV_NET=eth0=10.0.2.15/24 RDEV_RUN=$guest" \
    -netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0 </dev/null \
    | stdbuf -oL tr -d '\r' | tee "$log"
qemu_rc=${PIPESTATUS[0]}
set -e
rc="$(sed -n 's/^=== SOFTROCE-EXIT-CODE \([0-9]*\).*/\1/p' "$log" | tail -n1)"
echo "---- tf-over-verbs summary ($((SECONDS - start)) s in the VM) ----"
grep -E '^tf-over-verbs' "$log" || true
if [ -z "$rc" ]; then
    say "no exit marker from the VM (qemu exit $qemu_rc): timeout or crash"
    exit 1
fi
exit "$rc"
