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

    try:
        return rdma_device.stats()
    except FileNotFoundError:  # TEMPORARY: phase-1 shim has no transport
        return None


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
