"""Servers changed, reset or deleted while another task's TF1 master
keeps running steps on them (task_main roles "teardown_scenarios.<name>";
test_teardown.py).

Worker 0 holds the partition, worker 1 is the master: x (N float32) goes
to worker 0, y = 2 x + 1 comes back, checked exactly. The tasks read the
test's commands from stdin ("go", "stop", "start", "resume"; see each
scenario)."""

import json
import sys
import threading
import time

import numpy as np

from scenarios import _stats

N = 4096  # float32 per step, each way
EAGER = "/job:worker/replica:0/task:0"
MASTER = "/job:worker/replica:0/task:1"

# Objects that must outlive their scenario: a started server (TF never
# frees one), a session never closed.
_KEPT = []


def _graph(tf):
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(MASTER):
            x = tf.compat.v1.placeholder(tf.float32, [N])
        with tf.device(EAGER):
            y = x * 2.0 + 1.0
        with tf.device(MASTER):
            out = tf.identity(y)
    return graph, x, out


def _emit(prefix, payload=None):
    sys.stdout.write(prefix + ("" if payload is None else " " + json.dumps(payload)) + "\n")
    sys.stdout.flush()


def _wait_line(word):
    """Blocks until stdin has a line naming `word` (the test's command)."""
    for line in sys.stdin:
        if word in line:
            return
    raise RuntimeError(f"stdin closed before {word!r}")


