#!/usr/bin/env bash
# Run the verbs backend's tests on a real RDMA device: Soft-RoCE (rdma_rxe)
# inside a qemu VM booted from Debian's stock kernel, no RDMA NIC needed.
#
#   tests/softroce/run.sh                 # the fabric_verbs test target
#   SOFTROCE_TESTS="fabric_verbs other" tests/softroce/run.sh
#   SOFTROCE_MEASURE=1 tests/softroce/run.sh   # also print the staging vs
#                                               # registration measurements
#   SOFTROCE_HOST_CHECKS=0 ...                  # skip the host-side checks
#   SOFTROCE_ENV="K=V ..." ...                  # more environment for the tests
#                                               # in the VM (suites_over_verbs.sh)
#   SOFTROCE_RELEASE=1 ...                      # build the test binaries with --release
#   SOFTROCE_MEM_MB=6144 ...                    # the VM's memory (default 2048)
#                                               # (for the measurements)
#   SOFTROCE_FILTER="name ..." ...              # only the tests whose names contain one
#                                               # of these (libtest filters; "" = all)
#
# Steps: install missing Debian packages; fetch (never install) the kernel
# package into a cache outside the repo; build the test binaries with the
# `verbs` feature; pack a gzip cpio initramfs (busybox, the binaries and
# their libraries, the rxe provider, the kernel modules); boot qemu with
# TCG and a restricted user-mode NIC (the guest reaches nothing outside the
# VM; all RDMA traffic is the guest talking to its own 10.0.2.15 over rxe0);
# create rxe0; run the tests; bring the exit status back through a console
# marker. Everything is bounded by SOFTROCE_TIMEOUT seconds (default 600).
set -euo pipefail

deadline=$((SECONDS + ${SOFTROCE_TIMEOUT:-600}))
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
tests="${SOFTROCE_TESTS:-fabric_verbs}"
# This checkout's own files in the shared cache (two checkouts may run at
# once): build listings, initramfs, console log.
run="$cache/run-$(printf %s "$root" | md5sum | cut -c1-8)"

# ---- 1. packages; 2. kernel (downloaded, unpacked in the cache, never installed)
ensure_packages
ensure_kernel

# ---- 3. test binaries ----------------------------------------------------
say "building test binaries ($tests) with --features verbs,verbs-device-tests"
cargo_args=()
for t in $tests; do cargo_args+=(--test "$t"); done
[ "${SOFTROCE_RELEASE:-0}" = 1 ] && cargo_args+=(--release)
json="$run.build.json"
(cd "$root" && timeout "$(left)" cargo test --features verbs,verbs-device-tests --no-run --message-format=json "${cargo_args[@]}" >"$json")
bins=()
for t in $tests; do
    b="$(grep '"reason":"compiler-artifact"' "$json" | grep "\"name\":\"$t\"" \
        | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' | tail -n1)"
    [ -n "$b" ] && [ -x "$b" ] || { say "no test executable for $t"; exit 1; }
    bins+=("$b")
done

bench=""
if [ "${SOFTROCE_BENCH:-0}" = 1 ]; then
    (cd "$root" && timeout "$(left)" cargo build --features verbs --bin rdma-device-bench --message-format=json >"$run.bench.json")
    bench="$(grep '"reason":"compiler-artifact"' "$run.bench.json" | grep '"name":"rdma-device-bench"' \
        | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' | tail -n1)"
    [ -x "$bench" ] || { say "no rdma-device-bench executable"; exit 1; }
fi

# Host-side checks first (cheap, already built): the backend's unit tests,
# and on this device-less host "not viable" with its reason, never an abort.
if [ "${SOFTROCE_HOST_CHECKS:-1}" = 1 ]; then
    say "host: verbs unit tests and the no-device check"
    (cd "$root" && timeout "$(left)" cargo test -q --features verbs --lib fabric::verbs)
    (cd "$root" && env -u RDMA_DEVICE_TEST_VERBS timeout "$(left)" cargo test -q --features verbs \
        --test fabric_verbs -- not_viable_without_device node_chooses_verbs --nocapture)
