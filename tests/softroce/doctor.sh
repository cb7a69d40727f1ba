#!/usr/bin/env bash
# `python -m rdma_device doctor` where there is an RDMA device: two qemu VMs
# (TCG) booted into this host's root (read-only 9p, build_hostroot_initrd in
# common.sh), each with its own rxe0, on one virtual L2 (a qemu socket
# netdev on 127.0.0.1, as two_hosts.sh): host A 10.0.3.1, host B 10.0.3.2.
# The guests run this checkout's package with the venv's Python: the
# in-place build (PYTHONPATH=python, python/rdma_device/lib) when there is
# one, else the package .ci/setup.sh installed into the venv.
#
#   A and B: the pair test across the two hosts over verbs
#            (A: doctor --listen, B: doctor --peer --quick;
#            RDMA_DEVICE_TRANSPORTS=verbs on both sides);
#   A:       the pair test over loopback (both sides on 10.0.3.1, verbs
#            only: rxe0 to itself);
#   A:       the MTU check at the interface's 1500 bytes (an RDMA MTU of
#            1024: "!" with the jumbo-frame fix), then `ip link set eth0 mtu
#            9000` and the full host checks with --json (imports
#            TensorFlow: minutes under TCG), each expected ✓.
# The assertions run here, on the console lines the guests print
# ("doctor-a: NAME JSON", "doctor-b: ..."), and the script ends with one
# "doctor-vm: ok ..." line (or FAILED with what was wrong).
#
#   tests/softroce/doctor.sh       (SOFTROCE_TIMEOUT, default 1500 s)
#   RDMA_DEVICE_VENV=...            the venv with TensorFlow (default
#                                   ~/.cache/rdma_device/venv, .ci/setup.sh)
set -euo pipefail

deadline=$((SECONDS + ${SOFTROCE_TIMEOUT:-1500}))
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
venv="${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}"
ensure_packages
ensure_kernel
# The package: an in-place build of this checkout when there is one, else
# the one installed in the venv (.ci/setup.sh installs this checkout there).
pythonpath=""
[ -f "$root/python/rdma_device/lib/librdma_device_tf.so" ] && pythonpath="$root/python"
lib="$(PYTHONPATH="$pythonpath" "$venv/bin/python" -c 'import rdma_device; print(rdma_device.lib_dir())')" \
    || { say "no rdma_device package: run .ci/setup.sh or build in place"; exit 1; }
grep -q libibverbs <(ldd "$lib/librdma_device.so") \
    || { say "$lib/librdma_device.so has no verbs backend: build it with --features verbs"; exit 1; }
say "the package's libraries: $lib"

run="$cache/doctor-$(printf %s "$root" | md5sum | cut -c1-8)"
initrd="$run.initrd.cpio.gz"  # this checkout's own: another may be packing the shared one
build_hostroot_initrd "$initrd"

pair_port=18701 loop_port=18702
common_env="cd '$root'; export PYTHONPATH='$pythonpath' PYTHONDONTWRITEBYTECODE=1 RDMA_DEVICE_LOG=warn; py='$venv/bin/python'"
# one_line NAME FILE: the JSON in FILE as one console line "doctor-X: NAME {...}".
one_line='"$py" -c "import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$2" 2>/dev/null | sed "s/^/$ME: $1 /"'
cat >"$run.a.guest.sh" <<EOF
set -u
$common_env
ME=doctor-a
one_line() { $one_line; }
ibv_devices
# 1. the pair across the two hosts: B retries --peer until this listens.
RDMA_DEVICE_TRANSPORTS=verbs timeout 600 "\$py" -m rdma_device doctor --listen $pair_port --addr 10.0.3.1 --timeout 500 \
    > /tmp/listen-b.out 2>&1
echo "\$ME: listener for B exited \$?"
sed 's/^/doctor-a: listener: /' /tmp/listen-b.out
# 2. the pair over loopback, verbs only.
RDMA_DEVICE_TRANSPORTS=verbs timeout 300 "\$py" -m rdma_device doctor --listen $loop_port --addr 10.0.3.1 --timeout 240 \
    > /tmp/listen-loop.out 2>&1 &
lpid=\$!
for i in \$(seq 600); do grep -q waiting /tmp/listen-loop.out && break; sleep 0.5; done
RDMA_DEVICE_TRANSPORTS=verbs timeout 300 "\$py" -m rdma_device doctor --peer 10.0.3.1:$loop_port --quick --json \
    > /tmp/loop.json 2> /tmp/loop.err
