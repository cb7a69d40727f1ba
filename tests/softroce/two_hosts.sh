#!/usr/bin/env bash
# Two hosts over verbs: two qemu VMs (TCG), each with its own NIC and its
# own rxe0, on one virtual L2 made of a qemu socket netdev between them
# (127.0.0.1 on this machine; the VMs have no other NIC, nothing leaves the
# machine). Host A is 10.0.3.1, host B 10.0.3.2. Both boot into this host's
# root file system (read-only 9p, see build_hostroot_initrd in common.sh)
# and run one side of tests/two_hosts.rs: checksummed tensors both ways,
# verbs only; SIGKILL of A, then of B, each must fail the survivor's
# waiters within 3 s of its last step (2 s of which the killed side waits
# before its SIGKILL), and the restarted process must be reached again.
# Then a network blip: while A and B exchange, this script stops B's VM
# (SIGSTOP to its qemu: the NIC goes silent) for 1.5 s and continues it;
# every step must complete on the same connections (the QPs resend for
# ~3.76 s before they give up), one of them having waited the pause out.
# Last, host B vanishes while A streams tensors to it: this script kills
# B's whole VM (its NIC goes silent: no FIN, no NAK), and A's writes must
# fail within the bound the verbs settings document (~3.76 s) plus 150 ms
# and a tenth of the bound,
# counted from A's last completed write; a receive A waits on from B must
# fail within one keepalive interval (1 s) plus that after the writes.
# Prints "two-hosts: ..." with the tensors exchanged and the kill results,
# then the same as one line of JSON.
#
#   tests/softroce/two_hosts.sh        (SOFTROCE_TIMEOUT, default 900 s)
set -euo pipefail

deadline=$((SECONDS + ${SOFTROCE_TIMEOUT:-900}))
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ensure_packages
ensure_kernel

# This checkout's own files in the shared cache: two checkouts may run
# this script at once.
run="$cache/two-hosts-$(printf %s "$root" | md5sum | cut -c1-8)"
say "building tests/two_hosts.rs with --features verbs"
json="$run.build.json"
(cd "$root" && timeout "$(left)" cargo test --features verbs --no-run --message-format=json --test two_hosts >"$json")
bin="$(grep '"reason":"compiler-artifact"' "$json" | grep '"name":"two_hosts"' \
    | grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' | tail -n1)"
[ -x "$bin" ] || { say "no two_hosts test executable"; exit 1; }
# The guests see this host's root read-only, but with fresh tmpfs on /tmp,
# /run and /dev/shm: run a copy kept in the cache, so a checkout under /tmp
# works too.
cp "$bin" "$run.bin"
bin="$run.bin"

initrd="$cache/initrd-hostroot.cpio.gz"
build_hostroot_initrd "$initrd"

addr_a=10.0.3.1:18600
addr_b=10.0.3.2:18600
for role in a b; do
    cat >"$run.$role.guest.sh" <<EOF
set -u
export RDMA_DEVICE_TWO_HOSTS_ROLE=$role RDMA_DEVICE_TWO_HOSTS_A=$addr_a RDMA_DEVICE_TWO_HOSTS_B=$addr_b
export RDMA_DEVICE_LOG=${TWO_HOSTS_LOG:-warn} RUST_BACKTRACE=1
ibv_devices
rc=0
# Life 1 ends in its own SIGKILL (exit 137); life 2 must pass (exit 0),
# except that host B's life 2 ends with its VM killed by the host.
for life in 1 2; do
    RDMA_DEVICE_TWO_HOSTS_LIFE=\$life timeout 600 "$bin" --exact two_hosts_role --nocapture --test-threads=1
    st=\$?
    echo "two-hosts-$role\$life: process exit \$st"
    if [ \$life = 1 ] && [ \$st != 137 ]; then rc=1; fi
    if [ \$life = 2 ] && [ \$st != 0 ]; then rc=1; fi
done
exit \$rc
EOF
done

