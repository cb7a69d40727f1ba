"""Client scenario of test_allocs.py: several edges per step, with pauses
at which the test snapshots every task's allocation counts."""

import json
import sys

import numpy as np

from scenarios import CHIEF, PS, WORKER, _start_chief_server, _stats

# ps -> worker: one variable per size, all read in the same step (several
# edges at once); worker -> chief: one partial sum per variable.
SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20)


def _pause(tag):
    sys.stdout.write(f"{tag} {json.dumps(tag)}\n")
    sys.stdout.flush()
    if not sys.stdin.readline():  # the test writes a line to go on
        raise RuntimeError("stdin closed during a pause")


def marked_steps(spec, ready):
    """`warmup` steps, pause MARK1, `steps` steps, pause MARK2; returns the
    steps counted, the tensors that cross tasks per step and the sum."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = _start_chief_server(spec, tf)
    graph = tf.Graph()
    with graph.as_default():
        parts = []
        for i, size in enumerate(SIZES):
            with tf.device(PS):
                v = tf.compat.v1.get_variable(f"v{i}", initializer=np.full(size // 4, 1.0 / (i + 1), np.float32))
            with tf.device(WORKER):
                parts.append(tf.reduce_sum(v))
        with tf.device(CHIEF):
            total = tf.add_n(parts)
        init = tf.compat.v1.global_variables_initializer()
    ready()
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        sess.run(init)
        for _ in range(spec["warmup"]):
            value = sess.run(total)
        _pause("MARK1")
        for _ in range(spec["steps"]):
            value = sess.run(total)
        _pause("MARK2")
    return {"steps": spec["steps"], "tensors_per_step": 2 * len(SIZES), "total": float(value),
            "stats": _stats(spec)}
