"""rdma_device.endpoint between real processes (no TensorFlow): every
dtype and shape bit-identical, 4 KiB..64 MiB arrays in place, exact
counters, deadlines, killed peers, PyTorch through DLPack.

Each test starts two spawned processes (endpoint_roles.child) on free
loopback ports; every wait has a deadline and a hang is a failure.
"""

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import endpoint_roles as roles
from rdma_device._cluster import free_ports

WAIT = 120.0
# A peer killed with SIGKILL fails the other side's pending operations
# within this bound (shm: its socket closes at once).
PEER_LOSS_BOUND_S = 5.0
VENV_PYTHON = os.path.expanduser("~/.cache/rdma_device/venv/bin/python")


class Pair:
    """Two child processes "a" and "b", each with an endpoint."""

    def __init__(self, a_role, b_role, a_places=(), b_places=(), a_args=None, b_args=None):
        ctx = mp.get_context("spawn")
        pa, pb = free_ports(2)
        me = {"a": ("a", f"127.0.0.1:{pa}"), "b": ("b", f"127.0.0.1:{pb}")}
        self.conn, self.proc = {}, {}
        spec = {"a": (a_role, "b", a_places, a_args), "b": (b_role, "a", b_places, b_args)}
        for side, (role, other, places, args) in spec.items():
            parent, child = ctx.Pipe()
            p = ctx.Process(target=roles.child, args=(role, child, me[side], me[other],
                                                      list(places), args), daemon=True)
            p.start()
            self.conn[side], self.proc[side] = parent, p
        for side in ("a", "b"):
            assert self.expect(side) == "ready"
        for step, reply in (("go", "placed"), ("start", None)):
            for side in ("a", "b"):
                self.conn[side].send(step)
            for side in ("a", "b"):
                assert reply is None or self.expect(side) == reply

    def expect(self, side, timeout=WAIT):
        conn = self.conn[side]
        if not conn.poll(timeout):
            raise AssertionError(f"{side}: no message within {timeout} s (hung?)")
        msg = conn.recv()
        if isinstance(msg, dict) and "error" in msg:
            raise AssertionError(f"{side} failed:\n{msg['error']}")
        return msg

    def result(self, side, timeout=WAIT):
        msg = self.expect(side, timeout)
        assert isinstance(msg, dict) and "result" in msg, msg
        return msg["result"]

    def close(self):
        for conn in self.conn.values():
            try:
                conn.send("bye")
            except OSError:
                pass  # a killed child
        for p in self.proc.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)


