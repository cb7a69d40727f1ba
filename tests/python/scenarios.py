"""Client scenarios run inside a task subprocess (see task_main.py).

Every scenario trains a small model whose tensors cross task boundaries in
float32, float16, int64, bool and string, with a batch size that changes
between steps and a cond whose untaken branch sends dead tensors across
tasks. It returns a digest of everything it fetched so that runs under
"grpc" and "grpc+rdma_device" can be compared bit for bit.

The cluster has jobs chief (this client), worker and ps.
"""

import hashlib

import numpy as np

CHIEF = "/job:chief/replica:0/task:0"
WORKER = "/job:worker/replica:0/task:0"
PS = "/job:ps/replica:0/task:0"


def batch(step):
    """Deterministic input whose batch size changes from step to step."""
    rows = 1 + (step * 5) % 9
    rng = np.random.default_rng(step)
    return rng.standard_normal((rows, 16)).astype(np.float32)


def initial_values():
    rng = np.random.default_rng(1234)
    return (rng.standard_normal((16, 4)).astype(np.float32) * 0.1,
            (rng.standard_normal(4) * 0.1).astype(np.float16))


class Digest:
    def __init__(self):
        self._h = hashlib.sha256()
        self.items = 0

    def add(self, value):
        a = np.asarray(value)
        if a.dtype == object:
            data = b"\0".join(x if isinstance(x, bytes) else str(x).encode() for x in a.ravel())
        else:
            data = a.tobytes()
        self._h.update(str((a.dtype.str, a.shape)).encode())
        self._h.update(data)
        self.items += 1

    def hexdigest(self):
        return self._h.hexdigest()


def _start_chief_server(spec, tf):
    return tf.distribute.Server(
        tf.train.ClusterSpec(spec["cluster"]), job_name="chief", task_index=0,
        protocol=spec["protocol"], start=True)


def _stats(spec):
    if spec["protocol"] == "grpc":
        return None
    import rdma_device

    return rdma_device.stats()


