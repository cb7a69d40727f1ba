"""Server start scenarios: a server whose peers' names resolve slowly
(test_route_pending.py, with slow_resolver/slow_resolver.c), and a server
whose transport cannot start (test_server_start.py).

Each runs in its own task process (task_main.py, role
"start_scenarios.<name>") and returns its result as a dict."""

import sys
import time

import numpy as np


def _server(spec, tf):
    t0 = time.monotonic()
    server = tf.distribute.Server(tf.train.ClusterSpec(spec["cluster"]), job_name=spec["job"],
                                  task_index=spec["task"], protocol=spec["protocol"], start=True)
    return server, time.monotonic() - t0


def _peers(spec):
    me = f"/job:{spec['job']}/replica:0/task:{spec['task']}"
    return sorted(f"/job:{job}/replica:0/task:{i}" for job, addrs in spec["cluster"].items()
                  for i in range(len(addrs)) if f"/job:{job}/replica:0/task:{i}" != me)


def timed_start(spec, ready):
    """Creates this task's server and times it; then waits (at most
    spec["routed_within_s"]) until the transport has chosen a route for
    every peer, and times that from creation too."""
    import tensorflow as tf

    import rdma_device

    t0 = time.monotonic()
    server, start_s = _server(spec, tf)
    ready()
    want = _peers(spec)
    deadline = t0 + spec["routed_within_s"]
    while True:
        routes = rdma_device.stats()["peers"]
        if all(p in routes for p in want) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    routed_s = time.monotonic() - t0
    del server
    return {"start_s": start_s, "routed_s": routed_s, "routes": routes, "want": want}


def step_at_once(spec, ready):
    """Creates this task's server and at once runs steps that read a
    variable held by /job:worker/task:1 (through this task's rendezvous,
    whose route to it may still be pending)."""
    import tensorflow as tf

    import rdma_device

    tf.compat.v1.disable_eager_execution()
    server, start_s = _server(spec, tf)
    ready()
    n = spec["elements"]
    with tf.Graph().as_default():
        with tf.device("/job:worker/task:1"):
            v = tf.Variable(np.arange(n, dtype=np.float32), name="held")
            grown = v.assign_add(tf.ones([n]))
        with tf.device("/job:worker/task:0"):
            out = grown * 2.0
        with tf.compat.v1.Session(server.target) as sess:
            sess.run(v.initializer)
            got = [sess.run(out).tolist() for _ in range(spec["steps"])]
    counters = rdma_device.stats()["counters"]
    return {"start_s": start_s, "values": got, "counters": counters}


def step_past_route_deadline(spec, ready):
    """Like step_at_once, but the route to /job:worker/task:1 stays pending
    longer than a transfer may wait for it: the first step must fail (how
    long it took and what TF raised are returned); once the route is
    chosen, the next step runs over the transport."""
    import tensorflow as tf

    import rdma_device

    tf.compat.v1.disable_eager_execution()
    server, start_s = _server(spec, tf)
    ready()
    n = spec["elements"]
    peer = "/job:worker/replica:0/task:1"
    out = {"start_s": start_s}
    with tf.Graph().as_default():
        with tf.device("/job:worker/task:1"):
            v = tf.Variable(np.arange(n, dtype=np.float32), name="held")
            grown = v.assign_add(tf.ones([n]))
        with tf.device("/job:worker/task:0"):
            doubled = grown * 2.0
        with tf.compat.v1.Session(server.target) as sess:
            print("PHASE session", file=sys.stderr, flush=True)
            sess.run(v.initializer)
            print("PHASE initialized", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            try:
                sess.run(doubled)
                out["first"] = "no error"
            except tf.errors.OpError as e:
                out["first"] = f"{type(e).__name__}: {e.message[:400]}"
            out["first_s"] = time.monotonic() - t0
            deadline = time.monotonic() + spec["routed_within_s"]
            while peer not in rdma_device.stats()["peers"] and time.monotonic() < deadline:
                time.sleep(0.05)
            out["route"] = rdma_device.stats()["peers"].get(peer)
            before = rdma_device.stats()["counters"]["tensors_received"]
            out["second"] = sess.run(doubled)[:4].tolist()
            out["received"] = rdma_device.stats()["counters"]["tensors_received"] - before
    return out


def bad_setting_then_good(spec, ready):
    """Creates this task's server with a bad RDMA_DEVICE_* setting (the
    transport cannot start), then again at the same address with the
    setting fixed, and runs a step on it through its own master."""
    import os

    import tensorflow as tf

    import rdma_device

    tf.compat.v1.disable_eager_execution()
    ready()
    os.environ[spec["bad_var"]] = spec["bad_value"]
    try:
        _server(spec, tf)
        first = None
    except Exception as e:  # the test checks it
        first = f"{type(e).__name__}: {e}"
    del os.environ[spec["bad_var"]]
    server, _ = _server(spec, tf)
    with tf.Graph().as_default():
        with tf.device(f"/job:{spec['job']}/task:{spec['task']}"):
            out = tf.range(8, dtype=tf.int64) * 3
        # Only this task: its peer is never started (TF's master would wait for it).
        config = tf.compat.v1.ConfigProto(device_filters=[f"/job:{spec['job']}/task:{spec['task']}"])
        with tf.compat.v1.Session(server.target, config=config) as sess:
            got = sess.run(out).tolist()
    return {"first": first, "values": got, "peers": rdma_device.stats()["peers"]}
