"""The per-step worker RPCs (RunGraph, CleanupGraph) over the transport.

A real 2-task cluster (ps + worker 0, whose master runs the client's TF1
sessions). Asserted, as a user would notice it:
- every step's RunGraph and CleanupGraph to the ps went over the transport,
  counted exactly (two per remote partition per step, none over gRPC), and
  training fetches bit-identical values to a stock gRPC cluster's;
- a step whose ps partition blocks fails with DeadlineExceeded within its
  ``operation_timeout_in_ms`` plus the transport's check interval (1 s);
- a hung ps (SIGSTOP) fails a step with a timeout the same way;
- a ps killed while it runs its partition fails the step with an error
  within 10 s, without any timeout set.
"""

import os
import signal
import time

import pytest

from rdma_device._cluster import LocalCluster

STEPS = 12


def _tf():
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    return tf


def _train_graph(tf, c):
    """w on the ps; worker 0 computes an update from it and sends it back."""
    g = tf.Graph()
    with g.as_default():
        with tf.device(c.device("ps", 0)):
            w = tf.Variable(tf.random.stateless_uniform([4096], seed=[1, 2]), name="w")
        with tf.device(c.device("worker", 0)):
            step = tf.compat.v1.placeholder(tf.float32, [])
            grad = tf.tanh(w.value() * step) * 0.01
        with tf.device(c.device("ps", 0)):
            train = w.assign_sub(grad)
        init = tf.compat.v1.global_variables_initializer()
    return g, init, train, step


def _counters(c):
    return {t: s["counters"] for t, s in c.stats().items()}


def _run(tf, c):
    g, init, train, step = _train_graph(tf, c)
    with tf.compat.v1.Session(c.target(), graph=g) as s:
        s.run(init)
        s.run(train, {step: 0.5})  # registers the partitions; connects the tasks
        c.reset_stats()
        for i in range(STEPS):
            out = s.run(train, {step: float(i)})
        return out.tobytes()


@pytest.fixture(scope="module")
def clusters(plugin_built, log_dir):
    env = {"RDMA_DEVICE_STRICT": "1"}
    cs = {p: LocalCluster(p, {"ps": 1, "worker": 1}, env=env if p != "grpc" else None, log_dir=log_dir,
                          name=f"worker-rpc-{p}")
          for p in ("grpc", "grpc+rdma_device")}
    yield cs
    for c in cs.values():
        c.close()


def test_run_graph_goes_over_the_transport_counted_and_bit_identical(clusters):
    tf = _tf()
    want = _run(tf, clusters["grpc"])
    got = _run(tf, clusters["grpc+rdma_device"])
    assert got == want, "training over the transport differs from stock gRPC"
    c = clusters["grpc+rdma_device"]
    # The last step's CleanupGraph runs after the step returned: wait for it.
    deadline = time.time() + 10
    while True:
        n = _counters(c)
        master = n["/job:worker/task:0"]
        if master["worker_rpcs_over_transport"] >= 2 * STEPS or time.time() > deadline:
            break
        time.sleep(0.05)
    # One RunGraph and one CleanupGraph per step to the one remote
    # partition (the ps); the local partition needs no RPC.
    assert master["worker_rpcs_over_transport"] == 2 * STEPS, master
    assert master["worker_rpcs_over_grpc"] == 0, master
    assert n["/job:ps/task:0"]["worker_rpcs_over_transport"] == 0, n
    # And the tensors went over the transport too (strict mode: no fallback).
    assert master["tensors_received"] >= STEPS and master["fallback_tensors"] == 0, master


def _blocking_graph(tf, c):
    """A step whose ps partition waits on an empty queue."""
    g = tf.Graph()
    with g.as_default():
        with tf.device(c.device("ps", 0)):
            q = tf.queue.FIFOQueue(1, tf.float32, shapes=[[]])
            x = q.dequeue()
        with tf.device(c.device("worker", 0)):
            y = x + 1.0
            z = tf.constant(1.0) + 1.0
    return g, y, z


