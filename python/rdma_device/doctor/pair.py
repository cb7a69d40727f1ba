"""doctor --listen / --peer: test a pair of hosts through the transport.

The two sides meet over a TCP control connection on the listener's port
(what a task's gRPC port is in a job), then each creates a transport
context (``rdev_context_new`` through ctypes, the C ABI the TensorFlow
shim uses) at ``HOST:PORT``, as a task of a job would: the transport picks
shm when both are on one host, verbs (rdma_cm) across hosts. The sender
(``--peer``) then times, per size, bursts of tensors written into slots
the receiver placed (``rdev_place_edge``), each burst answered by an
8-byte ack tensor carrying the receiver's checksum of every byte it got,
and, interleaved in the same loop, numpy copies of the same bytes (the
host's single-thread memcpy). Medians over repetitions; GB/s = 10^9 B/s.
Latency is the round trip of one tensor and its ack, through Python's
callbacks (tens of µs of it are the interpreter's).
"""

import ctypes
import itertools
import json
import os
import socket
import threading
import time

import numpy as np

from rdma_device import _capi
from rdma_device._units import size_label
from rdma_device.doctor.checks import FAIL, NA, OK, check, print_results

LISTENER, SENDER = "/job:doctor/replica:0/task:0", "/job:doctor/replica:0/task:1"
TRANSPORTS = {0: "none", 1: "shm", 2: "verbs"}
SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [1 << 10, 64 << 10, 1 << 20, 4 << 20]
DT_UINT8 = 4
BUFFER_BUDGET = 256 << 20  # distinct payloads per size, so a stale slot shows

class Op:
    """One send or receive: its callback fills it in, waiters wait on it."""

    def __init__(self):
        self.done = threading.Event()
        self.status, self.msg, self.buf = None, "", None


_ops = {}
_ops_lock = threading.Lock()
_op_ids = itertools.count(1)


def _take(userdata):
    with _ops_lock:
        return _ops.pop(userdata, None)


@_capi.SEND_DONE
def _on_sent(userdata, status, msg, msg_len):
    op = _take(userdata)
    if op is not None:
        op.status, op.msg = status, ctypes.string_at(msg, msg_len).decode("utf-8", "replace") if msg else ""
        op.done.set()


@_capi.RECV_DONE
def _on_recv(userdata, status, msg, msg_len, buf):
    op = _take(userdata)
    if op is not None:
        op.status, op.buf = status, buf
        op.msg = ctypes.string_at(msg, msg_len).decode("utf-8", "replace") if msg else ""
        op.done.set()
    elif buf:
        _capi.lib().rdev_buffer_release(buf)


def _register():
    op = Op()
    with _ops_lock:
        key = next(_op_ids)
        _ops[key] = op
    return key, op


class TransportError(RuntimeError):
    pass


def _ok(rc, what):
    if rc != 0:
        raise TransportError(f"{what}: {_capi.status_str(rc)}: {_capi.last_error()}")


class Context:
    """One task's transport, as a TensorFlow server of the job would hold."""

    def __init__(self, task, addr):
        self.lib, self.task = _capi.lib(), task
        out = ctypes.c_void_p()
        _ok(self.lib.rdev_context_new(task.encode(), len(task), addr.encode(), len(addr), ctypes.byref(out)),
            f"transport context at {addr}")
        self.ptr = out

    def add_peer(self, task, addr):
        """The transport that will carry tensors to ``task`` ("none": why in the error)."""
        tr = ctypes.c_int(0)
        _ok(self.lib.rdev_context_add_peer(self.ptr, task.encode(), len(task), addr.encode(), len(addr),
                                           ctypes.byref(tr)), f"peer {addr}")
        return TRANSPORTS.get(tr.value, "?"), ("" if tr.value else _capi.last_error())

    def connect(self, peer):
        _ok(self.lib.rdev_connect_peer(self.ptr, peer.encode(), len(peer)), "connect")

    def place(self, peer, key, size):
        placed = ctypes.c_bool(False)
        _ok(self.lib.rdev_place_edge(self.ptr, peer.encode(), len(peer), key.encode(), len(key), size, 30000,
                                     ctypes.byref(placed)), "place")
        return placed.value

    def send(self, peer, key, step, arr):
        dims = (ctypes.c_int64 * 1)(arr.nbytes)
        meta = _capi.TensorMeta(DT_UINT8, 0, 1, dims)
        ud, op = _register()
        rc = self.lib.rdev_send(self.ptr, peer.encode(), len(peer), key.encode(), len(key), step,
                                ctypes.byref(meta), arr.ctypes.data, arr.nbytes, _on_sent, ud)
        if rc != 0:
            _take(ud)
        _ok(rc, "send")
        return op

    def recv(self, peer, key, step):
        ud, op = _register()
        rc = self.lib.rdev_recv(self.ptr, peer.encode(), len(peer), key.encode(), len(key), step, _on_recv, ud)
        if rc != 0:
            _take(ud)
        _ok(rc, "recv")
        return op

    def step_done(self, step):
        self.lib.rdev_step_done(self.ptr, step)

    def close(self):
        if self.ptr:
            self.lib.rdev_context_free(self.ptr)
            self.ptr = None


