"""The doctor's host checks: is this host ready for the transport?

RDMA devices and their ports, a RoCE v2 GID on the interface that carries
the task's address, the MTU, the memlock limit against the arena,
userfaultfd (the sender's registration cache), shared memory against the
arena, the libraries built for the running TensorFlow and the plugin
loading. Each check is a result of ``checks.check`` (✓, ✗, ``!`` or
``-``, with a one-line fix); :func:`host_checks` runs them all.

The task's address is ``--addr``, else this task's entry in ``TF_CONFIG``,
else the address of the interface that carries the default route.
"""

import ctypes
import fcntl
import json
import os
import resource
import socket
import struct
import subprocess

from rdma_device import _loader
from rdma_device._units import human_bytes
from rdma_device.doctor.checks import FAIL, NA, OK, WARN, check

IB_SYS = "/sys/class/infiniband"
IB_MTUS = (256, 512, 1024, 2048, 4096)
# RoCE v2 headers inside an Ethernet frame (IP 20 + UDP 8 + BTH 12 + RETH
# 16 + ICRC 4): the largest RDMA MTU an interface MTU carries.
ROCE_OVERHEAD = 60


def _read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


# --- addresses and interfaces -------------------------------------------------

def task_address(addr=None):
    """(host, where it came from): --addr, TF_CONFIG's own task, the default route."""
    if addr:
        return addr.rsplit(":", 1)[0] if addr.count(":") == 1 else addr, "--addr"
    try:
        tf_config = json.loads(os.environ.get("TF_CONFIG", "") or "{}")
        task = tf_config.get("task", {})
        entry = tf_config["cluster"][task["type"]][int(task["index"])]
        return entry.rsplit(":", 1)[0], "TF_CONFIG"
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        return s.getsockname()[0], "default route"
    except OSError:
        return "127.0.0.1", "no default route"
    finally:
        s.close()


def ipv4_of(host):
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def interface_of(ip):
    """The network interface holding IPv4 address ``ip`` (None if none)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(got[20:24]) == ip:
                return name
    finally:
        s.close()
    return None


# --- RDMA devices from sysfs --------------------------------------------------

def rdma_ports():
    """Every (device, port) with its state, link layer and GID table."""
    out = []
    try:
        devices = sorted(os.listdir(IB_SYS))
    except OSError:
        return out
    for dev in devices:
        ports_dir = os.path.join(IB_SYS, dev, "ports")
        for port in sorted(os.listdir(ports_dir) if os.path.isdir(ports_dir) else [], key=int):
            p = os.path.join(ports_dir, port)
            gids = []
            for idx in sorted(os.listdir(os.path.join(p, "gids")) if os.path.isdir(os.path.join(p, "gids")) else [],
                              key=int):
                gid = _read(os.path.join(p, "gids", idx))
                if not gid or set(gid.replace(":", "")) == {"0"}:
                    continue
                gids.append({"index": int(idx), "gid": gid,
                             "type": _read(os.path.join(p, "gid_attrs", "types", idx)),
                             "netdev": _read(os.path.join(p, "gid_attrs", "ndevs", idx))})
            out.append({"device": dev, "port": int(port), "state": _read(os.path.join(p, "state")),
                        "link_layer": _read(os.path.join(p, "link_layer")), "gids": gids})
    return out


def gid_ipv4(gid):
    """a.b.c.d of an IPv4-mapped GID (::ffff:a.b.c.d), else None."""
    h = gid.replace(":", "")
    if len(h) == 32 and h[:20] == "0" * 20 and h[20:24] == "ffff":
        return socket.inet_ntoa(bytes.fromhex(h[24:]))
    return None


def active_mtu(dev, port, netdev):
    """(RDMA MTU in bytes, how it was found): ibv_devinfo when present,
    else derived from the interface's MTU (RoCE)."""
    try:
        text = subprocess.run(["ibv_devinfo", "-d", dev, "-i", str(port)], capture_output=True, text=True,
                              timeout=10).stdout
        for line in text.splitlines():
            if line.strip().startswith("active_mtu:"):
                return int(line.split()[1]), "ibv_devinfo"
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        pass
    mtu = int(_read(f"/sys/class/net/{netdev}/mtu", "0") or 0) if netdev else 0
    fits = [m for m in IB_MTUS if m + ROCE_OVERHEAD <= mtu]
    return (fits[-1] if fits else 0), f"{netdev} MTU {mtu}"


# --- the checks ---------------------------------------------------------------

def check_devices(ports):
    if not ports:
        return check("RDMA devices", FAIL, f"no RDMA device ({IB_SYS} is missing or empty)",
                     "load the NIC's RDMA driver (mlx5_ib, irdma, bnxt_re, ...) and rdma-core "
                     "(ibverbs-providers); to try without a NIC: `rdma link add rxe0 type rxe netdev IFACE` "
                     "(Soft-RoCE); tasks on one host use shared memory and need no device")
    active = [p for p in ports if "ACTIVE" in p["state"]]
    listing = ", ".join(f"{p['device']} port {p['port']} {p['state'].split(': ')[-1]} {p['link_layer']}"
                        for p in ports)
    if not active:
        return check("RDMA devices", FAIL, listing,
                     "no port is ACTIVE: check the cable/link (`rdma link`, `ibstat`); "
                     "InfiniBand also needs a subnet manager (opensm)")
    return check("RDMA devices", OK, listing)