# A free local TCP port for the L2 link between the two qemu processes.
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log_a="$run.a.console.log"
log_b="$run.b.console.log"
boot() { # role ip mac netdev-option log
    timeout "$(left)" "${qemu_tcg[@]}" -m 1024 -initrd "$initrd" "${hostroot_share[@]}" \
        -append "$kargs RDEV_NET=eth0=$2/24 RDEV_RUN=$run.$1.guest.sh" \
        -netdev "socket,id=n1,$4" -device "virtio-net-pci,netdev=n1,mac=$3" \
        </dev/null >"$5" 2>&1 &
}
say "booting host A (listens on the L2 link 127.0.0.1:$port) and host B; consoles: $log_a $log_b"
start=$SECONDS
boot a 10.0.3.1 52:54:00:00:03:01 "listen=127.0.0.1:$port" "$log_a"
pid_a=$!
# B connects to A's end of the link: wait until A's qemu listens.
while ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
    kill -0 "$pid_a" 2>/dev/null || { say "host A's qemu exited early"; cat "$log_a"; exit 1; }
    (( SECONDS < deadline )) || { say "host A's qemu never listened"; exit 1; }
    sleep 0.2
done
boot b 10.0.3.2 52:54:00:00:03:02 "connect=127.0.0.1:$port" "$log_b"
pid_b=$!
trap 'kill "$pid_a" "$pid_b" 2>/dev/null || true; rm -rf "$stage"' EXIT

# Pause host B's VM for 1.5 s once A asks for the blip; kill it once A
# streams to it (the vanishing host); then wait.
vanished=no
blipped=no
while kill -0 "$pid_a" 2>/dev/null; do
    if [ $blipped = no ] && grep -qa 'two-hosts-a2: blip: exchanging' "$log_a"; then
        sleep 0.3
        say "network blip: stopping host B's VM (qemu pid $pid_b) for 1.5 s"
        pkill -STOP -P "$pid_b" 2>/dev/null || true
        sleep 1.5
        pkill -CONT -P "$pid_b" 2>/dev/null || true
        blipped=yes
    fi
    # (grep reads the file itself: `tr | grep -q` fails under pipefail
    # when grep stops early.)
    if [ $vanished = no ] && grep -qa 'two-hosts-a2: vanish: streaming' "$log_a"; then
        say "host A streams to host B: killing host B's VM (qemu pid $pid_b)"
        # qemu itself, then its `timeout` wrapper ($pid_b).
        pkill -KILL -P "$pid_b" 2>/dev/null || true
        kill -9 "$pid_b" 2>/dev/null || true
        vanished=yes
    fi
    sleep 0.2
done
set +e
wait "$pid_a"; wait "$pid_b"
set -e
strip() { tr -d '\r' <"$1"; }
rc_a="$(strip "$log_a" | sed -n 's/^=== SOFTROCE-EXIT-CODE \([0-9]*\).*/\1/p' | tail -n1)"
# B's VM was killed: its first life must have died by its own SIGKILL
# and its second must have finished the exchange before the vanish.
b_ok=no
if strip "$log_b" | grep -q '^two-hosts-b1: process exit 137' && strip "$log_b" | grep -q '^two-hosts-b2: done:'; then b_ok=yes; fi
echo "---- two-hosts ($((SECONDS - start)) s for both VMs) ----"
strip "$log_a" | grep -E '^two-hosts-|panicked|FAILED' || true
strip "$log_b" | grep -E '^two-hosts-|panicked|FAILED' || true

# Totals from each life's "done"/"SIGKILL self" line (each tensor is
# counted by its sender and its receiver: halve).
tensors=0 bytes=0
while read -r t b; do tensors=$((tensors + t)); bytes=$((bytes + b)); done < <(
    { strip "$log_a"; strip "$log_b"; } | sed -n 's/^two-hosts-..: \(done: \|SIGKILL self after \)\([0-9]*\) tensors, \([0-9]*\) bytes.*/\2 \3/p')
