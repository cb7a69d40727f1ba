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