def tf1_train(spec, ready):
    """TF1 graph + tf.compat.v1.Session(server.target)."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.disable_control_flow_v2()
    server = _start_chief_server(spec, tf)
    ready()
    steps = spec.get("steps", 50)
    w0, b0 = initial_values()
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS):
            w = tf.compat.v1.get_variable("w", initializer=w0)
            b16 = tf.compat.v1.get_variable("b16", initializer=b0)
            seen = tf.compat.v1.get_variable("seen", initializer=np.int64(0))
        with tf.device(CHIEF):
            x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
            pred = tf.compat.v1.placeholder(tf.bool, [], name="pred")
        with tf.device(WORKER):
            h = tf.matmul(x, w)                                   # f32 chief,ps -> worker
            h16 = tf.cast(h, tf.float16) + b16                    # f16 ps -> worker
            mask = h16 > 0                                        # bool
            ids = tf.argmax(h, axis=1, output_type=tf.int64)      # int64
            names = tf.strings.as_string(ids)                     # string
        with tf.device(CHIEF):
            # Branches on the worker, Merge on the chief: the untaken
            # branch's output crosses to the chief as a dead tensor.
            def taken():
                with tf.device(WORKER):
                    return tf.reduce_sum(h) * 2.0

            def untaken():
                with tf.device(WORKER):
                    return tf.reduce_sum(h) - 1.0

            branch = tf.compat.v1.cond(pred, taken, untaken)
            mask_f = tf.reduce_mean(tf.cast(mask, tf.float32))    # bool worker -> chief
            joined = tf.strings.reduce_join(names, separator=",")  # string worker -> chief
            ids_sum = tf.reduce_sum(ids)                          # int64 worker -> chief
            loss = (tf.reduce_mean(tf.square(tf.cast(h16, tf.float32)))
                    + 1e-3 * branch)
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.05)
        train = opt.minimize(loss, colocate_gradients_with_ops=True)
        with tf.device(PS):
            with tf.control_dependencies([train]):
                count = seen.assign_add(tf.cast(tf.shape(x)[0], tf.int64))
        init = tf.compat.v1.global_variables_initializer()

    digest = Digest()
    losses = []
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        sess.run(init)
        for step in range(steps):
            out = sess.run([loss, mask_f, joined, ids_sum, branch, count],
                           {x: batch(step), pred: step % 3 != 0})
            for v in out:
                digest.add(v)
            losses.append(float(out[0]))
        wv, bv, sv = sess.run([w, b16, seen])
        for v in (wv, bv, sv):
            digest.add(v)
    return {"digest": digest.hexdigest(), "items": digest.items,
            "losses": losses, "seen": int(sv), "stats": _stats(spec)}


def _connect_eager(spec, tf):
    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec(spec["cluster"]), job_name="chief", task_index=0,
        protocol=spec["protocol"])


def _eager_model(tf):
    w0, b0 = initial_values()
    with tf.device(PS):
        w = tf.Variable(w0, name="w")
        b16 = tf.Variable(b0, name="b16")
        seen = tf.Variable(np.int64(0), name="seen")
    return w, b16, seen


def _eager_step(tf, w, b16, seen, x, pred):
    """One training step; device scopes put every dtype across tasks."""
    with tf.GradientTape() as tape:
        with tf.device(WORKER):
            h = tf.matmul(x, w)
            h16 = tf.cast(h, tf.float16) + b16
            mask = h16 > 0
            ids = tf.argmax(h, axis=1, output_type=tf.int64)
            names = tf.strings.as_string(ids)

            def taken():
                return tf.reduce_sum(h) * 2.0

            def untaken():
                return tf.reduce_sum(h) - 1.0

        with tf.device(CHIEF):
            branch = tf.cond(pred, taken, untaken)
            mask_f = tf.reduce_mean(tf.cast(mask, tf.float32))
            joined = tf.strings.reduce_join(names, separator=",")
            ids_sum = tf.reduce_sum(ids)
            loss = (tf.reduce_mean(tf.square(tf.cast(h16, tf.float32)))
                    + 1e-3 * branch)
    gw, gb = tape.gradient(loss, [w, b16])
    with tf.device(PS):
        w.assign_sub(0.05 * gw)
        b16.assign_sub(tf.cast(0.05, tf.float16) * gb)
        seen.assign_add(tf.cast(tf.shape(x)[0], tf.int64))
    return loss, mask_f, joined, ids_sum, branch


def _train_loop(tf, step_fn, steps, w, b16, seen, remote_input):
    digest = Digest()
    losses = []
    for step in range(steps):
        if remote_input:
            with tf.device(WORKER):  # produced on the worker: no client->remote copy
                x = tf.constant(batch(step))
        else:
            x = tf.constant(batch(step))
        out = step_fn(x, tf.constant(step % 3 != 0))
        values = [t.numpy() for t in out]
        for v in values:
            digest.add(v)
        losses.append(float(values[0]))
    for v in (w, b16, seen):
        digest.add(v.numpy())
    return {"digest": digest.hexdigest(), "items": digest.items,
            "losses": losses, "seen": int(seen.numpy())}


def eager_train(spec, ready):
    """Op-by-op eager execution over connect_to_cluster(protocol=...)."""
    import tensorflow as tf

    _connect_eager(spec, tf)
    ready()
    w, b16, seen = _eager_model(tf)

    def step_fn(x, pred):
        return _eager_step(tf, w, b16, seen, x, pred)

    result = _train_loop(tf, step_fn, spec.get("steps", 50), w, b16, seen, False)
    result["stats"] = _stats(spec)
    return result


def function_train(spec, ready):
    """A tf.function whose ops span chief, worker and ps."""
    import tensorflow as tf

    _connect_eager(spec, tf)
    ready()
    w, b16, seen = _eager_model(tf)

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32),
                                  tf.TensorSpec([], tf.bool)])
    def step_fn(x, pred):
        return _eager_step(tf, w, b16, seen, x, pred)

    result = _train_loop(tf, step_fn, spec.get("steps", 50), w, b16, seen, False)
    result["stats"] = _stats(spec)
    return result


def pss_train(spec, ready):
    """ParameterServerStrategy + ClusterCoordinator (rpc_layer = protocol)."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec["cluster"]), task_type="chief", task_id=0,
        rpc_layer=spec["protocol"])
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    ready()
    w0, b0 = initial_values()
    with strategy.scope():
        w = tf.Variable(w0, name="w")
        b16 = tf.Variable(b0, name="b16")
        seen = tf.Variable(np.int64(0), name="seen")

    @tf.function
    def step_fn(step):
        rows = 1 + (step * 5) % 9
        x = tf.random.stateless_normal(tf.stack([rows, 16]), seed=tf.stack([step, 7]))
        pred = step % 3 != 0
        with tf.GradientTape() as tape:
            h = tf.matmul(x, w)
            h16 = tf.cast(h, tf.float16) + b16
            mask = h16 > 0
            ids = tf.argmax(h, axis=1, output_type=tf.int64)
            names = tf.strings.as_string(ids)
            branch = tf.cond(pred, lambda: tf.reduce_sum(h) * 2.0,
                             lambda: tf.reduce_sum(h) - 1.0)
            loss = (tf.reduce_mean(tf.square(tf.cast(h16, tf.float32)))
                    + 1e-3 * branch)
        gw, gb = tape.gradient(loss, [w, b16])
        w.assign_sub(0.05 * gw)
        b16.assign_sub(tf.cast(0.05, tf.float16) * gb)
        seen.assign_add(tf.cast(rows, tf.int64))
        return (loss, tf.reduce_mean(tf.cast(mask, tf.float32)),
                tf.strings.reduce_join(names, separator=","), tf.reduce_sum(ids),
                branch)

    digest = Digest()
    losses = []
    for step in range(spec.get("steps", 50)):
        remote = coordinator.schedule(step_fn, args=(tf.constant(step, tf.int64),))
        values = [np.asarray(v) for v in remote.fetch()]
        for v in values:
            digest.add(v)
        losses.append(float(values[0]))
    coordinator.join()
    for v in (w, b16, seen):
        digest.add(v.numpy())
    return {"digest": digest.hexdigest(), "items": digest.items, "losses": losses,
            "seen": int(seen.numpy()), "stats": _stats(spec)}


