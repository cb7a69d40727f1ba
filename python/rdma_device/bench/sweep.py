"""The suite's transfer sweep: one tensor of each size moves ps → worker 0
in a TF1 session, for every mode, interleaved in blocks; the consumer is a
``reduce_sum`` on worker 0, so every received byte is read (a zero-copy
receive gets no credit for bytes nobody touches). Next to it, a one-thread
``memcpy`` (numpy ``copyto`` into a warm buffer) of the same size.

Runs on the client thread; CPU time is counted over the running mode's task
processes and this client, per GB moved.
"""

import statistics
import time

import numpy as np

from rdma_device._cluster import cpu_seconds
from rdma_device._units import parse_size

SIZES_QUICK = (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
SIZES_FULL = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)


def transfer_graph(tf, src, dst, size):
    """A variable of ``size`` bytes on ``src``; its sum computed on ``dst``
    (the graph of ``bench transfer``, ``bench trace`` and the sweep)."""
    g = tf.Graph()
    with g.as_default():
        with tf.device(src):
            v = tf.Variable(tf.random.uniform([size // 4], seed=size), name="v")
        with tf.device(dst):
            # identity first: reduce_sum on the variable itself could be
            # colocated with it (as tf.gather would become a ResourceGather
            # beside it, moving one element); this way the whole tensor
            # crosses tasks. reduce_sum reads every byte received: a
            # consumer of one element would let a zero-copy receive skip
            # the payload.
            out = tf.reduce_sum(tf.identity(v.value()))
        init = tf.compat.v1.global_variables_initializer()
    return g, init, out


def memcpy_gbps(size, reps=9):
    src = np.random.default_rng(0).random(size // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t.append(time.perf_counter() - t0)
    return size / statistics.median(t) / 1e9


def sweep(tf, modes, clusters, args):
    sizes = SIZES_QUICK if args.quick else SIZES_FULL
    if getattr(args, "sweep_sizes", ""):
        sizes = [parse_size(x) for x in args.sweep_sizes.split(",")]
    reps, block = (3, 5) if args.quick else (5, 10)
    rows = []
    for size in sizes:
        runs = {}
        for mode, *_ in modes:
            c = clusters[mode]
            g, init, out = transfer_graph(tf, c.device("ps", 0), c.device("worker", 0), size)
            s = tf.compat.v1.Session(c.target(), graph=g)
            s.run(init)
            s.run(out)
            runs[mode] = (s, out)
        times = {m: [] for m in runs}
        cpu = {m: 0.0 for m in runs}
        for _ in range(reps):
            for m, (s, out) in runs.items():
                s.run(out)  # absorbs the switch, not counted
                c0 = cpu_seconds([clusters[m]])
                for _ in range(block):
                    t = time.perf_counter()
                    s.run(out)
                    times[m].append(time.perf_counter() - t)
                cpu[m] += cpu_seconds([clusters[m]]) - c0
        for s, _ in runs.values():
            s.close()
        mc = memcpy_gbps(size)
        for m in runs:
            med = statistics.median(times[m])
            gb = size * reps * block / 1e9
            rows.append({"size": size, "mode": m, "step_ms": round(med * 1e3, 3),
                         "gbps": round(size / med / 1e9, 3), "cpu_s_per_gb": round(cpu[m] / gb, 3),
                         "memcpy_gbps": round(mc, 2)})
    return rows