def _session(tf, c, g, timeout_ms):
    cfg = tf.compat.v1.ConfigProto(operation_timeout_in_ms=timeout_ms)
    return tf.compat.v1.Session(c.target(), graph=g, config=cfg)


def test_operation_timeout_fails_a_blocked_step_within_its_bound(clusters):
    tf = _tf()
    c = clusters["grpc+rdma_device"]
    g, y, z = _blocking_graph(tf, c)
    with _session(tf, c, g, 1000) as s:
        s.run(z)
        t0 = time.time()
        with pytest.raises(tf.errors.DeadlineExceededError):
            s.run(y)
        took = time.time() - t0
    assert took < 1.0 + 1.0 + 2.0, f"the step failed after {took:.1f} s (timeout 1 s)"


def test_a_hung_ps_fails_a_step_with_its_timeout(clusters):
    tf = _tf()
    c = clusters["grpc+rdma_device"]
    g, init, train, step = _train_graph(tf, c)
    with _session(tf, c, g, 1500) as s:
        s.run(init)
        s.run(train, {step: 1.0})
        before = _counters(c)["/job:worker/task:0"]["worker_rpcs_over_transport"]
        pid = c.pid("ps", 0)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.time()
            with pytest.raises((tf.errors.DeadlineExceededError, tf.errors.UnavailableError)):
                s.run(train, {step: 2.0})
            took = time.time() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert took < 1.5 + 1.0 + 2.0, f"the step failed after {took:.1f} s (timeout 1.5 s)"
        # The task is back: steps run again.
        s.run(train, {step: 3.0})
    assert _counters(c)["/job:worker/task:0"]["worker_rpcs_over_transport"] > before


_KILL_SCENARIO = r"""
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import test_worker_rpc as T
from rdma_device._cluster import LocalCluster
tf = T._tf()
c = LocalCluster("grpc+rdma_device", {"ps": 1, "worker": 1}, log_dir=sys.argv[2], name="worker-rpc-kill")
g, y, z = T._blocking_graph(tf, c)
s = tf.compat.v1.Session(c.target(), graph=g)
s.run(z)
# Connect the tasks (the blocking graph sends no tensor before it blocks).
g2, init, train, step = T._train_graph(tf, c)
with tf.compat.v1.Session(c.target(), graph=g2) as s2:
    s2.run(init)
    s2.run(train, {step: 1.0})
res = {}
def run():
    try:
        s.run(y)
        res["e"] = None
    except tf.errors.OpError as e:
        res["e"] = e
    res["t"] = time.time()
th = threading.Thread(target=run, daemon=True)
th.start()
time.sleep(1.0)  # the ps is in its partition, blocked on the queue
alive = th.is_alive()
t_kill = time.time()
c.kill("ps", 0)
th.join(30)
e = res.get("e")
print("RESULT", alive, th.is_alive(), type(e).__name__, round(res.get("t", 1e9) - t_kill, 3), flush=True)
print("MESSAGE", str(e).replace("\n", " | ")[:500], flush=True)
# Closing the session would make TF's master talk to the dead ps over
# gRPC (as it does under stock gRPC): leave without it.
c.close()
os._exit(0)
"""


def test_a_ps_killed_during_run_graph_fails_the_step(plugin_built, log_dir):
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", _KILL_SCENARIO, here, log_dir], capture_output=True, text=True,
                       timeout=120)
    lines = {l.split(" ", 1)[0]: l.split(" ", 1)[1] for l in p.stdout.splitlines() if " " in l}
    assert "RESULT" in lines, p.stdout[-2000:] + p.stderr[-2000:]
    was_blocked, still_waiting, kind, took = lines["RESULT"].split()
    assert was_blocked == "True", "the step did not block in the ps's partition"
    assert still_waiting == "False", "the step still waits 30 s after the ps was killed"
    assert kind in ("UnavailableError", "AbortedError", "CancelledError"), lines
    assert float(took) < 10.0, f"the step failed {took} s after the kill"
    # Worded as TF's gRPC errors, naming the peer (fault handling relies on it).
    assert "/job:ps/replica:0/task:0" in lines["MESSAGE"], lines["MESSAGE"]


