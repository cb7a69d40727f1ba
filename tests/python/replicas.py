"""Workloads run *inside* a server task on command (task_main "run"), for
the concurrency tests: each worker process is also a client of its own
server (between-graph replication), so several masters register graphs on
the same ps at once, as real parameter-server jobs do.

Every workload is deterministic per (task, round) and returns a digest, so
runs under "grpc" and "grpc+rdma_device" compare bit for bit. Workers never
share a variable (order of updates between workers would make the values
nondeterministic); they share the ps, its compute pool, its queues and its
transport, which is what the tests stress.
"""

import threading

import numpy as np

from scenarios import Digest, _stats

PS = "/job:ps/replica:0/task:{}"
WORKER = "/job:worker/replica:0/task:{}"
STEP_TIMEOUT_MS = 60000


def _tf1():
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    return tf


def _init(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1


def ps_round(server, spec, args):
    """One client session of this worker: new graph (so RegisterGraph runs
    on the ps again), variables on the ps, `steps` SGD steps."""
    tf = _tf1()
    task, rnd, steps = spec["task"], args["round"], args.get("steps", 5)
    me = WORKER.format(task)
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS.format(0)):
            w1 = tf.compat.v1.get_variable(f"w1_{task}_{rnd}", initializer=_init((32, 64), task))
            w2 = tf.compat.v1.get_variable(f"w2_{task}_{rnd}", initializer=_init((64, 8), task + 7))
        with tf.device(me):
            x = tf.constant(_init((16, 32), 100 + task))
            h = tf.nn.relu(tf.matmul(x, w1))
            loss = tf.reduce_mean(tf.square(tf.matmul(h, w2)))
            g1, g2 = tf.gradients(loss, [w1, w2])
        with tf.device(PS.format(0)):
            train = tf.group(w1.assign_sub(0.1 * g1), w2.assign_sub(0.1 * g2))
        init = tf.compat.v1.variables_initializer([w1, w2])
    digest = Digest()
    options = tf.compat.v1.RunOptions(timeout_in_ms=STEP_TIMEOUT_MS)
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        sess.run(init, options=options)
        for _ in range(steps):
            digest.add(sess.run([loss, train], options=options)[0])
        for v in sess.run([w1, w2], options=options):
            digest.add(v)
    return {"digest": digest.hexdigest(), "stats": _stats(spec)}


def sync_round(server, spec, args):
    """SyncReplicasOptimizer-style step: every worker pushes its gradient
    into a queue on ps1 and waits for a token from a queue on ps0; worker 0
    (the chief) takes the gradients in task order, applies their sum to the
    shared weights on ps0 and hands out the tokens. Deterministic: the sum
    is always taken in the same order."""
    tf = _tf1()
    task, rnd, steps, n = spec["task"], args["round"], args.get("steps", 4), args["workers"]
    me = WORKER.format(task)
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS.format(0)):
            w = tf.compat.v1.get_variable(f"sync_w_{rnd}", initializer=_init((32, 16), 5),
                                          use_resource=True)
            tokens = [tf.queue.FIFOQueue(n, tf.int64, shapes=[], shared_name=f"tok_{rnd}_{t}")
                      for t in range(n)]
        with tf.device(PS.format(1)):
            grads = [tf.queue.FIFOQueue(n, tf.float32, shapes=[[32, 16]],
                                        shared_name=f"grad_{rnd}_{t}") for t in range(n)]
        with tf.device(me):
            x = tf.constant(_init((8, 32), 200 + task))
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w.read_value())))
            (g,) = tf.gradients(loss, [w])
            push = grads[task].enqueue(g)
            take_token = tokens[task].dequeue()
        if task == 0:
            with tf.device(PS.format(0)):
                total = grads[0].dequeue()
                for t in range(1, n):
                    total = total + grads[t].dequeue()
                start = tf.group(*[q.enqueue(tf.constant(1, tf.int64)) for q in tokens])
                update = w.assign_sub(0.1 * total)
                with tf.control_dependencies([update]):
                    give = tf.group(*[q.enqueue(tf.constant(1, tf.int64)) for q in tokens])
        init = tf.compat.v1.variables_initializer([w])
    digest = Digest()
    options = tf.compat.v1.RunOptions(timeout_in_ms=STEP_TIMEOUT_MS)
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        if task == 0:
            # Initialize, then hand every worker its first token.
            sess.run(init, options=options)
            sess.run(start, options=options)
        for _ in range(steps):
            sess.run(take_token, options=options)
            if task == 0:
                # The chief's apply (waits for every gradient) runs beside
                # its own step, on the same session.
                applier = threading.Thread(target=sess.run, args=(give,),
                                           kwargs=dict(options=options))
                applier.start()
                digest.add(sess.run([loss, push], options=options)[0])
                applier.join()
            else:
                digest.add(sess.run([loss, push], options=options)[0])
        sess.run(take_token, options=options)
        digest.add(sess.run(w.read_value(), options=options))
    return {"digest": digest.hexdigest(), "stats": _stats(spec)}


def threads_round(server, spec, args):
    """`threads` Python threads call session.run on one session at once,
    each training its own variables on the ps."""
    tf = _tf1()
    task, rnd = spec["task"], args["round"]
    n, steps = args.get("threads", 4), args.get("steps", 10)
    me = WORKER.format(task)
    graph = tf.Graph()
    fetches = []
    with graph.as_default():
        for t in range(n):
            with tf.device(PS.format(0)):
                w = tf.compat.v1.get_variable(f"th_w_{task}_{rnd}_{t}",
                                              initializer=_init((24, 24), 50 + t))
            with tf.device(me):
                y = tf.matmul(tf.constant(_init((12, 24), 60 + t)), w)
                loss = tf.reduce_mean(tf.square(y))
                (g,) = tf.gradients(loss, [w])
            with tf.device(PS.format(0)):
                train = w.assign_sub(0.05 * g)
            fetches.append((loss, train, w))
        init = tf.compat.v1.global_variables_initializer()
    options = tf.compat.v1.RunOptions(timeout_in_ms=STEP_TIMEOUT_MS)
    digests = [Digest() for _ in range(n)]
    errors = []
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        sess.run(init, options=options)

        def work(t):
            loss, train, w = fetches[t]
            try:
                for _ in range(steps):
                    digests[t].add(sess.run([loss, train], options=options)[0])
                digests[t].add(sess.run(w, options=options))
            except Exception as e:  # reported, not swallowed
                errors.append(f"thread {t}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return {"digest": [d.hexdigest() for d in digests], "stats": _stats(spec)}