def tf1_until_killed(spec, ready):
    """Trains until a peer dies, reports the error, then recovers.

    Prints ``STEP n`` after each good step and ``FAILED {...}`` when a step
    fails. Then it keeps opening fresh sessions (polling every 0.25 s: the
    killed task is being restarted by the test) until one trains
    `recover_steps` steps from a fresh initialisation, or until
    `recover_deadline_s` has passed. Returns the losses of the first
    session's first steps and of the recovered session's (the same graph
    from the same initial value: they must be bit-identical) and when the
    recovered session's first step completed.
    """
    import json
    import sys
    import time

    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = _start_chief_server(spec, tf)
    ready()
    recover_steps = spec.get("recover_steps", 10)

    def build():
        graph = tf.Graph()
        with graph.as_default():
            with tf.device(PS):
                w = tf.compat.v1.get_variable(
                    "w", initializer=np.full((256, 256), 0.01, np.float32))
            with tf.device(WORKER):
                h = tf.matmul(w, w)
            with tf.device(CHIEF):
                loss = tf.reduce_mean(h)
            with tf.device(PS):
                train = w.assign_sub(1e-3 * tf.fill(tf.shape(w), loss))
            init = tf.compat.v1.global_variables_initializer()
        return graph, init, loss, train

    def emit(prefix, payload):
        sys.stdout.write(f"{prefix} {json.dumps(payload)}\n")
        sys.stdout.flush()

    graph, init, loss, train = build()
    options = tf.compat.v1.RunOptions(timeout_in_ms=20000)
    step = 0
    first_losses = []
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        sess.run(init)
        try:
            while True:
                value = sess.run([loss, train], options=options)[0]
                if len(first_losses) < recover_steps:
                    first_losses.append(float(value))
                step += 1
                emit("STEP", step)
        except tf.errors.OpError as e:
            emit("FAILED", {"type": type(e).__name__, "message": str(e)[:2000],
                            "time": time.time()})

    attempts = 0
    deadline = time.time() + spec.get("recover_deadline_s", 120)
    while True:
        attempts += 1
        try:
            graph, init, loss, train = build()
            with tf.compat.v1.Session(server.target, graph=graph) as sess:
                sess.run(init, options=options)
                losses = []
                for _ in range(recover_steps):
                    losses.append(float(sess.run([loss, train], options=options)[0]))
                    if len(losses) == 1:
                        first_step_at = time.time()
            return {"attempts": attempts, "first_losses": first_losses, "recovered_losses": losses,
                    "recovered_at": first_step_at, "stats": _stats(spec)}
        except tf.errors.OpError as e:
            if time.time() > deadline:
                return {"error": f"{type(e).__name__}: {e}", "attempts": attempts}
            time.sleep(0.25)  # polling for the restarted task