def test_a_peer_with_no_tensor_link_gets_its_run_graph_over_the_transport_soon(plugin_built, log_dir):
    # A step whose only remote partition exchanges no tensor with the
    # master's task (an update that runs on the ps alone): nothing else
    # connects the two tasks, so the master connects to the ps itself once
    # it has a RunGraph for it, and later steps go over the transport.
    tf = _tf()
    c = LocalCluster("grpc+rdma_device", {"ps": 1, "worker": 1}, env={"RDMA_DEVICE_STRICT": "1"},
                     log_dir=log_dir, name="worker-rpc-no-link")
    try:
        g = tf.Graph()
        with g.as_default():
            with tf.device(c.device("ps", 0)):
                v = tf.Variable(0.0, name="counter")
                bump = v.assign_add(1.0).op
        with tf.compat.v1.Session(c.target(), graph=g) as s:
            s.run(v.initializer)
            deadline = time.time() + 10
            steps = 0
            while time.time() < deadline:
                s.run(bump)
                steps += 1
                if _counters(c)["/job:worker/task:0"]["worker_rpcs_over_transport"] > 0:
                    break
                time.sleep(0.02)
            c.reset_stats()
            for _ in range(STEPS):
                s.run(bump)
            assert s.run(v.value()) == float(steps + STEPS)
        master = _counters(c)["/job:worker/task:0"]
        # Every RunGraph of the counted steps went over the transport (their
        # CleanupGraph may still be on its way).
        assert master["worker_rpcs_over_transport"] >= STEPS, (steps, master)
        assert master["worker_rpcs_over_grpc"] == 0, (steps, master)
    finally:
        c.close()


FEED_MB = 128


def _small_and_big(tf, c):
    """Two graphs on one cluster: a small training step between worker 0
    and the ps, and a step that feeds FEED_MB to a placeholder on the ps."""
    g, init, train, step = _train_graph(tf, c)
    bg = tf.Graph()
    with bg.as_default():
        with tf.device(c.device("ps", 0)):
            x = tf.compat.v1.placeholder(tf.float32, [FEED_MB << 18])
            head = tf.reduce_sum(x[:16])
    return (g, init, train, step), (bg, x, head)


def _steps_during_feeds(tf, c, feeds):
    """Small steps run back to back in one session while another session
    makes `feeds` large feeds to the ps, one after another. Returns the
    small steps that overlapped a feed (their wall times, s), how many
    small steps ran, and each feed's fetched value."""
    import threading

    import numpy as np

    (g, init, train, step), (bg, x, head) = _small_and_big(tf, c)
    feed = np.full(FEED_MB << 18, 2.0, np.float32)
    small = tf.compat.v1.Session(c.target(), graph=g)
    big = tf.compat.v1.Session(c.target(), graph=bg)
    try:
        small.run(init)
        small.run(train, {step: 0.5})  # registers the partitions; connects the tasks
        big.run(head, {x: feed[: FEED_MB << 18]})
        c.reset_stats()
        stop = threading.Event()
        spans = []

        def loop():
            while not stop.is_set():
                t0 = time.perf_counter()
                small.run(train, {step: 0.1})
                spans.append((t0, time.perf_counter()))

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        windows, heads = [], []
        try:
            for _ in range(feeds):
                t0 = time.perf_counter()
                heads.append(float(big.run(head, {x: feed})))
                windows.append((t0, time.perf_counter()))
        finally:
            stop.set()
            th.join(60)
        assert not th.is_alive(), "the small steps still run 60 s after the feeds ended"
        during = [b - a for a, b in spans if any(a < we and b > ws for ws, we in windows)]
        return during, len(spans), heads
    finally:
        small.close()
        big.close()