def check_gid(ports, host, source):
    ip = ipv4_of(host)
    iface = interface_of(ip) if ip else None
    where = f"task address {host} ({source})"
    if ip is None:
        return check("RoCE v2 GID", FAIL, f"{where} does not resolve", "give each task an address of its RDMA "
                     "interface in the cluster spec"), iface
    if not ports:
        return check("RoCE v2 GID", NA, f"{where} on {iface or 'no local interface'}; no RDMA device"), iface
    if iface is None:
        return check("RoCE v2 GID", FAIL, f"{where}: {ip} is on no interface of this host",
                     "use an address of this host's RDMA interface as the task's address"), iface
    want_idx = os.environ.get("RDMA_DEVICE_VERBS_GID_INDEX", "")
    for p in ports:
        if p["link_layer"] == "InfiniBand" and any(g["netdev"] == iface for g in p["gids"]):
            return check("RoCE v2 GID", OK, f"{where} on {iface}: InfiniBand port {p['device']}/{p['port']} "
                         "(IPoIB; no RoCE GID needed)"), iface
        for g in p["gids"]:
            if g["netdev"] == iface and g["type"] == "RoCE v2" and gid_ipv4(g["gid"]) == ip:
                if want_idx not in ("", "-1") and str(g["index"]) != want_idx:
                    return check("RoCE v2 GID", FAIL, f"{where}: the RoCE v2 GID of {ip} is index {g['index']}, "
                                 f"RDMA_DEVICE_VERBS_GID_INDEX={want_idx}",
                                 "unset RDMA_DEVICE_VERBS_GID_INDEX (the default picks this GID)"), iface
                return check("RoCE v2 GID", OK, f"{where} on {iface}: {p['device']} port {p['port']} "
                             f"GID[{g['index']}] {g['gid']} RoCE v2"), iface
    on_iface = [f"{p['device']}/{p['port']} GID[{g['index']}] {g['type'] or '?'}" for p in ports
                for g in p["gids"] if g["netdev"] == iface]
    if on_iface:
        return check("RoCE v2 GID", FAIL, f"{where} on {iface}: only {', '.join(on_iface)}",
                     "enable RoCE v2 for rdma_cm: `cma_roce_mode -d DEV -p PORT -m 2` "
                     "(or configfs rdma_cm/DEV/ports/PORT/default_roce_mode)"), iface
    return check("RoCE v2 GID", FAIL, f"{where} on {iface}: no RDMA device has a GID on {iface}",
                 f"attach an RDMA device to {iface} (or a Soft-RoCE one: `rdma link add rxe0 type rxe netdev "
                 f"{iface}`), or use the address of the RDMA interface as the task's address"), iface


def check_mtu(ports, iface):
    port = next((p for p in ports for g in p["gids"] if g["netdev"] == iface), None)
    if port is None and ports:
        port = ports[0]
    if port is None:
        mtu = _read(f"/sys/class/net/{iface}/mtu", "?") if iface else "?"
        return check("MTU", NA, f"{iface or 'no interface'} MTU {mtu}; no RDMA device")
    mtu, how = active_mtu(port["device"], port["port"], iface)
    detail = f"{port['device']} port {port['port']}: RDMA MTU {mtu} ({how})"
    if mtu >= 4096:
        return check("MTU", OK, detail)
    if mtu == 0:
        return check("MTU", FAIL, detail, "the port carries no RDMA MTU: bring the interface up")
    return check("MTU", WARN, detail, f"large transfers go in {mtu}-byte packets: set the interface MTU to "
                 f"9000 on hosts and switches (`ip link set {iface or 'IFACE'} mtu 9000`) for an RDMA MTU of 4096")


def _cap_ipc_lock():
    for line in _read("/proc/self/status").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 14))
    return False


def check_memlock(cfg, have_devices):
    arena = int(cfg["RDMA_DEVICE_ARENA_BYTES"]["value"])
    cache = int(cfg.get("RDMA_DEVICE_VERBS_MR_CACHE_BYTES", {}).get("value", 0))
    need = arena + cache
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or _cap_ipc_lock():
        return check("memlock", OK, "unlimited" + (" (CAP_IPC_LOCK)" if soft != resource.RLIM_INFINITY else ""))
    detail = (f"limit {human_bytes(soft)}; verbs pins up to the arena ({human_bytes(arena)}) plus the registration "
              f"cache ({human_bytes(cache)}) = {human_bytes(need)}")
    if soft >= need:
        return check("memlock", OK, detail)
    fix = ("`ulimit -l unlimited` (limits.conf: `* - memlock unlimited`; containers: `--ulimit memlock=-1`; "
           "Slurm: `--propagate=MEMLOCK`), or a smaller RDMA_DEVICE_ARENA_BYTES")
    if not have_devices:
        return check("memlock", NA, detail + "; only verbs pins memory and there is no RDMA device", fix)
    return check("memlock", FAIL, detail, fix)