def tf1_timeout(spec, ready):
    """A step whose receive never gets its tensor times out (cancellation
    reaches the pending receive); the session keeps working afterwards."""
    import time

    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = _start_chief_server(spec, tf)
    ready()
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(WORKER):
            queue = tf.queue.FIFOQueue(10, tf.float32, shapes=[[4]], shared_name="q")
            enqueue = queue.enqueue(tf.fill([4], 3.0))
            dequeued = queue.dequeue() * 2.0
            ones = tf.ones([4]) * 5.0
        with tf.device(CHIEF):
            blocked = dequeued + 1.0   # waits on a receive from the worker
            fine = ones + 1.0
    out = {}
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        start = time.time()
        try:
            sess.run(blocked, options=tf.compat.v1.RunOptions(timeout_in_ms=1500))
            out["timeout_error"] = None
        except tf.errors.OpError as e:
            out["timeout_error"] = type(e).__name__
        out["timeout_s"] = time.time() - start
        out["after"] = sess.run(fine).tolist()
        # The cancelled step's dequeue may still take one element.
        sess.run(enqueue)
        sess.run(enqueue)
        out["unblocked"] = sess.run(blocked).tolist()
    out["stats"] = _stats(spec)
    return out


def _task_of(device):
    return device.split("/device:")[0]


def cross_task_edges(partition_graphs):
    """Distinct rendezvous keys of the tensors one task sends another in
    these partition graphs (fetches to the client excluded)."""
    keys = set()
    for graph in partition_graphs:
        for node in graph.node:
            if node.op not in ("_Send", "_HostSend"):
                continue
            attr = node.attr
            if attr["client_terminated"].b:
                continue
            src, dst = attr["send_device"].s.decode(), attr["recv_device"].s.decode()
            if _task_of(src) != _task_of(dst):
                keys.add((src, attr["send_device_incarnation"].i, dst, attr["tensor_name"].s.decode()))
    return keys


def _pause(spec, payload):
    """With spec["pause"]: prints ``PAUSED <json>`` and waits for one line on
    stdin, so the test can read every task's counters at this point."""
    if not spec.get("pause"):
        return
    import json
    import sys

    sys.stdout.write(f"PAUSED {json.dumps(payload)}\n")
    sys.stdout.flush()
    sys.stdin.readline()


