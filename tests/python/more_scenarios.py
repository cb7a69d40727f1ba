"""More client scenarios (task_main role "more_scenarios.<name>"): Keras
under ParameterServerStrategy, a ps killed under ParameterServerStrategy,
and an in-process cluster (tf.test.create_local_cluster)."""

import json
import sys

import numpy as np

from scenarios import Digest, _stats


def _pss(spec, tf):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec["cluster"]), task_type="chief", task_id=0,
        rpc_layer=spec["protocol"])
    return tf.distribute.experimental.ParameterServerStrategy(resolver)


def pss_fit_data():
    """The regression `keras_pss_fit` learns: y a linear function of x."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 32)).astype(np.float32)
    y = (x @ rng.standard_normal((32, 1)).astype(np.float32)).astype(np.float32)
    return x, y


def keras_pss_fit(spec, ready):
    """tf_keras `model.fit` under ParameterServerStrategy (the workers run
    the steps asynchronously, so only the shape of the result is compared
    across protocols, not its bits)."""
    import tensorflow as tf
    import tf_keras as keras

    strategy = _pss(spec, tf)
    ready()
    x, y = pss_fit_data()

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)

    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Dense(64, activation="relu", input_shape=(32,)),
            keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    history = model.fit(keras.utils.experimental.DatasetCreator(dataset_fn),
                        epochs=spec.get("epochs", 3), steps_per_epoch=spec.get("steps", 20),
                        verbose=0)
    return {"loss": [float(v) for v in history.history["loss"]],
            "weights": len(model.get_weights()), "stats": _stats(spec)}


def pss_until_ps_killed(spec, ready):
    """Trains under ParameterServerStrategy, printing STEP n, until the test
    kills the ps; reports how TF's ClusterCoordinator classified the error."""
    import tensorflow as tf
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc

    strategy = _pss(spec, tf)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    ready()
    with strategy.scope():
        w = tf.Variable(np.full((64, 64), 0.01, np.float32), name="w")

    @tf.function
    def step_fn():
        h = tf.matmul(w, w)
        w.assign_sub(1e-4 * h)
        return tf.reduce_sum(h)

    step = 0
    try:
        while True:
            coordinator.schedule(step_fn).fetch()
            step += 1
            sys.stdout.write(f"STEP {json.dumps(step)}\n")
            sys.stdout.flush()
    except Exception as e:  # what the coordinator raised to the user
        return {"steps": step, "type": type(e).__name__,
                "is_ps_failure": bool(cc._is_ps_failure(e)),
                "is_worker_failure": bool(cc._is_worker_failure(e)),
                "message": str(e)[:1500]}