def userfaultfd():
    """None when a userfaultfd with unmap/remove/remap events opens in this
    process (what the registration cache needs), else why not."""
    nr = {"x86_64": 323, "aarch64": 282, "ppc64le": 364, "s390x": 355}.get(os.uname().machine)
    if nr is None:
        return f"unknown syscall number on {os.uname().machine}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    flags = os.O_CLOEXEC | os.O_NONBLOCK
    fd = libc.syscall(nr, flags | 1)  # UFFD_USER_MODE_ONLY (Linux 5.11+)
    if fd < 0:
        fd = libc.syscall(nr, flags)
    if fd < 0:
        return f"userfaultfd: {os.strerror(ctypes.get_errno())}"
    try:
        want = (1 << 1) | (1 << 3) | (1 << 4)  # EVENT_REMAP, EVENT_REMOVE, EVENT_UNMAP
        api = bytearray(struct.pack("QQQ", 0xAA, want, 0))
        try:
            fcntl.ioctl(fd, 0xC018AA3F, api)  # UFFDIO_API
        except OSError as e:
            return f"UFFDIO_API: {e.strerror}"
        return None
    finally:
        os.close(fd)


def check_userfaultfd(have_devices):
    why = userfaultfd()
    if why is None:
        return check("userfaultfd", OK, "available: large writes reuse cached registrations")
    status = FAIL if have_devices else NA
    return check("userfaultfd", status, f"{why}: every large verbs write registers its memory anew",
                 "`sysctl vm.unprivileged_userfaultfd=1` (or CAP_SYS_PTRACE); containers: a seccomp "
                 "profile that allows userfaultfd")


def _cgroup_memory_limit():
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        v = _read(path)
        if v.isdigit() and int(v) < 1 << 60:
            return int(v)
    return None


def check_shm(cfg):
    """The arena is a memfd (kernel shared memory, not a file in /dev/shm):
    what bounds it is the memory the host or container may use. A /dev/shm
    smaller than the arena is reported as a warning, since it is what a
    container with a small shared-memory allowance looks like."""
    arena = int(cfg["RDMA_DEVICE_ARENA_BYTES"]["value"])
    st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    shm = st.f_blocks * st.f_frsize if st else 0
    limit = _cgroup_memory_limit()
    detail = f"arena {human_bytes(arena)} (memfd); /dev/shm {human_bytes(shm)}"
    if limit is not None:
        detail += f"; cgroup memory limit {human_bytes(limit)}"
    if limit is not None and limit < 2 * arena:
        return check("shared memory", FAIL, detail, "each task maps its arena and its peers' windows: raise "
                     "the container's memory limit or lower RDMA_DEVICE_ARENA_BYTES")
    if shm < arena:
        return check("shared memory", WARN, detail, "a container with a small /dev/shm: give it --shm-size "
                     "(Kubernetes: an emptyDir with medium Memory on /dev/shm) of at least the arena")
    return check("shared memory", OK, detail)


def check_libraries():
    """Libraries present, built for this TensorFlow, the transport loads,
    verbs compiled in; then the plugin loads (imports TensorFlow)."""
    out = []
    try:
        core = _loader._core_lib()
        fn = core.rdev_version
        fn.restype = ctypes.c_char_p
        maps = _read("/proc/self/maps")
        verbs = "libibverbs" in maps and "librdmacm" in maps
        out.append(check("transport library", OK if verbs else WARN,
                         f"rdma_device {fn().decode()} ({'shm + verbs' if verbs else 'shm only: no verbs backend'})",
                         "rebuild with rdma-core's headers (libibverbs-dev librdmacm-dev) for RDMA NICs"))
    except (OSError, RuntimeError) as e:
        out.append(check("transport library", FAIL, str(e), "reinstall the rdma_device wheel for this platform"))
        return out
    try:
        import tensorflow as tf
        _loader._check_built_for(_loader._running_build(tf), _loader.lib_dir())
        out.append(check("built for this TensorFlow", OK, f"TensorFlow {tf.__version__} ({tf.version.GIT_VERSION})"))
        out.append(check("plugin loads", OK, _loader.load()))
    except ImportError as e:
        out.append(check("built for this TensorFlow", FAIL, f"tensorflow does not import: {e}",
                         "install the TensorFlow the wheel names (pip show rdma_device: Requires-Dist)"))
    except RuntimeError as e:
        out.append(check("built for this TensorFlow", FAIL, str(e),
                         "install the wheel built for this TensorFlow, or build from source here"))
    return out


def host_checks(addr=None):
    try:
        cfg = _loader.config()
    except (OSError, RuntimeError) as e:
        return [check("configuration", FAIL, str(e), "fix or unset the RDMA_DEVICE_* variable it names "
                      "(`python -m rdma_device` lists them with their help)")]
    host, source = task_address(addr)
    ports = rdma_ports()
    results = [check_devices(ports)]
    gid, iface = check_gid(ports, host, source)
    results += [gid, check_mtu(ports, iface), check_memlock(cfg, bool(ports)),
                check_userfaultfd(bool(ports)), check_shm(cfg)]
    results += check_libraries()
    return results
