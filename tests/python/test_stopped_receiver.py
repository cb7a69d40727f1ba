"""A frozen receiver (SIGSTOP: swapping, a debugger, a stuck host) must not
stall TensorFlow's threads in the tasks that send to it.

A real 3-task cluster (ps, worker 0 whose master runs the client's
sessions, worker 1). Session A moves tensors ps → worker 0; session B moves
several small and large tensors ps → worker 1 every step. With worker 1
stopped:
- session A's steps keep running, each within a bound, with the right
  values (the ps's inter-op threads and its transport are not wedged by
  the sends it has queued for worker 1);
- session B's step fails with its ``operation_timeout_in_ms`` and returns
  within 1 s of that deadline (plus the transport's check interval);
- once worker 1 is continued, session B's steps run again, bit-identical
  to before.
"""

import os
import signal
import statistics
import threading
import time

import numpy as np
import pytest

from rdma_device._cluster import LocalCluster

# Tensors ps → worker 1 per step of session B: small ones (copied on the
# sending thread) and large ones (posted to the write engine).
B_SIZES = [1024] * 6 + [256 * 1024] * 4
TIMEOUT_MS = 1500


def _tf():
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    return tf


def _graph(tf, c, worker, sizes, seed):
    g = tf.Graph()
    with g.as_default():
        vs = []
        with tf.device(c.device("ps", 0)):
            for i, n in enumerate(sizes):
                vs.append(tf.Variable(tf.random.stateless_uniform([n], seed=[seed, i]), name=f"v{i}"))
        with tf.device(c.device("worker", worker)):
            # Every received byte is read.
            out = tf.add_n([tf.reduce_sum(v.value()) for v in vs])
        init = tf.compat.v1.global_variables_initializer()
    return g, init, out


@pytest.fixture(scope="module")
def cluster(plugin_built, log_dir):
    c = LocalCluster("grpc+rdma_device", {"ps": 1, "worker": 2}, env={"RDMA_DEVICE_STRICT": "1"},
                     log_dir=log_dir, name="stopped-receiver")
    yield c
    c.close()


def test_a_stopped_receiver_stalls_no_other_session(cluster):
    tf = _tf()
    c = cluster
    ga, inita, outa = _graph(tf, c, 0, [256 * 1024, 4096], seed=1)
    gb, initb, outb = _graph(tf, c, 1, B_SIZES, seed=2)
    cfg = tf.compat.v1.ConfigProto(operation_timeout_in_ms=TIMEOUT_MS)
    sa = tf.compat.v1.Session(c.target(), graph=ga)
    sb = tf.compat.v1.Session(c.target(), graph=gb, config=cfg)
    try:
        sa.run(inita)
        sb.run(initb)
        want_a = sa.run(outa)
        want_b = sb.run(outb)
        for _ in range(3):
            assert sa.run(outa) == want_a
            assert sb.run(outb) == want_b
        before = c.stats()["/job:ps/task:0"]["counters"]["tensors_pushed"]
        # Session A's normal step time, for its bound below.
        t = []
        for _ in range(10):
            t0 = time.time()
            sa.run(outa)
            t.append(time.time() - t0)
        normal = statistics.median(t)

        pid = c.pid("worker", 1)
        os.kill(pid, signal.SIGSTOP)
        res = {}
        try:
            def step_b():
                t0 = time.time()
                try:
                    sb.run(outb)
                    res["error"] = None
                except tf.errors.OpError as e:
                    res["error"] = e
                res["took"] = time.time() - t0

            th = threading.Thread(target=step_b, daemon=True)
            th.start()
            # Session A meanwhile: every step runs, each within a bound.
            slow = []
            deadline = time.time() + TIMEOUT_MS / 1000.0 + 2.0
            n = 0
            while time.time() < deadline or n < 20:
                t0 = time.time()
                got = sa.run(outa)
                took = time.time() - t0
                assert got == want_a, "session A's value changed while worker 1 was stopped"
                if took > 1.0:
                    slow.append(round(took, 3))
                n += 1
            th.join(10)
            assert not th.is_alive(), "session B's step still waits 10 s after its deadline"
        finally:
            os.kill(pid, signal.SIGCONT)
        assert not slow, f"session A stalled while worker 1 was stopped (normal step {normal * 1e3:.1f} ms): {slow}"
        e = res["error"]
        assert isinstance(e, (tf.errors.DeadlineExceededError, tf.errors.UnavailableError, tf.errors.AbortedError,
                              tf.errors.CancelledError)), repr(e)
        # Within 1 s of its deadline, plus the transport's check interval.
        assert res["took"] < TIMEOUT_MS / 1000.0 + 1.0 + 1.0, f"session B's step returned after {res['took']:.2f} s"
        # Worker 1 is back: session B runs again, with the same values.
        for _ in range(3):
            assert sb.run(outb) == want_b
        after = c.stats()["/job:ps/task:0"]["counters"]["tensors_pushed"]
        assert after > before, "nothing went over the transport"
        print(f"\nsession A: {n} steps while worker 1 was stopped (normal {normal * 1e3:.1f} ms); "
              f"session B failed after {res['took']:.2f} s: {type(e).__name__}")
    finally:
        sa.close()
        sb.close()