def test_a_large_remote_feed_holds_up_no_other_session(clusters):
    # A TF1 feed of FEED_MB aimed at a placeholder on the ps, while another
    # session's small steps cross the same pair of tasks. TensorFlow 2.21's
    # master receives a feed on its own device and sends it to the ps as a
    # tensor (a one-sided write, counted below), not inside its RunGraph
    # request: the requests stay a few KB and are served on the transport's
    # thread that read them; every CleanupGraph (a step's teardown) is
    # served on TF's compute pool, as stock's gRPC worker service serves
    # it. Counted exactly on the ps. The other session's step times while
    # the feeds run stay within 2x of the same run under stock gRPC
    # (interleaved, two rounds each).
    import statistics

    tf = _tf()
    feeds = 2
    mean_ms = {"grpc": [], "grpc+rdma_device": []}
    for _ in range(2):
        for p in mean_ms:
            c = clusters[p]
            during, steps, heads = _steps_during_feeds(tf, c, feeds)
            assert heads == [32.0] * feeds, heads
            assert during, f"{p}: no small step ran while the feeds did"
            mean_ms[p].append(1e3 * statistics.mean(during))
            if p == "grpc":
                continue
            # Every call this round has been answered but the last steps'
            # CleanupGraph, which follows its step: wait for them.
            calls = steps + feeds
            deadline = time.time() + 10
            while True:
                ps = _counters(c)["/job:ps/task:0"]
                if ps["worker_rpcs_served_on_pool"] >= calls or time.time() > deadline:
                    break
                time.sleep(0.05)
            assert ps["worker_rpcs_served_inline"] == calls, (steps, feeds, ps)
            assert ps["worker_rpcs_served_on_pool"] == calls, (steps, feeds, ps)
            # The feeds crossed as tensors: one per step of either session.
            assert ps["tensors_received"] == calls, (steps, feeds, ps)
            assert ps["bytes_received"] >= feeds * (FEED_MB << 20), ps
            master = _counters(c)["/job:worker/task:0"]
            assert master["worker_rpcs_over_grpc"] == 0 and master["fallback_tensors"] == 0, master
    ours, stock = statistics.median(mean_ms["grpc+rdma_device"]), statistics.median(mean_ms["grpc"])
    assert ours <= 2 * stock, (
        f"the other session's steps took {ours:.1f} ms on average while the feeds ran, against "
        f"{stock:.1f} ms under stock gRPC (every round: {mean_ms})")
    print(f"other session's mean step while feeding: {mean_ms}")


