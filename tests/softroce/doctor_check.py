"""Checks what tests/softroce/doctor.sh's two VMs printed (stdin: both
consoles) and prints one line, "doctor-vm: ok ..." or "doctor-vm: FAILED
...: what was wrong"; exit status 1 on failure.

Lines read: "doctor-a: NAME {json}" / "doctor-b: NAME {json}", where NAME
is host (doctor --json on A at MTU 9000), mtu1500 (the MTU check alone at
the interface's 1500 bytes), loopback (doctor --peer --json on A against
its own listener) and pair (doctor --peer --json on B against A).
"""

import json
import re
import sys

QUICK_SIZES = [1 << 10, 64 << 10, 1 << 20, 4 << 20]


def parse(text):
    found = {}
    for line in text.splitlines():
        m = re.match(r"^doctor-([ab]): (host|mtu1500|loopback|pair) (\{.*\})\s*$", line)
        if m:
            try:
                found[m.group(2)] = json.loads(m.group(3))
            except ValueError as e:
                found[m.group(2)] = {"unparsable": str(e)}
    return found


def by_name(checks):
    return {c["check"]: c for c in checks}


def check_host(out, problems):
    checks = by_name(out.get("checks", []))
    want_ok = ("RDMA devices", "RoCE v2 GID", "MTU", "memlock", "userfaultfd", "transport library",
               "built for this TensorFlow", "plugin loads")
    for name in want_ok:
        c = checks.get(name)
        if c is None or c["status"] != "ok":
            problems.append(f"host check {name}: {c}")
    dev, gid, mtu = (checks.get(n, {}).get("detail", "") for n in ("RDMA devices", "RoCE v2 GID", "MTU"))
    if "rxe0 port 1 ACTIVE" not in dev:
        problems.append(f"RDMA devices does not name rxe0's active port: {dev!r}")
    if "on eth0" not in gid or "0000:0000:0000:0000:0000:ffff:0a00:0301" not in gid or "RoCE v2" not in gid:
        problems.append(f"RoCE v2 GID is not 10.0.3.1's on eth0: {gid!r}")
    if "RDMA MTU 4096" not in mtu:
        problems.append(f"MTU at eth0 mtu 9000 is not 4096: {mtu!r}")
    if "shm + verbs" not in checks.get("transport library", {}).get("detail", ""):
        problems.append(f"transport library without verbs: {checks.get('transport library')}")
    if checks.get("shared memory", {}).get("status") not in ("ok", "warn"):
        problems.append(f"shared memory: {checks.get('shared memory')}")
    if out.get("ok") is not True:
        problems.append("host checks: ok is not true")


def check_mtu1500(out, problems):
    if out.get("status") != "warn" or "RDMA MTU 1024" not in out.get("detail", "") \
            or "mtu 9000" not in out.get("fix", ""):
        problems.append(f"MTU at 1500 is not '!' with RDMA MTU 1024 and the jumbo-frame fix: {out}")


def check_pair(name, out, problems, peer):
    checks = by_name(out.get("checks", []))
    for c in ("peer accepts", "rdma_cm reaches the peer", "transport", "writes"):
        if checks.get(c, {}).get("status") != "ok":
            problems.append(f"{name}: {c}: {checks.get(c)}")
    transport = checks.get("transport", {}).get("detail", "")
    if not transport.startswith(f"verbs to {peer}"):
        problems.append(f"{name}: not over verbs to {peer}: {transport!r}")
    if "every byte checked by the receiver" not in checks.get("writes", {}).get("detail", ""):
        problems.append(f"{name}: writes: {checks.get('writes')}")
    rows = out.get("results", [])
    if [r.get("size") for r in rows] != QUICK_SIZES:
        problems.append(f"{name}: sizes {[r.get('size') for r in rows]}, not {QUICK_SIZES}")
    for r in rows:
        if not (0 < r.get("gbps", 0) < 1000 and 0 < r.get("rtt_us", 0) < 60e6 and r.get("tensors", 0) > 0):
            problems.append(f"{name}: implausible row {r}")
    if out.get("ok") is not True:
        problems.append(f"{name}: ok is not true")


def summary(name, out):
    rows = out.get("results", [])
    tensors = sum(r.get("tensors", 0) for r in rows)
    big = rows[-1] if rows else {}
    return (f"{name}: {tensors} tensors over verbs, checked; {big.get('size', 0) >> 20} MiB at "
            f"{big.get('gbps', 0) * 1000:.0f} MB/s, 1 KiB round trip {rows[0]['rtt_us']:.0f} µs" if rows
            else f"{name}: no rows")


def main():
    found = parse(sys.stdin.read())
    problems = []
    for name in ("host", "mtu1500", "loopback", "pair"):
        if name not in found:
            problems.append(f"no {name} result on the consoles")
    if "host" in found:
        check_host(found["host"], problems)
    if "mtu1500" in found:
        check_mtu1500(found["mtu1500"], problems)
    if "loopback" in found:
        check_pair("loopback (A to A)", found["loopback"], problems, "10.0.3.1:")
    if "pair" in found:
        check_pair("two hosts (B to A)", found["pair"], problems, "10.0.3.1:")
    if problems:
        print("doctor-vm: FAILED: " + "; ".join(problems))
        return 1
    host = by_name(found["host"]["checks"])
    print("doctor-vm: ok; host A: " + ", ".join(f"{n} ✓" for n in host if host[n]["status"] == "ok")
          + f"; {host['MTU']['detail']}; at eth0 mtu 1500: MTU ! ({found['mtu1500']['detail']}); "
          + summary("loopback A-A", found["loopback"]) + "; " + summary("hosts B->A", found["pair"])
          + " (TCG: a functional signal, not RDMA speed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
