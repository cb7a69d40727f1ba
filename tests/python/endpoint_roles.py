"""Child processes of test_endpoint.py: each runs one role with a real
Endpoint and reports a JSON-able dict to the parent over a pipe.

A child makes its endpoint, adds its peer, says "ready", waits for "go"
(so both endpoints exist before anything is placed), places its slots,
says "placed", waits for "start" (so both sides have placed before either
sends), runs its role, sends {"result": ...} or {"error": ...} and closes
its endpoint on "bye" (once both are done). Every wait has a deadline.
"""

import os
import sys
import time
import traceback

import numpy as np

WAIT = 60.0  # seconds any step of a child may wait for the parent


def payload(seed, dtype, shape):
    """Deterministic bytes of any pattern (NaN payloads, odd bools
    included) viewed as ``dtype``: both sides make the same array."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)
    if dtype == np.bool_:
        raw &= 1  # NumPy bools are 0 or 1; other bytes are not valid bools
    return raw.view(dtype).reshape(shape)


def cases():
    """(slot, dtype, shape, seed) of the every-dtype test."""
    from rdma_device.endpoint import supported_dtypes

    shapes = [(), (0,), (3, 0, 2), (7,), (5, 3), (2, 3, 4, 5)]
    out = []
    for i, dt in enumerate(supported_dtypes()):
        for j, shape in enumerate(shapes):
            out.append((f"{dt.name}-{j}", dt, shape, 1000 * i + j))
    return out


SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _dtypes_sender(ep, peer, args):
    futs = [ep.send(peer, slot, payload(seed, dt, shape)) for slot, dt, shape, seed in cases()]
    for f in futs:
        f.result(WAIT)
    return {}


def _dtypes_receiver(ep, peer, args):
    bad, in_place, dlpack, no_dlpack = [], 0, 0, set()
    for slot, dt, shape, seed in cases():
        with ep.recv(peer, slot, timeout=WAIT) as r:
            want = payload(seed, dt, shape)
            if r.dtype != want.dtype or r.shape != want.shape or r.array.tobytes() != want.tobytes():
                bad.append(f"{slot}: got {r.dtype}{list(r.shape)}")
            in_place += r.in_place
            try:
                d = np.from_dlpack(r)
            except (BufferError, TypeError):
                no_dlpack.add(r.dtype.name)
                continue
            same = d.nbytes == 0 or d.ctypes.data == r.array.ctypes.data
            if not same or d.tobytes() != want.tobytes() or d.flags.writeable:
                bad.append(f"{slot}: DLPack export differs (same memory {same})")
            dlpack += 1
    return {"bad": bad, "in_place": in_place, "dlpack": dlpack, "no_dlpack": sorted(no_dlpack)}


def _sizes_sender(ep, peer, args):
    for rep in range(args["reps"]):
        for size in SIZES:
            ep.send(peer, f"s{size}", payload(size + rep, np.uint8, (size,))).result(WAIT)
    return {}


def _sizes_receiver(ep, peer, args):
    bad, not_in_place = [], []
    for rep in range(args["reps"]):
        for size in SIZES:
            with ep.recv(peer, f"s{size}", timeout=WAIT) as r:
                if not np.array_equal(r.array, payload(size + rep, np.uint8, (size,))):
                    bad.append(size)
                if not r.in_place:
                    not_in_place.append(size)
    return {"bad": bad, "not_in_place": not_in_place}


def _wait_then_send(ep, peer, args):
    conn = args["conn"]
    if not conn.poll(WAIT):
        raise TimeoutError("no word from the parent")
    conn.recv()
    ep.send(peer, "late", np.arange(5, dtype=np.int64)).result(WAIT)
    return {}


def _deadline_receiver(ep, peer, args):
    conn = args["conn"]
    from rdma_device.endpoint import DeadlineExceeded

    t0 = time.monotonic()
    try:
        ep.recv(peer, "late", timeout=0.5)
        first = "received"
    except DeadlineExceeded as e:
        first = f"DeadlineExceeded status={e.status_name}"
    waited = time.monotonic() - t0
    conn.send("send now")
    with ep.recv(peer, "late", timeout=WAIT) as r:
        late = r.array.tolist()
    return {"first": first, "waited": waited, "late": late}


def _idle(ep, peer, args):
    """Stays alive (the parent kills it)."""
    args["conn"].send("idle")
    time.sleep(WAIT)
    return {}


def _killed_peer_receiver(ep, peer, args):
    conn = args["conn"]
    fut = ep.recv_async(peer, "never")
    conn.send("waiting")
    if not conn.poll(WAIT):
        raise TimeoutError("no word from the parent")
    killed_at = conn.recv()  # time.time() of the SIGKILL
    try:
        fut.result(WAIT)
        outcome = "received"
    except Exception as e:
        outcome = f"{type(e).__name__} {getattr(e, 'status_name', '')}: {e}"
    return {"outcome": outcome, "after_s": time.time() - killed_at}


def _killed_peer_sender(ep, peer, args):
    conn = args["conn"]
    ep.send(peer, "x", np.zeros(1 << 16, np.uint8)).result(WAIT)  # connected
    conn.send("armed")
    if not conn.poll(WAIT):
        raise TimeoutError("no word from the parent")
    killed_at = conn.recv()
    t0 = time.time()
    outcome = "sent"
    for i in range(1000):  # keep sending until the loss shows
        try:
            ep.send(peer, "x", np.full(1 << 16, i, np.uint8)).result(WAIT)
        except Exception as e:
            outcome = f"{type(e).__name__} {getattr(e, 'status_name', '')}: {e}"
            break
        if time.time() - t0 > WAIT:
            break
    return {"outcome": outcome, "after_s": time.time() - killed_at}


def _torch_receiver(ep, peer, args):
    import torch

    out = {}
    for slot, dt, shape, seed in args["cases"]:
        with ep.recv(peer, slot, timeout=WAIT) as r:
            t = torch.from_dlpack(r)
            want = payload(seed, dt, shape)
            out[slot] = {
                "equal": t.numpy().tobytes() == want.tobytes() and t.numpy().dtype == want.dtype,
                "same_memory": t.numel() == 0 or t.data_ptr() == r.array.ctypes.data,
                "dtype": str(t.dtype), "shape": list(t.shape),
            }
            del t
    return out


def _torch_sender(ep, peer, args):
    import torch

    for slot, dt, shape, seed in args["cases"]:
        t = torch.from_numpy(payload(seed, dt, shape).copy())
        ep.send(peer, slot, t.numpy()).result(WAIT)
    return {}


ROLES = {name[1:]: fn for name, fn in globals().items() if name.startswith("_") and callable(fn)
         and not name.startswith("__")}


def child(role, conn, me, peer, places, args):
    """Entry point of a child process (multiprocessing, spawn)."""
    try:
        from rdma_device.endpoint import Endpoint, stats

        args = dict(args or {}, conn=conn)
        with Endpoint(me[0], me[1]) as ep:
            ep.add_peer(peer[0], peer[1])
            conn.send("ready")
            if not conn.poll(WAIT):
                raise TimeoutError("no go from the parent")
            conn.recv()
            for slot, shape, dtype in places:
                ep.place(peer[0], slot, shape, dtype)
            # Slots are placed before the peer's first send to them (a
            # placement racing with that send waits for the receive).
            conn.send("placed")
            if not conn.poll(WAIT):
                raise TimeoutError("no start from the parent")
            conn.recv()
            result = ROLES[role](ep, peer[0], args)
            result["stats"] = stats()["counters"]
            result["tensorflow_imported"] = "tensorflow" in sys.modules
            result["pid"] = os.getpid()
            conn.send({"result": result})
            # Close only once the peer is done too: a receiver still
            # claiming arrays from a closed sender fails them (NotViable).
            if conn.poll(WAIT):
                conn.recv()
    except BaseException:
        conn.send({"error": traceback.format_exc()})