echo "\$ME: loopback peer exited \$?"
wait \$lpid
echo "\$ME: loopback listener exited \$?"
sed 's/^/doctor-a: loopback listener: /' /tmp/listen-loop.out
tail -5 /tmp/loop.err | sed 's/^/doctor-a: loopback stderr: /'
one_line loopback /tmp/loop.json
# 3. the MTU check at 1500 (no TensorFlow needed), then the host checks at 9000.
"\$py" -c "import json; from rdma_device.doctor import host as d; print(json.dumps(d.check_mtu(d.rdma_ports(), 'eth0')))" \
    > /tmp/mtu1500.json 2> /tmp/mtu1500.err
one_line mtu1500 /tmp/mtu1500.json
ip link set eth0 mtu 9000 && echo "\$ME: eth0 mtu 9000"
ibv_devinfo -d rxe0 | grep -E 'state|active_mtu' | sed 's/^/doctor-a: /'
t0=\$(cut -d' ' -f1 /proc/uptime)
"\$py" -m rdma_device doctor --json --addr 10.0.3.1 > /tmp/host.json 2> /tmp/host.err
echo "\$ME: doctor exited \$? after \$(echo "\$t0 \$(cut -d' ' -f1 /proc/uptime)" | awk '{printf "%.0f", \$2 - \$1}') s"
tail -5 /tmp/host.err | sed 's/^/doctor-a: host stderr: /'
"\$py" -c "import json; from rdma_device.doctor.checks import print_results; print_results(json.load(open('/tmp/host.json'))['checks'])" \
    | sed 's/^/doctor-a: text: /'
one_line host /tmp/host.json
EOF
cat >"$run.b.guest.sh" <<EOF
set -u
$common_env
ME=doctor-b
one_line() { $one_line; }
ibv_devices
# A's listener takes one connection: retry --peer itself (a bare probe
# would be that connection) while A's is not up yet.
for i in \$(seq 60); do
    RDMA_DEVICE_TRANSPORTS=verbs timeout 300 "\$py" -m rdma_device doctor --peer 10.0.3.1:$pair_port --quick --json \
        > /tmp/pair.json 2> /tmp/pair.err
    st=\$?
    grep -qE "Connection refused|No route to host|timed out" /tmp/pair.json || break
    sleep 3
done
echo "\$ME: peer exited \$st after \$i tries"
tail -5 /tmp/pair.err | sed 's/^/doctor-b: stderr: /'
one_line pair /tmp/pair.json
EOF

port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log_a="$run.a.console.log"
log_b="$run.b.console.log"
boot() { # role ip mac netdev-option log memory
    timeout "$(left)" "${qemu_tcg[@]}" -m "$6" -initrd "$initrd" "${hostroot_share[@]}" \
        -append "$kargs RDEV_NET=eth0=$2/24 RDEV_RUN=$run.$1.guest.sh" \
        -netdev "socket,id=n1,$4" -device "virtio-net-pci,netdev=n1,mac=$3" \
        </dev/null >"$5" 2>&1 &
}
say "booting host A (3 GiB, listens on the L2 link 127.0.0.1:$port) and host B; consoles: $log_a $log_b"
start=$SECONDS
boot a 10.0.3.1 52:54:00:00:03:01 "listen=127.0.0.1:$port" "$log_a" 3072
pid_a=$!
pid_b=""
trap 'kill $pid_a $pid_b 2>/dev/null || true; rm -rf "$stage"' EXIT
while ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
    kill -0 "$pid_a" 2>/dev/null || { say "host A's qemu exited early"; cat "$log_a"; exit 1; }
    (( SECONDS < deadline )) || { say "host A's qemu never listened"; exit 1; }
    sleep 0.2
done
boot b 10.0.3.2 52:54:00:00:03:02 "connect=127.0.0.1:$port" "$log_b" 1536
pid_b=$!
set +e
wait "$pid_a"; wait "$pid_b"
set -e
echo "---- doctor in the VMs ($((SECONDS - start)) s for both) ----"
{ tr -d '\r' <"$log_a"; tr -d '\r' <"$log_b"; } | grep -E '^doctor-[ab]: |panicked' | grep -vE '^doctor-[ab]: (loopback|pair|host|mtu1500) \{' || true
{ tr -d '\r' <"$log_a"; tr -d '\r' <"$log_b"; } | python3 "$here/doctor_check.py"