def tf1_static(spec, ready):
    """A TF1 training graph whose cross-task tensors all have static shapes
    (no feeds): f32, f16, int64, bool, and dead tensors from a cond. Pauses
    after the first training step (spec["pause"]) for the counters."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.disable_control_flow_v2()
    server = _start_chief_server(spec, tf)
    ready()
    w0, b0 = initial_values()
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS):
            w = tf.compat.v1.get_variable("w", initializer=w0)
            b16 = tf.compat.v1.get_variable("b16", initializer=b0)
            seen = tf.compat.v1.get_variable("seen", initializer=np.int64(0))
        with tf.device(WORKER):
            x = tf.constant(batch(3))                             # fixed [7, 16]
            h = tf.matmul(x, w)                                   # f32 ps -> worker
            h16 = tf.cast(h, tf.float16) + b16                    # f16 ps -> worker
            mask = h16 > 0
            ids = tf.argmax(h, axis=1, output_type=tf.int64)
        with tf.device(CHIEF):
            pred = tf.equal(tf.math.floormod(seen, 3), 0)        # int64 ps -> chief

            def taken():
                with tf.device(WORKER):
                    return tf.reduce_sum(h) * 2.0

            def untaken():
                with tf.device(WORKER):
                    return tf.reduce_sum(h) - 1.0

            branch = tf.compat.v1.cond(pred, taken, untaken)      # dead tensors
            mask_f = tf.reduce_mean(tf.cast(mask, tf.float32))    # bool worker -> chief
            ids_sum = tf.reduce_sum(ids)                          # int64 worker -> chief
            loss = (tf.reduce_mean(tf.square(tf.cast(h16, tf.float32)))
                    + 1e-3 * branch)
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.05)
        train = opt.minimize(loss, colocate_gradients_with_ops=True)
        with tf.device(PS):
            with tf.control_dependencies([train]):
                count = seen.assign_add(1)
        init = tf.compat.v1.global_variables_initializer()

    digest = Digest()
    losses = []
    edges = set()
    options = tf.compat.v1.RunOptions(output_partition_graphs=True)
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        metadata = tf.compat.v1.RunMetadata()
        sess.run(init, options=options, run_metadata=metadata)
        edges |= cross_task_edges(metadata.partition_graphs)
        for step in range(spec.get("steps", 10)):
            fetches = [loss, mask_f, ids_sum, branch, count]
            if step == 0:
                metadata = tf.compat.v1.RunMetadata()
                out = sess.run(fetches, options=options, run_metadata=metadata)
                edges |= cross_task_edges(metadata.partition_graphs)
                _pause(spec, {"cross_task_edges": len(edges), "stats": _stats(spec)})
            else:
                out = sess.run(fetches)
            for v in out:
                digest.add(v)
            losses.append(float(out[0]))
        for v in sess.run([w, b16, seen]):
            digest.add(v)
    return {"digest": digest.hexdigest(), "items": digest.items, "losses": losses,
            "cross_task_edges": len(edges), "stats": _stats(spec)}


# Rows of the batch in tf1_resize: every step changes the size of the
# tensors that depend on it, growing past earlier sizes (re-placement) and
# shrinking; the largest are multi-MB.
RESIZE_ROWS = (3, 700, 40, 1000, 1, 350, 900, 64)


def tf1_resize(spec, ready):
    """TF1 training whose activations change size every step (up to 4 MB),
    with 2 MB weights and gradients between ps and worker."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = _start_chief_server(spec, tf)
    ready()
    rng = np.random.default_rng(99)
    w0 = (rng.standard_normal((512, 1024)) * 0.01).astype(np.float32)   # 2 MB
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS):
            w = tf.compat.v1.get_variable("w", initializer=w0)
        with tf.device(CHIEF):
            rows = tf.compat.v1.placeholder(tf.int32, [], name="rows")
            step_t = tf.compat.v1.placeholder(tf.int32, [], name="step")
        with tf.device(WORKER):
            x = tf.random.stateless_normal(tf.stack([rows, 512]), seed=tf.stack([step_t, 7]))
            h = tf.matmul(x, w)                                    # [rows, 1024] worker -> chief
        with tf.device(CHIEF):
            loss = tf.reduce_mean(tf.square(h))
            head = tf.reduce_sum(h[:, :8], axis=0)
        opt = tf.compat.v1.train.GradientDescentOptimizer(1e-3)
        train = opt.minimize(loss, colocate_gradients_with_ops=True)
        init = tf.compat.v1.global_variables_initializer()

    digest = Digest()
    losses = []
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        sess.run(init)
        for step in range(spec.get("steps", len(RESIZE_ROWS))):
            out = sess.run([loss, head, train],
                           {rows: RESIZE_ROWS[step % len(RESIZE_ROWS)], step_t: step})[:2]
            for v in out:
                digest.add(v)
            losses.append(float(out[0]))
        digest.add(sess.run(w))
    return {"digest": digest.hexdigest(), "items": digest.items, "losses": losses,
            "stats": _stats(spec)}