def wait(op, deadline, what):
    if not op.done.wait(max(0.0, deadline - time.monotonic())):
        raise TransportError(f"{what}: no completion before the deadline")
    if op.status != 0:
        raise TransportError(f"{what}: {_capi.status_str(op.status)}: {op.msg}")
    return op


def _key(src, dst, name):
    return f"{src}/device:CPU:0;1;{dst}/device:CPU:0;{name};0:0"


def _payloads(size, n):
    """Distinct payloads (index in the first 8 bytes, random rest)."""
    count = max(1, min(n, BUFFER_BUDGET // size))
    rng = np.random.default_rng(size)
    bufs = []
    for i in range(count):
        a = rng.integers(0, 256, size, dtype=np.uint8)
        a[:8] = np.frombuffer(np.uint64(i).tobytes(), np.uint8)
        bufs.append(a)
    return bufs


def _word_sum(view):
    return int(view.view(np.uint64).sum(dtype=np.uint64))


def burst_plan(quick):
    """(size, tensors per bandwidth burst, repetitions) for each size."""
    reps = 3 if quick else 7
    return [(s, max(2, min(64, (64 << 20) // s // (4 if quick else 1))), reps) for s in (QUICK_SIZES if quick else SIZES)]


def _send_json(conn, obj):
    conn.sendall((json.dumps(obj) + "\n").encode())


def _recv_json(conn, timeout):
    conn.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise TransportError("the peer closed the control connection")
        data += chunk
        if len(data) > 1 << 20:
            raise TransportError("control message over 1 MiB")
    return json.loads(data)


# --- the listener: receives bursts, checks every byte, answers with acks -------

def serve(ctx, the_plan, timeout):
    """Receive each burst the sender's plan describes; reply with the sum of
    its bytes. Returns this process's CPU seconds per size."""
    step, cpu = 0, {}
    for size, n, reps in the_plan:
        data_key, ack_key = _key(SENDER, LISTENER, f"data{size}"), _key(LISTENER, SENDER, f"ack{size}")
        count = max(1, min(n, BUFFER_BUDGET // size))
        c0 = time.process_time()
        for _ in range(reps):
            for burst in (1, n):
                deadline = time.monotonic() + timeout + size * burst / 1e7
                ops = [ctx.recv(SENDER, data_key, step + i) for i in range(burst)]
                total = 0
                for i, op in enumerate(ops):
                    wait(op, deadline, f"receiving {size} B")
                    lib = ctx.lib
                    got = lib.rdev_buffer_len(op.buf)
                    if got != size:
                        lib.rdev_buffer_release(op.buf)
                        raise TransportError(f"received {got} B where {size} B were sent")
                    view = np.ctypeslib.as_array(ctypes.cast(lib.rdev_buffer_data(op.buf),
                                                             ctypes.POINTER(ctypes.c_uint8)), (size,))
                    index = int(view[:8].view(np.uint64)[0])
                    total = (total + _word_sum(view) + (0 if index == i % count else 1 << 63)) % (1 << 64)
                    lib.rdev_buffer_release(op.buf)
                ack = np.frombuffer(np.uint64(total).tobytes(), np.uint8).copy()
                wait(ctx.send(SENDER, ack_key, step, ack), deadline, "sending the ack")
                for i in range(burst):
                    ctx.step_done(step + i)
                step += burst
        cpu[size] = time.process_time() - c0
    return cpu


def listen(args):
    host = args.addr or ""
    srv = socket.create_server((host, args.listen), reuse_port=False)
    srv.settimeout(args.timeout)
    print(f"doctor: waiting up to {args.timeout:.0f} s for `doctor --peer THIS_HOST:{args.listen}`", flush=True)
    try:
        conn, who = srv.accept()
    except socket.timeout:
        print(f"✗ no peer connected within {args.timeout:.0f} s")
        return 1
    finally:
        srv.close()
    ctx = None
    with conn:
        try:
            hello = _recv_json(conn, 60)
            me = f"{conn.getsockname()[0]}:{args.listen}"
            ctx = Context(LISTENER, me)
            transport, why = ctx.add_peer(SENDER, hello["addr"])
            _send_json(conn, {"addr": me, "transport": transport, "why": why,
                              "transports": os.environ.get("RDMA_DEVICE_TRANSPORTS", "shm,verbs")})
            print(f"doctor: peer {who[0]} ({hello['addr']}) over {transport}", flush=True)
            if transport == "none":
                return 1
            cpu = serve(ctx, [tuple(p) for p in hello["plan"]], 60)
            _send_json(conn, {"done": True, "cpu": {str(k): v for k, v in cpu.items()}})
            final = _recv_json(conn, 60)
            print_table(final.get("results", []))
            return 0 if final.get("ok") else 1
        except (TransportError, OSError, ValueError, KeyError) as e:
            print(f"✗ pair test failed: {e}", flush=True)
            try:
                _send_json(conn, {"error": str(e)})
            except OSError:
                pass
            return 1
        finally:
            if ctx is not None:
                ctx.close()


# --- the sender: drives the plan, times it, checks the acks -------------------

def _median(v):
    v = sorted(v)
    return v[len(v) // 2]


def time_bursts(ctx, the_plan, timeout, progress):
    """Per size: bursts over the transport and numpy copies, interleaved."""
    step, rows = 0, []
    for size, n, reps in the_plan:
        data_key, ack_key = _key(SENDER, LISTENER, f"data{size}"), _key(LISTENER, SENDER, f"ack{size}")
        placed = ctx.place(LISTENER, data_key, size)
        bufs = _payloads(size, n)
        sums = [(_word_sum(b)) for b in bufs]
        dst = np.empty(size, np.uint8)
        np.copyto(dst, bufs[0])
        rtt, bw, cp, cpu = [], [], [], 0.0
        for _ in range(reps):
            for burst in (1, n):
                deadline = time.monotonic() + timeout + size * burst / 1e7
                ack = ctx.recv(LISTENER, ack_key, step)
                c0, t0 = time.process_time(), time.perf_counter()
                sent = [ctx.send(LISTENER, data_key, step + i, bufs[i % len(bufs)]) for i in range(burst)]
                wait(ack, deadline, f"ack of {burst} x {size} B")
                dt = time.perf_counter() - t0
                for op in sent:
                    wait(op, deadline, f"sending {size} B")
                lib = ctx.lib
                got = ctypes.c_uint64.from_address(lib.rdev_buffer_data(ack.buf)).value
                lib.rdev_buffer_release(ack.buf)
                want = sum(sums[i % len(bufs)] for i in range(burst)) % (1 << 64)
                if got != want:
                    raise TransportError(f"{size} B x {burst}: the receiver's checksum {got:#x} is not the "
                                         f"sender's {want:#x}: bytes were lost or mixed up")
                for i in range(burst):
                    ctx.step_done(step + i)
                step += burst
                if burst == 1:
                    rtt.append(dt)
                else:
                    cpu += time.process_time() - c0
                    bw.append(size * burst / dt)
                    t0 = time.perf_counter()
                    for i in range(burst):
                        np.copyto(dst, bufs[i % len(bufs)])
                    cp.append(size * burst / (time.perf_counter() - t0))
        rows.append({"size": size, "gbps": _median(bw) / 1e9, "memcpy_gbps": _median(cp) / 1e9,
                     "ratio": _median(bw) / _median(cp), "rtt_us": _median(rtt) * 1e6,
                     "sender_cpu_s_per_gb": cpu / (size * n * reps / 1e9), "placed": placed,
                     "tensors": reps * (n + 1)})
        progress(f"{size_label(size)}: {rows[-1]['gbps']:.2f} GB/s, round trip {rows[-1]['rtt_us']:.0f} µs")
    return rows


def print_table(rows, out=None):
    if not rows:
        return
    print(f"{'size':>8} {'GB/s':>7} {'memcpy':>7} {'ratio':>6} {'rtt µs':>8} {'send CPU s/GB':>14} "
          f"{'recv CPU s/GB':>14}", file=out)
    for r in rows:
        print(f"{size_label(r['size']):>8} {r['gbps']:>7.2f} {r['memcpy_gbps']:>7.2f} {r['ratio']:>6.2f} "
              f"{r['rtt_us']:>8.0f} {r['sender_cpu_s_per_gb']:>14.3f} {r.get('receiver_cpu_s_per_gb', 0):>14.3f}",
              file=out)


def verbs_reach(peer_addr, my_ip):
    """Does rdma_cm resolve a route to the peer (a verbs-only context)?"""
    if "libibverbs" not in _read_maps():
        return check("rdma_cm reaches the peer", NA, "this build has no verbs backend")
    saved = os.environ.get("RDMA_DEVICE_TRANSPORTS")
    os.environ["RDMA_DEVICE_TRANSPORTS"] = "verbs"
    probe = socket.socket()
    ctx = None
    try:
        probe.bind((my_ip, 0))
        ctx = Context(SENDER, f"{my_ip}:{probe.getsockname()[1]}")
        transport, why = ctx.add_peer(LISTENER, peer_addr)
        if transport == "verbs":
            return check("rdma_cm reaches the peer", OK, f"route to {peer_addr} resolved")
        return check("rdma_cm reaches the peer", FAIL, why or transport,
                     "give tasks addresses on the RDMA interfaces, check `python -m rdma_device doctor` "
                     "on both hosts (devices, GID), and that the hosts ping over that interface")
    except TransportError as e:
        return check("rdma_cm reaches the peer", FAIL, str(e), "see the host checks: `python -m rdma_device doctor`")
    finally:
        if ctx is not None:
            ctx.close()
        probe.close()
        if saved is None:
            os.environ.pop("RDMA_DEVICE_TRANSPORTS", None)
        else:
            os.environ["RDMA_DEVICE_TRANSPORTS"] = saved


def _read_maps():
    _capi.lib()
    with open("/proc/self/maps") as f:
        return f.read()


def peer(args):
    host, _, port = args.peer.rpartition(":")
    results, rows, ctx, conn, reserve = [], [], None, None, None
    say = (lambda m: None) if args.json else (lambda m: print(f"  {m}", flush=True))
    try:
        try:
            conn = socket.create_connection((host, int(port)), timeout=10)
            results.append(check("peer accepts", OK, f"{args.peer} answered"))
        except OSError as e:
            results.append(check("peer accepts", FAIL, f"{args.peer}: {e}",
                                 f"run `python -m rdma_device doctor --listen {port}` there first; "
                                 "open the port in the firewall"))
            return finish(args, results, rows)
        my_ip = conn.getsockname()[0]
        reserve = socket.socket()  # this task's port, held as a gRPC server would
        reserve.bind((my_ip, 0))
        me = f"{my_ip}:{reserve.getsockname()[1]}"
        ctx = Context(SENDER, me)
        the_plan = burst_plan(args.quick)
        _send_json(conn, {"addr": me, "plan": the_plan})
        reply = _recv_json(conn, 60)
        if "error" in reply:
            raise TransportError(f"the listener: {reply['error']}")
        transport, why = ctx.add_peer(LISTENER, reply["addr"])
        reach = verbs_reach(reply["addr"], my_ip)
        if reach["status"] == FAIL and transport == "shm":
            reach = check(reach["check"], NA, f"{reach['detail']} (one host: the pair runs over shm)")
        results.append(reach)
        if transport == "none" or reply["transport"] == "none":
            results.append(check("transport", FAIL, why or reply["why"],
                                 "same RDMA_DEVICE_TRANSPORTS on both sides; see the host checks"))
            return finish(args, results, rows)
        ctx.connect(LISTENER)
        results.append(check("transport", OK, f"{transport} to {reply['addr']}, accepted"))
        say(f"timing {len(the_plan)} sizes over {transport}")
        rows = time_bursts(ctx, the_plan, 60, say)
        done = _recv_json(conn, 120)
        if "error" in done:
            raise TransportError(f"the listener: {done['error']}")
        for r in rows:
            r["receiver_cpu_s_per_gb"] = done["cpu"][str(r["size"])] / (r["size"] * r["tensors"] / 1e9)
        results.append(check("writes", OK, f"{sum(r['tensors'] for r in rows)} tensors over {transport}, "
                             "every byte checked by the receiver"))
        _send_json(conn, {"results": rows, "ok": True})
    except (TransportError, OSError, ValueError, KeyError) as e:
        results.append(check("writes", FAIL, str(e), "see the listener's output and the host checks"))
    finally:
        if ctx is not None:
            ctx.close()
        for sock in (conn, reserve):
            if sock is not None:
                sock.close()
    return finish(args, results, rows)


def finish(args, results, rows):
    ok = all(r["status"] != FAIL for r in results)
    if args.json:
        print(json.dumps({"checks": results, "results": rows, "ok": ok}, indent=2))
    else:
        print_results(results)
        print_table(rows)
    return 0 if ok else 1


def check_pair(args):
    """``doctor --listen`` or ``doctor --peer``: exit status 1 when a check failed."""
    return listen(args) if args.listen is not None else peer(args)
