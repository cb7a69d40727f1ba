"""Scenarios for test_route_pending.py: a server whose peers' names resolve
slowly (slow_resolver/slow_resolver.c), timed from creation.

Each runs in its own task process (task_main.py, role
"route_scenarios.<name>") and returns its result as a dict."""

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