def big_fetch(spec, ready):
    """A TF1 fetch of more than 1 GiB made on another task, twice (the
    link must stay up for the second step). TF's master receives a fetch
    on its own device, so the tensor crosses from the worker as a tensor,
    not inside the RunGraph reply."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = _start_chief_server(spec, tf)
    ready()
    n = spec.get("bytes", 1_200_000_000) // 4096 * 4096
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(WORKER):
            step = tf.compat.v1.placeholder(tf.uint8, [], name="step")
            pattern = tf.cast(tf.range(4096) % 251, tf.uint8) + step
            big = tf.tile(pattern, [n // 4096])
    digests, sizes = [], []
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        for s in range(2):
            out = sess.run(big, {step: s})
            sizes.append(int(out.nbytes))
            # The consumer touches every byte it received.
            digests.append(hashlib.sha256(memoryview(out)).hexdigest())
            del out
    return {"digests": digests, "sizes": sizes, "stats": _stats(spec)}


def tf1_run_options(spec, ready):
    """TF1 features that ride on RunGraph's options and reply, over tensors
    that cross tasks: a FULL_TRACE step's RunMetadata, a cost model
    (GraphOptions.build_cost_model: record_costs in every RunGraph), and
    Session.make_callable. Returns what each produced, to compare with
    stock gRPC (timings left out)."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = _start_chief_server(spec, tf)
    ready()
    w0, _ = initial_values()
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS):
            w = tf.compat.v1.get_variable("w", initializer=w0)
        with tf.device(CHIEF):
            x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        with tf.device(WORKER):
            h = tf.nn.relu(tf.matmul(x, w))                       # chief,ps -> worker
            big = tf.tile(h, [64, 1024])                          # a few MB back
        with tf.device(CHIEF):
            loss = tf.reduce_sum(big) + tf.reduce_sum(h)          # worker -> chief
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(graph_options=tf.compat.v1.GraphOptions(build_cost_model=1))
    digest = Digest()
    lanes = {}
    with tf.compat.v1.Session(server.target, graph=graph, config=config) as sess:
        sess.run(init)
        md = tf.compat.v1.RunMetadata()
        full = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                       output_partition_graphs=True)
        digest.add(sess.run(loss, {x: batch(1)}, options=full, run_metadata=md))
        for dev in md.step_stats.dev_stats:
            lanes.setdefault(dev.device, set()).update(n.node_name for n in dev.node_stats)
        # The cost model is built over a few steps.
        md2 = tf.compat.v1.RunMetadata()
        for step in range(2, 6):
            digest.add(sess.run(loss, {x: batch(step)}, options=full, run_metadata=md2))
        costs = sorted({(n.name, n.device) for n in md2.cost_graph.node})
        fn = sess.make_callable([loss, h], feed_list=[x])
        for step in range(6, 10):
            for v in fn(batch(step)):
                digest.add(v)
    return {"digest": digest.hexdigest(), "items": digest.items,
            "lanes": {d: sorted(n) for d, n in lanes.items()},
            "cost_nodes": costs, "partition_graphs": len(md.partition_graphs),
            "stats": _stats(spec)}