@pytest.fixture
def pair():
    made = []

    def make(*a, **kw):
        made.append(Pair(*a, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_every_dtype_and_shape_bit_identical(pair):
    cases = roles.cases()
    places = [(slot, shape, dt) for slot, dt, shape, _ in cases]
    p = pair("dtypes_sender", "dtypes_receiver", b_places=places)
    tx, rx = p.result("a"), p.result("b")
    assert rx["bad"] == [], rx["bad"]
    nbytes = sum(roles.payload(seed, dt, shape).nbytes for _, dt, shape, seed in cases)
    sent = sum(1 for _, dt, shape, seed in cases)
    print(f"{sent} arrays of {len({dt for _, dt, _, _ in cases})} dtypes, {nbytes} bytes")
    assert (tx["stats"]["tensors_pushed"], tx["stats"]["bytes_pushed"]) == (sent, nbytes)
    assert (rx["stats"]["tensors_received"], rx["stats"]["bytes_received"]) == (sent, nbytes)
    assert tx["stats"]["fallback_tensors"] == rx["stats"]["fallback_tensors"] == 0
    assert rx["in_place"] == sent
    # DLPack (numpy.from_dlpack: zero-copy, read-only) for every type
    # NumPy's exporter has a DLPack code for: all of TensorFlow's numeric
    # types but bfloat16 (an ml_dtypes extension), not dates or long double.
    print(f"DLPack: {rx['dlpack']} exported, none for {rx['no_dlpack']}")
    tf_types = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"}
    assert rx["dlpack"] == 6 * len(tf_types) and not tf_types & set(rx["no_dlpack"]), rx
    assert not tx["tensorflow_imported"] and not rx["tensorflow_imported"]


def test_sizes_4k_to_64m_in_place_with_exact_counters(pair):
    reps = 2
    places = [(f"s{n}", (n,), "uint8") for n in roles.SIZES]
    p = pair("sizes_sender", "sizes_receiver", b_places=places,
             a_args={"reps": reps}, b_args={"reps": reps})
    tx, rx = p.result("a"), p.result("b")
    assert rx["bad"] == [] and rx["not_in_place"] == [], rx
    total = reps * sum(roles.SIZES)
    count = reps * len(roles.SIZES)
    assert (tx["stats"]["tensors_pushed"], tx["stats"]["bytes_pushed"]) == (count, total)
    assert (rx["stats"]["tensors_received"], rx["stats"]["bytes_received"]) == (count, total)
    # Every slot was placed ahead: no array went through the chunked path.
    assert rx["stats"]["stream_chunks"] == 0 and tx["stats"]["stream_chunks"] == 0


def test_receive_deadline_then_the_same_array_arrives(pair):
    p = pair("wait_then_send", "deadline_receiver", b_places=[("late", (5,), "int64")])
    assert p.expect("b") == "send now"  # after its receive timed out
    p.conn["a"].send("send")
    rx = p.result("b")
    p.result("a")
    assert rx["first"] == "DeadlineExceeded status=RDEV_TIMEOUT", rx
    assert 0.5 <= rx["waited"] < 1.5, rx
    assert rx["late"] == [0, 1, 2, 3, 4]  # the receive that timed out lost nothing


def test_killed_sender_fails_pending_receive_within_bound(pair):
    p = pair("idle", "killed_peer_receiver", b_places=[("never", (4,), "float32")])
    assert p.expect("a") == "idle"
    assert p.expect("b") == "waiting"
    os.kill(p.proc["a"].pid, signal.SIGKILL)
    p.conn["b"].send(time.time())
    rx = p.result("b")
    print(f"receiver: {rx['outcome']} {rx['after_s']:.3f} s after the SIGKILL")
    assert rx["outcome"].startswith(("PeerLost", "Aborted")), rx
    assert rx["after_s"] < PEER_LOSS_BOUND_S, rx


def test_killed_receiver_fails_sends_within_bound(pair):
    p = pair("killed_peer_sender", "idle", b_places=[("x", (1 << 16,), "uint8")])
    assert p.expect("b") == "idle"
    assert p.expect("a") == "armed"
    os.kill(p.proc["b"].pid, signal.SIGKILL)
    p.conn["a"].send(time.time())
    tx = p.result("a")
    print(f"sender: {tx['outcome']} {tx['after_s']:.3f} s after the SIGKILL")
    # A send that starts after the link dropped tries to reach the peer
    # again (it may have restarted) for a 1.5 s grace: DeadlineExceeded.
    assert tx["outcome"].startswith(("PeerLost", "Aborted", "DeadlineExceeded")), tx
    assert tx["after_s"] < PEER_LOSS_BOUND_S, tx


def _torch_missing():
    """Why PyTorch cannot be used here, or None."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch is not importable here ({e}); the project's venv does not ship it"
    return None


def test_torch_cpu_tensors_through_dlpack(pair):
    why = _torch_missing()
    if why:
        print(f"SKIPPED: {why}")
        pytest.skip(why)
    import torch  # noqa: F401

    cases = [(f"t{i}", dt, shape, 50 + i) for i, (dt, shape) in enumerate([
        ("<f4", (3, 4)), ("<f8", (1 << 20,)), ("<i8", (2, 2, 2)), ("|u1", (4096,)),
        ("<f2", (7,)), ("<c8", (5,)), ("|b1", (9,)), ("<i4", ()), ("<f4", (0, 3))])]
    places = [(slot, shape, dt) for slot, dt, shape, _ in cases]
    p = pair("torch_sender", "torch_receiver", b_places=places, a_args={"cases": cases},
             b_args={"cases": cases})
    rx = p.result("b")
    p.result("a")
    for slot, r in rx.items():
        if slot in ("pid", "stats", "tensorflow_imported"):
            continue
        assert r["equal"] and r["same_memory"], (slot, r)


def test_errors_carry_status_and_message(monkeypatch):
    from rdma_device.endpoint import ConfigError, Endpoint, NotViable, RdevError

    with Endpoint("solo") as ep:
        with pytest.raises(ValueError, match="not a peer"):
            ep.send("nobody", "x", np.zeros(3))
        with pytest.raises(ValueError, match="not placed"):
            ep.recv("nobody", "x", timeout=1)
        assert ep.add_peer("p", "127.0.0.1:1", timeout=0) == "shm"
        with pytest.raises(TypeError, match="cannot travel"):
            ep.send("p", "x", np.array(["a"], dtype=object))
    monkeypatch.setenv("RDMA_DEVICE_TRANSPORTS", "verbs")  # no RDMA device here
    with Endpoint("verbs-only") as ep:
        with pytest.raises(NotViable) as e:
            ep.add_peer("p", "127.0.0.1:1", timeout=0)
        assert isinstance(e.value, RdevError) and e.value.status_name == "RDEV_NOT_VIABLE"
        assert "verbs" in e.value.message
    monkeypatch.setenv("RDMA_DEVICE_SLOTS_PER_EDGE", "0")
    with pytest.raises(ConfigError, match="RDMA_DEVICE_SLOTS_PER_EDGE"):
        Endpoint("bad-config")


def test_conversions_mismatch_and_release():
    """Non-contiguous and big-endian arrays arrive as their values; an
    array that does not match the placed slot is an InvalidArgument naming
    both; a released receive refuses access, a view taken before keeps
    its bytes; a closed endpoint refuses calls."""
    from rdma_device.endpoint import Aborted, Endpoint, InvalidArgument

    with Endpoint("a") as a, Endpoint("b") as b:
        a.add_peer("b", b.address)
        b.add_peer("a", a.address)
        b.place("a", "t", (3, 4), np.float64)
        b.place("a", "be", (5,), np.int32)
        b.place("a", "m", (2,), np.float32)
        x = np.arange(12, dtype=np.float64).reshape(4, 3)
        a.send("b", "t", x.T).result(10)  # Fortran order: copied first
        a.send("b", "be", np.arange(5, dtype=">i4")).result(10)
        a.send("b", "m", np.zeros(3, np.float32)).result(10)
        with b.recv("a", "t", timeout=10) as r:
            assert r.array.tobytes() == np.ascontiguousarray(x.T).tobytes()
            assert not r.array.flags.writeable
            kept = r.array
        assert kept.tolist() == x.T.tolist()  # a view outlives release()
        with pytest.raises(ValueError, match="released"):
            r.array
        with b.recv("a", "be", timeout=10) as r:
            assert r.dtype == np.dtype("=i4") and r.array.tolist() == [0, 1, 2, 3, 4]
        with pytest.raises(InvalidArgument, match=r"placed for float32\[2\].*sent float32\[3\]"):
            b.recv("a", "m", timeout=10)
    with pytest.raises(Aborted, match="closed"):
        a.send("b", "t", x)


def test_every_send_of_a_slot_is_converted_as_its_own_array():
    """send() reuses the slot's last meta for an array of the same dtype
    and shape: arrays that match it in dtype and shape but not in layout
    (Fortran order, a strided view, the other byte order, a list, a
    subclass, an equal dtype object with metadata), sent one after another
    through one slot, must each arrive as their values."""
    from rdma_device.endpoint import Endpoint

    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    sends = [x, np.asfortranarray(x), x.astype(">f8"), x, x.tolist(), x.view(np.matrix), x + 1,
             np.arange(24, dtype=np.float64).reshape(3, 8)[:, ::2], x.T.T, np.asfortranarray(x + 2), x,
             # An equal dtype in another object (with metadata), twice.
             (x + 3).astype(np.dtype("f8", metadata={"k": 1})), (x + 4).astype(np.dtype("f8", metadata={"k": 1})), x]
    with Endpoint("a") as a, Endpoint("b") as b:
        a.add_peer("b", b.address)
        b.add_peer("a", a.address)
        b.place("a", "same", (3, 4), np.float64)
        for i, arr in enumerate(sends):
            a.send("b", "same", arr).result(10)
            with b.recv("a", "same", timeout=10) as r:
                assert r.array.tolist() == np.asarray(arr).tolist(), (i, type(arr))


def test_slot_larger_than_the_arena_goes_chunked(monkeypatch):
    """An array that does not fit in the receive arena: place() says so
    (False) and the array still arrives, through the chunked path."""
    from rdma_device.endpoint import Endpoint, reset_stats, stats

    monkeypatch.setenv("RDMA_DEVICE_ARENA_BYTES", "1M")
    x = roles.payload(3, np.uint8, (4 << 20,))
    with Endpoint("a") as a, Endpoint("b") as b:
        a.add_peer("b", b.address)
        b.add_peer("a", a.address)
        reset_stats()
        assert b.place("a", "big", x.shape, x.dtype) is False
        for _ in range(2):
            sent = a.send("b", "big", x)
            with b.recv("a", "big", timeout=30) as r:
                assert not r.in_place and r.array.tobytes() == x.tobytes()
            sent.result(30)
        c = stats()["counters"]
        assert c["tensors_received"] == 2 and c["stream_messages"] > 0, c


def test_add_peer_waits_for_a_late_peer():
    """Endpoints may start in any order: add_peer waits until the peer's
    endpoint is up (first contact with an absent one would demote it for
    good), and gives up at its deadline."""
    import threading

    from rdma_device.endpoint import DeadlineExceeded, Endpoint

    (port,) = free_ports(1)
    made = {}
    later = threading.Timer(0.5, lambda: made.setdefault("b", Endpoint("b", f"127.0.0.1:{port}")))
    with Endpoint("a") as a:
        later.start()
        t0 = time.monotonic()
        try:
            assert a.add_peer("b", f"127.0.0.1:{port}", timeout=30) == "shm"
            waited = time.monotonic() - t0
            # b listens before its constructor returns: add_peer may return
            # before the timer's thread has stored it.
            later.join()
            b = made["b"]
            b.add_peer("a", a.address)
            b.place("a", "x", (3,), np.int16)
            a.send("b", "x", np.array([1, -2, 3], np.int16)).result(10)
            with b.recv("a", "x", timeout=10) as r:
                assert r.array.tolist() == [1, -2, 3]
        finally:
            later.join()
            if "b" in made:
                made["b"].close()
        assert 0.4 <= waited < 10, waited
        (nobody,) = free_ports(1)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="did not come up"):
            a.add_peer("c", f"127.0.0.1:{nobody}", timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 1.5


def test_bench_py_smoke(tmp_path):
    """python -m rdma_device.bench py, a few seconds: JSON rows with the
    documented keys for every size and baseline, and the plot."""
    import json

    import rdma_device

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(rdma_device.__file__))] + sys.path))
    plot = tmp_path / "py.png"
    out = subprocess.run([sys.executable, "-m", "rdma_device.bench", "py", "--json", "--quick",
                          "--plot", str(plot)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    assert plot.stat().st_size > 10000
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["baseline"] for r in rows} >= {"shared_memory+pipe"}, rows
    assert {(r["kind"], r["size"]) for r in rows} == {("ping", 64), ("ping", 4096),
                                                      ("stream", 4096), ("stream", 1 << 20)}
    for r in rows:
        assert set(r) >= {"size", "baseline", "ours_gbps", "baseline_gbps", "ratio"}, r
        assert r["ours_gbps"] > 0 and r["baseline_gbps"] > 0, r
        assert abs(r["ratio"] - r["ours_gbps"] / r["baseline_gbps"]) < 1e-6 * r["ratio"] + 1e-9


def test_param_server_example_runs_bit_identical():
    """examples/param_server.py, small: every transport (ours, the
    shared_memory+pipe baseline, the Pipe baseline) trains the same weights
    bit for bit, and each has its row and its ratio in the output."""
    import rdma_device

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(rdma_device.__file__))] + sys.path))
    out = subprocess.run([sys.executable, os.path.join(repo, "examples", "param_server.py"),
                          "--params", "64K", "--steps", "4", "--block", "2"],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "bit-identical across transports: True" in out.stdout, out.stdout
    for base in ("shared_memory+pipe", "pipe"):
        assert f"rdma_device = {base}: True" in out.stdout, out.stdout
        assert re.search(rf"ratio \({re.escape(base)} step / rdma_device step\): \d+\.\d+", out.stdout), \
            out.stdout
    for t in ("rdma_device", "shared_memory+pipe", "pipe"):
        assert re.search(rf"^ +{re.escape(t)}: median step +\d+\.\d+ ms, CPU +\d+\.\d+ ms/step",
                         out.stdout, re.M), out.stdout