kill_a="$(strip "$log_b" | sed -n 's/^two-hosts-b1: peer SIGKILLed: waiters failed after \([0-9]*\) ms.*/\1/p')"
kill_b="$(strip "$log_a" | sed -n 's/^two-hosts-a2: peer SIGKILLed: waiters failed after \([0-9]*\) ms.*/\1/p')"
reach_a="$(strip "$log_b" | grep -c '^two-hosts-b1: steps 32\.\.' || true)"
reach_b="$(strip "$log_a" | grep -c '^two-hosts-a2: steps 63\.\.' || true)"
blip="$(strip "$log_a" | sed -n 's/^two-hosts-a2: blip: steps [0-9.=]* exchanged in [0-9]* ms, the longest \([0-9]*\) ms.*/\1/p')"
vanish="$(strip "$log_a" | sed -n 's/^two-hosts-a2: host B vanished: writes failed \([0-9]*\) ms after the last completed one (documented bound \([0-9]*\) ms).*/\1 ms (documented bound \2 ms)/p')"
vanish_recv="$(strip "$log_a" | sed -n 's/^two-hosts-a2: host B vanished: the waiting receive failed \([0-9]*\) ms after the writes.*/\1/p')"
vanish_ms="$(strip "$log_a" | sed -n 's/^two-hosts-a2: host B vanished: writes failed \([0-9]*\) ms after.*/\1/p')"
vanish_bound="$(strip "$log_a" | sed -n 's/^two-hosts-a2: host B vanished: writes failed .*(documented bound \([0-9]*\) ms).*/\1/p')"
recv_bound="$(strip "$log_a" | sed -n 's/^two-hosts-a2: host B vanished: the waiting receive failed .*(bound \([0-9]*\) ms).*/\1/p')"
ok=FAILED
if [ "$rc_a" = 0 ] && [ "$b_ok" = yes ] && [ -n "$kill_a" ] && [ -n "$kill_b" ] && [ -n "$blip" ] && [ -n "$vanish" ] && [ -n "$vanish_recv" ]; then ok=ok; fi
echo "two-hosts: $ok tensors_exchanged=$((tensors / 2)) bytes=$((bytes / 2)) over verbs rxe0 10.0.3.1 <-> rxe0 10.0.3.2;" \
    "SIGKILL A (2 s after its last step): B's waiters failed in ${kill_a:-?} ms, restarted A reached=$([ "$reach_a" = 1 ] && echo yes || echo no);" \
    "SIGKILL B (2 s after its last step): A's waiters failed in ${kill_b:-?} ms, restarted B reached=$([ "$reach_b" = 1 ] && echo yes || echo no);" \
    "B's VM stopped 1.5 s mid-exchange: every step completed, the longest ${blip:-?} ms;" \
    "host B vanished (VM killed): A's writes failed ${vanish:-?} after its last completed write," \
    "A's waiting receive ${vanish_recv:-?} ms after that" \
    "($((SECONDS - start)) s under TCG)"
# The same as one JSON row (`python -m rdma_device.bench report --only
# two_hosts` gathers it; null where a number is missing).
num() { [ -n "$1" ] && echo "$1" || echo null; }
echo "{\"ok\": $([ "$ok" = ok ] && echo true || echo false), \"tensors\": $((tensors / 2)), \"bytes\": $((bytes / 2)),"\
" \"kill_a_ms\": $(num "$kill_a"), \"kill_b_ms\": $(num "$kill_b"),"\
" \"restarted_a_reached\": $([ "$reach_a" = 1 ] && echo true || echo false),"\
" \"restarted_b_reached\": $([ "$reach_b" = 1 ] && echo true || echo false),"\
" \"blip_longest_ms\": $(num "$blip"), \"vanish_writes_ms\": $(num "$vanish_ms"),"\
" \"vanish_bound_ms\": $(num "$vanish_bound"), \"vanish_recv_ms\": $(num "$vanish_recv"),"\
" \"vanish_recv_bound_ms\": $(num "$recv_bound"), \"seconds\": $((SECONDS - start))}"
[ "$ok" = ok ]
