"""Client scenarios for test_step_aborts.py (task_main role
"abort_scenarios.<name>"): normal steps across tasks, then one that fails on
one task, pausing between phases (``PAUSED <json>``, then a line on stdin)
so the test can read every task's counters.

The cluster has jobs chief (this client), worker and ps.
"""

import json
import sys
import time

from scenarios import CHIEF, PS, WORKER, _start_chief_server, _stats

# How long a phase waits for this task's own cleanups to be counted.
SETTLE_S = 10.0


def _say(prefix, payload):
    sys.stdout.write(f"{prefix} {json.dumps(payload)}\n")
    sys.stdout.flush()


def _pause(payload):
    """Prints PAUSED, answers the "stats" command (harness.Task.stats)
    with this task's counters, goes on at any other line."""
    _say("PAUSED", payload)
    for line in sys.stdin:
        if '"stats"' not in line:
            return
        _say("REPLY", _all_stats())


def _all_stats():
    import rdma_device

    return rdma_device.stats()


def _counters():
    return _all_stats()["counters"]


def _wait_ended(at_least):
    """Waits until TF's cleanups of this task's steps reach `at_least`
    (the master's cleanup of its own partitions runs after its step
    returned); returns the counters then."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        c = _counters()
        if c["steps_ended"] >= at_least or time.monotonic() > deadline:
            return c
        time.sleep(0.02)


def _checked_on_the_ps(tf):
    """The chief feeds s to the ps, which checks it (s > 0) and sends w * s
    to the worker, whose sum comes back: (graph, s, the sum, init)."""
    g = tf.Graph()
    with g.as_default():
        with tf.device(CHIEF):
            s = tf.compat.v1.placeholder(tf.float32, [], name="s")
        with tf.device(PS):
            w = tf.Variable(tf.random.stateless_uniform([4096], seed=[1, 2]), name="w")
            check = tf.debugging.assert_positive(s, message="s must be positive")
            with tf.control_dependencies([check]):
                x = w.value() * s                                  # chief -> ps -> worker
        with tf.device(WORKER):
            y = tf.reduce_sum(tf.tanh(x))                          # worker -> chief
        init = tf.compat.v1.global_variables_initializer()
    return g, s, y, init


def tf1_steps_then_a_failure(spec, ready):
    """TF1: the chief feeds s to the ps, which checks it (s > 0) and sends
    w * s to the worker, which sends a sum back. Phases: `steps` normal
    steps; one step with s = -1 (the ps's assertion fails); `steps` more."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = _start_chief_server(spec, tf)
    ready()
    steps = spec["steps"]
    g, s, y, init = _checked_on_the_ps(tf)

    with tf.compat.v1.Session(server.target, graph=g) as sess:
        sess.run(init)
        sess.run(y, {s: 1.0})  # registers the partitions; connects the tasks
        base = _wait_ended(0)
        _pause({"phase": "warm", "counters": base})

        values = [float(sess.run(y, {s: 1.0 + i})) for i in range(steps)]
        c = _wait_ended(base["steps_ended"] + steps)
        _pause({"phase": "normal", "counters": c, "values": values})

        t0 = time.monotonic()
        error = None
        try:
            sess.run(y, {s: -1.0})
        except tf.errors.OpError as e:
            error = {"type": type(e).__name__, "message": e.message[:2000]}
        took = time.monotonic() - t0
        c = _wait_ended(c["steps_ended"] + 1)
        _pause({"phase": "failed", "counters": c, "error": error, "took": took})

        after = [float(sess.run(y, {s: 1.0 + i})) for i in range(steps)]
        c = _wait_ended(c["steps_ended"] + steps)
        _pause({"phase": "after", "counters": c, "values": after})
    return {"values": values, "after": after, "stats": _stats(spec)}


def eager_calls_then_a_failure(spec, ready):
    """Eager: a tf.function across tasks (ps -> worker -> here) and op-by-op
    copies between the tasks (the eager context's own step). Phases:
    `calls` good calls and copies; one call whose op on the worker fails
    (check_numerics of a NaN from the ps) and one op-by-op failure on the
    worker; one call cancelled while it waits; `calls` good calls again."""
    import threading

    import tensorflow as tf
    from tensorflow.python.eager import cancellation

    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec(spec["cluster"]), job_name="chief", task_index=0,
        protocol=spec["protocol"])
    ready()
    calls = spec["calls"]

    @tf.function
    def checked_sum(v):
        with tf.device(PS):
            x = tf.fill([4096], v) * 2.0
        with tf.device(WORKER):
            return tf.reduce_sum(tf.debugging.check_numerics(x, "bad value"))

    def copies(v):
        with tf.device(PS):
            a = tf.fill([4096], v)
        with tf.device(WORKER):
            b = a + 1.0
        with tf.device(PS):
            return float(tf.reduce_sum(b).numpy())

    def good(n, first):
        return [(float(checked_sum(tf.constant(first + i))), copies(first + i)) for i in range(n)]

    good(1, 1.0)
    _pause({"phase": "warm", "counters": _counters()})
    values = good(calls, 1.0)
    _pause({"phase": "normal", "counters": _counters(), "values": values})

    errors = []
    t0 = time.monotonic()
    try:
        checked_sum(tf.constant(float("nan"))).numpy()
        errors.append("no error")
    except tf.errors.OpError as e:
        errors.append(type(e).__name__)
    took = time.monotonic() - t0
    with tf.device(WORKER):
        try:
            tf.debugging.check_numerics(tf.constant([float("nan")]), "bad value").numpy()
            errors.append("no error")
        except tf.errors.OpError as e:
            errors.append(type(e).__name__)
    # The failed op left the client's executor in error (TF's eager
    # semantics, stock gRPC alike): later ops would fail with it.
    tf.experimental.async_clear_error()
    _pause({"phase": "failed", "counters": _counters(), "errors": errors, "took": took})

    # A call cancelled while the worker waits on the ps, whose part waits
    # on an empty queue (how ClusterCoordinator cancels closures): TF
    # cancels both parts.
    with tf.device(PS):
        q = tf.queue.FIFOQueue(8, tf.float32, shapes=[[4096]])

    @tf.function
    def consume():
        with tf.device(PS):
            v = q.dequeue()
        with tf.device(WORKER):
            return tf.reduce_sum(v * 2.0)

    cm = cancellation.CancellationManager()
    cancelable = cm.get_cancelable_function(consume.get_concrete_function())
    timer = threading.Timer(1.0, cm.start_cancel)
    timer.start()
    try:
        cancelable()
        cancelled = "no error"
    except tf.errors.OpError as e:
        cancelled = type(e).__name__
    timer.join()
    _pause({"phase": "cancelled", "counters": _counters(), "error": cancelled})
    # A value for the next call (and one for the cancelled call's dequeue,
    # should it still wait).
    with tf.device(PS):
        q.enqueue(tf.fill([4096], 1.5))
        q.enqueue(tf.fill([4096], 1.5))
    value = float(consume())

    after = good(calls, 10.0)
    _pause({"phase": "after", "counters": _counters(), "values": after, "value": value})
    return {"values": values, "after": after, "stats": _stats(spec)}


def tf1_failing_steps(spec, ready):
    """TF1 over three tasks: the chief feeds s to the ps, which checks it
    (s > 0) and sends w * s to the worker, whose sum comes back. After one
    good step, spec["failures"] steps with s = -1: each step's error class
    as the client sees it (the ps's assertion fails while the worker
    waits on the ps's tensor), then one good step again."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = _start_chief_server(spec, tf)
    ready()
    g, s, y, init = _checked_on_the_ps(tf)
    errors = []
    with tf.compat.v1.Session(server.target, graph=g) as sess:
        sess.run(init)
        first = float(sess.run(y, {s: 1.0}))
        for _ in range(spec["failures"]):
            try:
                sess.run(y, {s: -1.0})
                errors.append(None)
            except tf.errors.OpError as e:
                errors.append([type(e).__name__, "s must be positive" in e.message])
        last = float(sess.run(y, {s: 1.0}))
    return {"errors": errors, "values": [first, last], "stats": _stats(spec)}