def test_a_run_graph_cancelled_while_it_starts_ends_instead_of_going_to_grpc(plugin_built, log_dir,
                                                                            tmp_path_factory):
    # TF's master cancels each of a step's calls once, when another
    # partition fails. A cancel that reaches a RunGraph while the transport
    # is still starting it, whose start then fails, must end that call: a
    # call sent over gRPC instead would never see the cancel, and a
    # partition blocked on the callee would hold the step. An LD_PRELOAD
    # (call_start_race/) makes that interleaving every time: the partition
    # the master calls first fails at once; its RunGraph to the other ps
    # (whose partition would block on an empty queue) is held until that
    # failure has cancelled the step's calls, then fails to start. Each ps
    # runs the same partition, made to fail or to block by a flag.
    import harness
    import rdma_device

    tf = _tf()
    work = tmp_path_factory.mktemp("call-race")
    ctl, log = str(work / "ctl"), str(work / "calls.log")
    env = {"LD_PRELOAD": harness.build_preload(tmp_path_factory, "call_start_race", "the call-start race",
                                               ["-ldl", "-lpthread"]),
           "CALL_RACE_LIB": os.path.join(rdma_device.lib_dir(), "librdma_device.so"),
           "CALL_RACE_CTL": ctl, "CALL_RACE_LOG": log, "RDMA_DEVICE_STRICT": "1"}
    c = LocalCluster("grpc+rdma_device", {"ps": 2, "worker": 1}, env=env, log_dir=log_dir,
                     name="worker-rpc-call-race")

    def write_ctl(text):
        with open(ctl + ".new", "w") as f:
            f.write(text + "\n")
        os.replace(ctl + ".new", ctl)

    def log_lines():
        with open(log) as f:
            return f.read().splitlines()

    try:
        g = tf.Graph()
        with g.as_default():
            flags, fills, outs = [], [], []
            for i in range(2):
                with tf.device(c.device("ps", i)):
                    fail = tf.Variable(0.0, name=f"fail{i}")
                    q = tf.queue.FIFOQueue(1, tf.float32, shapes=[[]], name=f"q{i}")
                    # Fails on the ps's own state, needing nothing of the
                    # master's partition (held meanwhile); its dequeue is
                    # then cancelled with its step.
                    check = tf.debugging.Assert(fail.value() < 0.5, [f"the partition on ps {i} fails"])
                    with tf.control_dependencies([check]):
                        outs.append(q.dequeue())
                    flags.append(fail)
                    fills.append(q.enqueue(float(i)))
            with tf.device(c.device("worker", 0)):
                out = outs[0] + outs[1]
                warm = flags[0].value() + flags[1].value()
        cfg = tf.compat.v1.ConfigProto(operation_timeout_in_ms=20000)
        with tf.compat.v1.Session(c.target(), graph=g, config=cfg) as s:
            s.run(tf.compat.v1.variables_initializer(flags))
            assert s.run(warm) == 0.0  # connects worker 0 with both ps
            # The order the master calls this step's partitions in (fixed
            # for one graph and fetch).
            s.run(fills)
            write_ctl("record")
            assert s.run(out) == 1.0
            os.remove(ctl)
            first, second = [l.split()[1] for l in log_lines() if l.startswith("call ")]
            assert {first, second} == {"/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"}, (first, second)
            s.run(flags[int(first[-1])].assign(1.0))
            write_ctl(f"race {first} {second}")
            t0 = time.time()
            # The other partition's error, as under stock gRPC (the held
            # call's cancellation is derived, as gRPC's is); never the
            # timeout.
            with pytest.raises(tf.errors.InvalidArgumentError, match=f"the partition on ps {first[-1]} fails"):
                s.run(out)
            took = time.time() - t0
            os.remove(ctl)
            assert log_lines()[-1] == f"held {second} after_reply=1", log_lines()
            # Under 744741f the held call went to gRPC after its cancel and
            # the step waited for its 20 s timeout.
            assert took < 5.0, f"the step failed after {took:.1f} s"
            s.run(flags[int(first[-1])].assign(0.0))
            s.run(fills)
            assert s.run(out) == 1.0
    finally:
        c.close()


def test_a_step_failing_on_the_ps_reports_the_ps_error_as_stock_does(clusters):
    # The ps's partition fails (an assertion) while worker 0's partition
    # waits for a tensor from it. Under stock gRPC the client always gets
    # the ps's InvalidArgument. Over the transport the ps's abort reaches
    # worker 0 first and fails its receive; that failure, and the call
    # TF's master cancels because of it, are consequences, not the cause:
    # marked derived (as TF's rendezvous and gRPC mark theirs), so the
    # master reports the ps's error, every time.
    tf = _tf()
    got = {}
    for p in ("grpc", "grpc+rdma_device"):
        c = clusters[p]
        g = tf.Graph()
        with g.as_default():
            with tf.device(c.device("ps", 0)):
                v = tf.Variable(1.0, name="v")
                check = tf.debugging.Assert(v.value() < 0.0, ["the ps partition fails"])
                with tf.control_dependencies([check]):
                    x = v.value() * 2.0
            with tf.device(c.device("worker", 0)):
                y = x + 1.0
        with tf.compat.v1.Session(c.target(), graph=g) as s:
            s.run(v.initializer)
            kinds = []
            for _ in range(10):
                try:
                    s.run(y)
                    kinds.append("ok")
                except tf.errors.OpError as e:
                    assert "the ps partition fails" in str(e), e
                    kinds.append(type(e).__name__)
            got[p] = kinds
    assert got["grpc"] == ["InvalidArgumentError"] * 10, got
    assert got["grpc+rdma_device"] == got["grpc"], got