def eager_server_resets(spec, ready):
    """Worker 0 as an eager task: spec["cluster"] is {"worker": [this task,
    the master], "ps": [a server]}. Connects (this task's server starts),
    waits for "go", then for spec["seconds"] cycles through what TensorFlow
    lets an eager context do to its server while it is a fixed-address task:
      "same":   connect_to_cluster again, the same cluster: update_server_def
                (GrpcServer::UpdateServerDef on the running server);
      "grow":   update_server_def with a ps job added (a dynamic cluster);
      "shrink": update_server_def back to the workers alone;
      "new":    connect_to_cluster with a changed cluster: set_server_def,
                a new server for this task (its port is taken by the
                running one), then update_server_def restores the context.
    Last, "reset": the eager context is reset (a new context) and connects
    again. Each action's outcome: "ok" or the TF error's type and message."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    cluster = spec["cluster"]
    base = {"worker": cluster["worker"]}
    grown = dict(base, ps=cluster["ps"])

    def connect(jobs):
        tf.config.experimental_connect_to_cluster(
            tf.train.ClusterSpec(jobs), job_name="worker", task_index=0,
            protocol=spec["protocol"])

    def server_def(jobs):
        d = type(context.context().get_server_def())()
        d.CopyFrom(context.context().get_server_def())  # a copy: the context keeps its own
        d.cluster.CopyFrom(tf.train.ClusterSpec(jobs).as_cluster_def())
        return d

    connect(base)
    context.ensure_initialized()  # the server starts here (not at the first op)
    base_def = server_def(base)
    grown_def = server_def(grown)
    with tf.device(MASTER):  # the master's task answers
        probe = float(tf.constant(20.0) + 1.0)
    ready()
    _wait_line("go")

    def apply(kind):
        if kind == "same":
            connect(base)
        elif kind == "grow":
            context.context().update_server_def(grown_def)
        elif kind == "shrink":
            context.context().update_server_def(base_def)
        elif kind == "new":
            try:
                connect(grown)
            finally:
                # A failed set_server_def keeps the context as it was, but
                # Python recorded the new definition: put it back.
                context.context().update_server_def(base_def)

    outcomes = []
    kinds = ["same", "grow", "shrink", "new"]
    end = time.monotonic() + spec.get("seconds", 8)
    i = 0
    while time.monotonic() < end:
        kind = kinds[i % len(kinds)]
        i += 1
        t0 = time.monotonic()
        try:
            apply(kind)
            outcome = "ok"
        except Exception as e:  # what the user sees
            outcome = f"{type(e).__name__}: {str(e)[:300]}"
        outcomes.append({"kind": kind, "outcome": outcome, "seconds": time.monotonic() - t0})
    # The context itself goes: a new one connects again (lazily: the new
    # server is made at its first op).
    t0 = time.monotonic()
    context._reset_context()
    try:
        connect(base)
        with tf.device(MASTER):
            float(tf.constant(1.0) + 1.0)
        outcome = "ok"
    except Exception as e:  # what the user sees
        outcome = f"{type(e).__name__}: {str(e)[:300]}"
    outcomes.append({"kind": "reset", "outcome": outcome, "seconds": time.monotonic() - t0})
    return {"probe": probe, "outcomes": outcomes, "stats": _stats(spec)}


def _master(spec, ready, tf, timeout_ms):
    """Worker 1 as the master both scenarios step from: its started server
    (graph mode), the graph, per-step RunOptions with spec["timeout_ms"]
    (else `timeout_ms`) and an event set when "stop" arrives."""
    tf.compat.v1.disable_eager_execution()
    server = tf.distribute.Server(
        tf.train.ClusterSpec({"worker": spec["cluster"]["worker"]}), job_name="worker",
        task_index=1, protocol=spec["protocol"], start=True)
    ready()
    graph, x, out = _graph(tf)
    options = tf.compat.v1.RunOptions(timeout_in_ms=spec.get("timeout_ms", timeout_ms))
    stop = threading.Event()

    def watch():
        _wait_line("stop")
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    return server, graph, x, out, options, stop


def tf1_steps_on_eager_task(spec, ready):
    """A TF1 master (worker 1) whose graph has a partition on the eager
    task (worker 0): x goes there, y = 2 x + 1 comes back, checked exactly
    every step. Prints STEPPING after `warm` good steps (the counters are
    reset then), steps until "stop", then `after` more steps. Each step
    runs with a `timeout_ms` deadline; a failed one is recorded."""
    import tensorflow as tf

    server, graph, x, out, options, stop = _master(spec, ready, tf, 10000)
    base = np.arange(N, dtype=np.float32)
    record = {"ok": 0, "wrong": 0, "failed": 0, "errors": [], "slowest": 0.0}

    def step(sess, i, rec):
        x_val = base + np.float32(i % 1000)
        t0 = time.monotonic()
        try:
            got = sess.run(out, {x: x_val}, options=options)
            if np.array_equal(got, x_val * np.float32(2.0) + np.float32(1.0)):
                rec["ok"] += 1
            else:
                rec["wrong"] += 1
        except tf.errors.OpError as e:  # a clean TF error: recorded (the first 20)
            rec["failed"] += 1
            if len(rec["errors"]) < 20:
                rec["errors"].append(f"{type(e).__name__}: {str(e)[:300]}")
        rec["slowest"] = max(rec["slowest"], time.monotonic() - t0)

    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        for i in range(spec.get("warm", 3)):
            sess.run(out, {x: base}, options=options)
        if spec["protocol"] != "grpc":
            import rdma_device

            rdma_device.reset_stats()
        _emit("STEPPING")
        i = 0
        while not stop.is_set():
            step(sess, i, record)
            i += 1
        after = {"ok": 0, "wrong": 0, "failed": 0, "errors": [], "slowest": 0.0}
        for j in range(spec.get("after", 20)):
            step(sess, i + j, after)
    return {"during": record, "after": after, "stats": _stats(spec)}


def tf1_stale_master(spec, ready):
    """A TF1 master (worker 1) stepping on worker 0's partition. Prints
    STEPPING after `warm` good steps (the counters are reset then) and
    FAILED at the first failed step (the test killed worker 0); then keeps
    stepping its old session (each step `timeout_ms`), recording every
    error (and any step that still succeeds), until "stop" (then prints
    STOPPED). On "resume" (worker 0 has a
    started server again) a new session runs `after` steps."""
    import tensorflow as tf

    server, graph, x, out, options, stop = _master(spec, ready, tf, 2000)
    base = np.arange(N, dtype=np.float32)
    errors, slowest, good = [], 0.0, 0
    # Never closed: closing waits for every step's CleanupGraph, which a
    # task that is down never answers (stock TF alike).
    stale = tf.compat.v1.Session(server.target, graph=graph)
    _KEPT.append(stale)
    for _ in range(spec.get("warm", 3)):
        stale.run(out, {x: base}, options=options)
    _emit("STEPPING")
    failed = False
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            stale.run(out, {x: base}, options=options)
            good += failed  # after worker 0 died: the stale session must fail
        except tf.errors.OpError as e:
            errors.append(f"{type(e).__name__}: {str(e)[:400]}")
            if not failed:
                failed = True
                _emit("FAILED")
            time.sleep(0.01)  # a stale session retried in a loop
        slowest = max(slowest, time.monotonic() - t0)
    _emit("STOPPED")
    _wait_line("resume")
    if spec["protocol"] != "grpc":
        import rdma_device

        rdma_device.reset_stats()
    after = {"ok": 0, "wrong": 0}
    graph, x, out = _graph(tf)
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        for i in range(spec.get("after", 20)):
            x_val = base + np.float32(i)
            got = sess.run(out, {x: x_val}, options=options)
            ok = np.array_equal(got, x_val * np.float32(2.0) + np.float32(1.0))
            after["ok" if ok else "wrong"] += 1
    return {"good_after_failed": good, "errors": errors, "slowest": slowest, "after": after,
            "stats": _stats(spec)}


def unstarted_servers(spec, ready):
    """Worker 0 restarted: `rounds` times, TF_NewServer (TensorFlow's C
    API: a server that "will not serve any requests until TF_ServerStart")
    for this task's address, held `hold_ms`, then TF_DeleteServer, which
    destroys a server never started (one started it refuses: ~GrpcServer
    CHECK-fails). The eager context does the same on its errors between
    creating a server and starting it (context_distributed_manager.cc).
    Prints DELETED after the last; on "start", starts a server for good."""
    import ctypes
    import os

    import tensorflow as tf
    from tensorflow.core.protobuf import tensorflow_server_pb2

    tf_dir = os.path.dirname(tf.__file__)
    cc = ctypes.CDLL(os.path.join(tf_dir, "libtensorflow_cc.so.2"))
    fw = ctypes.CDLL(os.path.join(tf_dir, "libtensorflow_framework.so.2"))
    fw.TF_NewStatus.restype = ctypes.c_void_p
    fw.TF_GetCode.argtypes = [ctypes.c_void_p]
    fw.TF_Message.argtypes = [ctypes.c_void_p]
    fw.TF_Message.restype = ctypes.c_char_p
    fw.TF_DeleteStatus.argtypes = [ctypes.c_void_p]
    cc.TF_NewServer.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p]
    cc.TF_NewServer.restype = ctypes.c_void_p
    cc.TF_DeleteServer.argtypes = [ctypes.c_void_p]

    cluster = tf.train.ClusterSpec({"worker": spec["cluster"]["worker"]})
    proto = tensorflow_server_pb2.ServerDef(
        cluster=cluster.as_cluster_def(), job_name="worker", task_index=0,
        protocol=spec["protocol"]).SerializeToString()
    ready()
    created, failures = 0, []
    for _ in range(spec.get("rounds", 40)):
        status = fw.TF_NewStatus()
        server = cc.TF_NewServer(proto, len(proto), status)
        if fw.TF_GetCode(status) != 0:
            failures.append(fw.TF_Message(status).decode())
        fw.TF_DeleteStatus(status)
        if server:
            created += 1
            time.sleep(spec.get("hold_ms", 150) / 1000)
            cc.TF_DeleteServer(server)
    _emit("DELETED")
    _wait_line("start")
    _KEPT.append(tf.distribute.Server(cluster, job_name="worker", task_index=0,
                                      protocol=spec["protocol"], start=True))
    return {"created": created, "failures": failures[:5]}