fi

# ---- 4. initramfs --------------------------------------------------------
new_stage
i=0
for b in "${bins[@]}"; do
    i=$((i + 1))
    copy_with_libs "$b" "/tests/$(printf '%02d' $i)-$(basename "$b")"
done
[ -n "$bench" ] && copy_with_libs "$bench" /bin/rdma-device-bench
stage_rdma_userland

# Modules in dependency order (resolved from modules.dep), decompressed so
# busybox insmod can load them.
for m in virtio_pci virtio_net crc32_generic rdma_rxe rdma_ucm; do add_mod "$m"; done

measure=""
[ "${SOFTROCE_MEASURE:-0}" = 1 ] && measure="RDMA_DEVICE_TEST_VERBS_MEASURE=1"
cat >"$stage/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev; mount -t tmpfs tmp /tmp
for m in \$(cat /modules.order); do insmod /lib/modules/\$m.ko || echo "insmod \$m failed"; done
ip link set lo up; ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0
rdma link add rxe0 type rxe netdev eth0 || echo "rdma link add failed"
echo "=== SOFTROCE-EVIDENCE"
uname -r
ibv_devices
ibv_devinfo -d rxe0 | grep -E 'hca_id|transport|state|active_mtu|link_layer'
rdma link show
ulimit -l unlimited
export RDMA_DEVICE_TEST_VERBS=1 RDMA_DEVICE_TEST_VERBS_ADDR=10.0.2.15 RUST_BACKTRACE=1 RDMA_DEVICE_LOG=info $measure ${SOFTROCE_ENV:-}
rc=0
for t in /tests/*; do
    echo "=== SOFTROCE-RUN \$t"
    \$t --test-threads=1 --nocapture ${SOFTROCE_FILTER:-} || rc=\$?
done
if [ -n "$measure" ]; then
    for t in /tests/*fabric_verbs*; do
        \$t --ignored --exact measure_send_strategies --nocapture || rc=\$?
        \$t --ignored --exact measure_write_cpu --nocapture || rc=\$?
    done
fi
if [ -x /bin/rdma-device-bench ]; then
    echo "=== SOFTROCE-BENCH"
    rdma-device-bench fabric --transport verbs --addr 10.0.2.15:18515 --quick || rc=\$?
fi
echo "=== SOFTROCE-EXIT-CODE \$rc"
poweroff -f
EOF
chmod +x "$stage/init"
initrd="$run.initrd.cpio.gz"
pack_initrd "$initrd"
say "initramfs $(du -h "$initrd" | cut -f1), kernel $kver, modules: ${mods_order[*]}"

# ---- 5. boot ---------------------------------------------------------------
log="$run.console.log"
say "booting qemu (TCG); console log: $log"
set +e
timeout "$(left)" "${qemu_tcg[@]}" -m "${SOFTROCE_MEM_MB:-2048}" -initrd "$initrd" -append "$kargs" \
    -netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0 </dev/null | tr -d '\r' | tee "$log"
qemu_rc=${PIPESTATUS[0]}
set -e
rc="$(sed -n 's/^=== SOFTROCE-EXIT-CODE \([0-9]*\).*/\1/p' "$log" | tail -n1)"
echo "---- softroce summary (device, test results) ----"
grep -E '^(hca_id|[[:space:]]+device|[[:space:]]+rxe0|link rxe0)|hca_id:|test result:|verbs-measure(-cpu)?:|two-process:|^multiprocess:|^=== SOFTROCE-RUN|FAILED|panicked' "$log" || true
if [ -n "$bench" ]; then sed -n '/^=== SOFTROCE-BENCH/,/^=== SOFTROCE-EXIT-CODE/p' "$log"; fi
if [ -z "$rc" ]; then
    say "no exit marker from the VM (qemu exit $qemu_rc): timeout or crash"
    exit 1
fi
say "tests in the VM exited with $rc"
exit "$rc"