def local_cluster(spec, ready):
    """Three servers in this one process (tf.test.create_local_cluster):
    ROUNDS sessions, each a new graph, variables on the ps, compute on
    worker 1, the client on worker 0."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    workers, _ = tf.test.create_local_cluster(2, 1, protocol=spec["protocol"])
    ready()
    digest = Digest()
    options = tf.compat.v1.RunOptions(timeout_in_ms=60000)
    for rnd in range(spec.get("rounds", 10)):
        graph = tf.Graph()
        with graph.as_default():
            with tf.device("/job:ps/task:0"):
                w = tf.compat.v1.get_variable(
                    f"w{rnd}", initializer=np.full((48, 48), 0.02, np.float32))
            with tf.device("/job:worker/task:1"):
                loss = tf.reduce_mean(tf.square(tf.matmul(w, w)))
                (g,) = tf.gradients(loss, [w])
            with tf.device("/job:ps/task:0"):
                train = w.assign_sub(0.1 * g)
            init = tf.compat.v1.variables_initializer([w])
        with tf.compat.v1.Session(workers[0].target, graph=graph) as sess:
            sess.run(init, options=options)
            for _ in range(5):
                digest.add(sess.run([loss, train], options=options)[0])
            digest.add(sess.run(w, options=options))
    return {"digest": digest.hexdigest(), "stats": _stats(spec)}


def servers_in_one_process(spec, ready):
    """Every task of spec["cluster"] as a server in this one process (a
    reference run that imports TensorFlow once); then the replicas.py
    workload spec["workload"] on every worker's server at once, each worker
    in its own thread with its own session, as the worker processes do.
    Returns their digests, by worker."""
    import threading

    import tensorflow as tf

    import replicas

    cluster = spec["cluster"]
    servers = {(job, i): tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job,
                                              task_index=i, protocol=spec["protocol"], start=True)
               for job in cluster for i in range(len(cluster[job]))}
    ready()
    n = len(cluster["worker"])
    replies = [None] * n

    def run(i):
        try:
            replies[i] = getattr(replicas, spec["workload"])(
                servers[("worker", i)], dict(spec, job="worker", task=i), spec["args"])
        except Exception as e:  # the test reports it
            replies[i] = {"error": f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"replies": replies}


def eager_cancel(spec, ready):
    """A tf.function across tasks cancelled while its receive waits (the
    way ClusterCoordinator cancels closures): the worker's receive of a
    value the ps has not produced yet (a dequeue from an empty queue) is
    cancelled after 1 s; the call must fail with CancelledError soon after,
    and the next call must run and return the right value."""
    import threading
    import time

    import tensorflow as tf
    from tensorflow.python.eager import cancellation

    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec(spec["cluster"]), job_name="chief", task_index=0,
        protocol=spec["protocol"])
    ready()
    ps, worker = "/job:ps/replica:0/task:0", "/job:worker/replica:0/task:0"
    with tf.device(ps):
        q = tf.queue.FIFOQueue(8, tf.float32, shapes=[[1024]])

    @tf.function
    def consume():
        with tf.device(ps):
            v = q.dequeue()
        with tf.device(worker):
            return tf.reduce_sum(v * 2.0)

    cm = cancellation.CancellationManager()
    cancelable = cm.get_cancelable_function(consume.get_concrete_function())
    timer = threading.Timer(1.0, cm.start_cancel)
    t0 = time.monotonic()
    timer.start()
    error = None
    try:
        cancelable()
    except Exception as e:  # noqa: BLE001 (the type is the result)
        error = type(e).__name__
    cancelled_after = time.monotonic() - t0
    timer.join()
    # The cancelled call's dequeue may still be waiting on the ps (TF does
    # not cancel a remote component's ops): feed it and the next call.
    with tf.device(ps):
        q.enqueue(tf.fill([1024], 1.5))
        q.enqueue(tf.fill([1024], 1.5))
    t1 = time.monotonic()
    value = float(consume())
    return {"error": error, "cancelled_after": cancelled_after, "value": value,
            "next_call_s": time.monotonic() - t1, "stats": _stats(spec)}


def eager_errors(spec, ready):
    """Cross-task work after a failed op, the way an eager user meets it:
    a tf.function whose op on the worker fails (check_numerics of a tensor
    made on the ps from the call's argument), then the same function on
    good data; and an op-by-op failure on the worker, then op-by-op copies
    between the tasks. (The value comes in as an argument: a variable
    assigned between calls is not ordered before a remote function's read
    of it, under stock gRPC too.)"""
    import tensorflow as tf

    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec(spec["cluster"]), job_name="chief", task_index=0,
        protocol=spec["protocol"])
    ready()
    ps, worker = "/job:ps/replica:0/task:0", "/job:worker/replica:0/task:0"

    @tf.function
    def checked_sum(s):
        with tf.device(ps):
            x = tf.fill([4096], s) * 2.0
        with tf.device(worker):
            return tf.reduce_sum(tf.debugging.check_numerics(x, "bad value"))

    out = {"values": [], "errors": []}
    out["values"].append(float(checked_sum(tf.constant(1.0))))
    for i in range(3):
        try:
            got = float(checked_sum(tf.constant(float("nan"))))
            out["errors"].append(f"no error: {got}")
        except tf.errors.OpError as e:
            out["errors"].append(type(e).__name__)
        out["values"].append(float(checked_sum(tf.constant(float(i + 2)))))
    # Op by op: a failure on the worker, then copies both ways.
    with tf.device(worker):
        try:
            tf.debugging.check_numerics(tf.constant([float("nan")]), "bad value").numpy()
            out["errors"].append("no error")
        except tf.errors.OpError as e:
            out["errors"].append(type(e).__name__)
        w = tf.fill([4096], 3.0) + 1.0
    with tf.device(ps):
        back = tf.reduce_sum(w)
    out["values"].append(float(back.numpy()))
    out["stats"] = _stats(spec)
    return out


def eager_two_components(spec, ready):
    """A tf.function with two components on the worker (its CPU:0 and
    CPU:1), each receiving from another task: the call's argument from
    this client on CPU:0, a tensor of the ps on CPU:1. TensorFlow runs
    each component as its own call on the worker, and when one finishes
    before the other starts, the second makes the step's rendezvous anew.
    Called `calls` times; returns the values or the error of each call."""
    import tensorflow as tf

    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec(spec["cluster"]), job_name="chief", task_index=0,
        protocol=spec["protocol"])
    ready()
    ps = "/job:ps/replica:0/task:0"
    w0, w1 = "/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:1"

    @tf.function
    def two_components(s):
        with tf.device(w0):
            x = tf.reduce_sum(tf.fill([16], s))
        with tf.device(ps):
            b = tf.fill([4096], s) * 3.0
        with tf.device(w1):
            y = tf.reduce_sum(b)
        return x + y

    out = []
    for i in range(spec["calls"]):
        try:
            out.append(float(two_components(tf.constant(float(i + 1)))))
        except tf.errors.OpError as e:
            out.append(f"{type(e).__name__}: {e.message[:400]}")
    return {"results": out, "devices": [d.name for d in tf.config.list_logical_devices()],
            "stats": _stats(spec)}


def functions_on_two_threads(spec, ready):
    """Two tf.functions across tasks (ps -> worker -> here), each called
    for the first time, so instantiated, on its own thread: `on_main` on
    the process's main thread, `on_other` on a thread of this process's
    own. Returns their values and this task's counters after each."""
    import threading

    import tensorflow as tf

    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec(spec["cluster"]), job_name="chief", task_index=0,
        protocol=spec["protocol"])
    ready()
    ps, worker = "/job:ps/replica:0/task:0", "/job:worker/replica:0/task:0"

    def across(scale, name):
        # `name` names the tensor the ps sends, so each function has an
        # edge (a rendezvous key) of its own to place.
        def f(s):
            with tf.device(ps):
                a = tf.multiply(tf.fill([4096], s), scale, name=name)
            with tf.device(worker):
                return tf.reduce_sum(a)
        return f

    on_main = tf.function(across(2.0, "from_main"))
    on_other = tf.function(across(3.0, "from_other"))
    out = {"main": float(on_main(tf.constant(1.0)))}
    box = {}
    t = threading.Thread(target=lambda: box.update(other=float(on_other(tf.constant(1.0)))),
                         name="user-thread")
    t.start()
    t.join(60)
    out["other"] = box.get("other")
    out["stats"] = _stats(spec)
    return out
