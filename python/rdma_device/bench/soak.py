"""Soak: a long run of random tensors through a 3-task cluster, with a
worker killed (SIGKILL) and restarted halfway through.

    python -m rdma_device.bench soak --steps N [--json] [--seed S]

Tasks: ps:0, worker:0 (the master the client talks to), worker:1, all on
"grpc+rdma_device". The graph has one lane per dtype (10 dtypes); every
step picks ``--lanes`` of them at random to carry a tensor of a random
shape (rank 0-4; empty tensors, up to 128 Ki elements, and a few of 2 Mi
elements, i.e. up to 16 MiB) and sends empty tensors on the others. Each
tensor goes worker:0 -> ps -> worker:1 -> worker:0 and every task computes
a checksum (64-bit fingerprint) of the bytes it received. A hop whose
checksum (or the final shape) differs from the sender's is ``corrupt``; a
tensor whose step never succeeds (``--retries`` more attempts, each with a
deadline) is ``lost``. At step N/2 worker:1 is killed and started again on
the same address; the step that meets the dead task fails and is retried on
a fresh session (``failed_attempts``; ``retried_steps`` counts the steps
that failed at least once, shown in the output and in ``bench report``'s
table, never hidden behind the retry). ``--kill-at -1`` runs without the
kill; ``--protocol grpc`` runs the same soak on stock gRPC (a baseline for
the memory numbers).

RSS is read from /proc for each task: after the first step, at the
baseline (step 1000, or N/10 when N < 10,000; for the restarted task the
same number of steps after its restart) and at the end. ``rss_growth_pct``
is the growth of the three tasks' total from the baseline to the end. RSS
includes the pages of receive arenas a task has touched (its own and, as a
sender, its peers'), so it grows while edges are first placed and then
stays flat.
"""

import json
import random
import time

from rdma_device._cluster import LocalCluster

# (name, itemsize); bool is checksummed as uint8.
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8", "int16", "bool")
TASKS = (("ps", 0), ("worker", 0), ("worker", 1))
VICTIM = ("worker", 1)
HOPS = 3  # worker:0 -> ps -> worker:1 -> worker:0


def _checksum(tf, x):
    """A 64-bit fingerprint (FarmHash) of the tensor's bytes, dtype and
    shape: detects changed, lost and permuted bytes, not only flipped ones.

    Memory: one serialized copy of the tensor. (An earlier checksum, a
    position-weighted sum of the bytes cast to int64, needed temporaries of
    8x the tensor's size several times over: 128 MiB each for a 16 MiB
    tensor. TensorFlow's CPU allocator keeps its pool at its high-water
    mark, so every step that first combined such tensors raised the tasks'
    RSS for good, on stock gRPC as on this transport, and the soak's RSS
    growth measured the checksum's peak, not the transport.)"""
    return tf.strings.to_hash_bucket_fast(tf.io.serialize_tensor(x), 1 << 62)


def _generate(tf, name, shape):
    dt = tf.as_dtype(name)
    if dt.is_floating:
        return tf.cast(tf.random.uniform(shape, -1e3, 1e3, dtype=tf.float32), dt)
    if dt == tf.int64:
        return tf.random.uniform(shape, -(1 << 62), 1 << 62, dtype=tf.int64)
    if dt == tf.bool:
        return tf.random.uniform(shape, 0, 2, dtype=tf.int32) > 0
    return tf.cast(tf.random.uniform(shape, -(1 << 31), (1 << 31) - 1, dtype=tf.int32), dt)


def _graph(tf, cluster):
    """One lane per dtype; a step fetches the lanes it picked."""
    g = tf.Graph()
    lanes = {}
    with g.as_default():
        for name in DTYPES:
            shape = tf.compat.v1.placeholder(tf.int32, [None], name=f"shape_{name}")
            with tf.device(cluster.device("worker", 0)):
                x = _generate(tf, name, shape)
                c0 = _checksum(tf, x)
            with tf.device(cluster.device("ps", 0)):
                c1 = _checksum(tf, x)
                y = tf.identity(x)
            with tf.device(cluster.device("worker", 1)):
                c2 = _checksum(tf, y)
                z = tf.identity(y)
            with tf.device(cluster.device("worker", 0)):
                c3 = _checksum(tf, z)
                zs = tf.shape(z)
            lanes[name] = (shape, [c0, c1, c2, c3, zs])
    return g, lanes


def _random_shape(rng):
    """Mostly small and medium tensors, some empty, a few of 2 Mi elements
    (the largest size, so each edge's slots reach their final size early)."""
    r = rng.random()
    if r < 0.05:
        n = 0
    elif r < 0.97:
        n = int(2 ** rng.uniform(0, 17))      # 1 .. 128 Ki elements
    else:
        n = 1 << 21
    rank = rng.randint(0, 4)
    if rank == 0:
        return [] if n == 1 else [n]
    dims = [1] * rank
    left = n
    for i in range(rank - 1):
        d = rng.choice([1, 2, 3, 4, 7, 8, 16, 31, 64])
        if left >= d:
            dims[i] = d
            left //= d
    dims[-1] = left
    rng.shuffle(dims)
    return dims


def _arena_in_use(cluster):
    return sum(s.get("counters", {}).get("arena_bytes_in_use", 0) for s in cluster.stats().values())


class _Rss:
    def __init__(self, cluster):
        self.c = cluster
        self.points = {}
        self.anon = {}

    def mark(self, label, tasks=TASKS):
        self.points[label] = {f"{j}:{i}": round(self.c.rss_mb(j, i), 1) for j, i in tasks}
        self.anon[label] = {f"{j}:{i}": round(self.c.rss_mb(j, i, "RssAnon"), 1) for j, i in tasks}

    def total(self, *labels, anon=False):
        merged = {}
        for label in labels:
            merged.update((self.anon if anon else self.points).get(label, {}))
        return round(sum(merged.values()), 1)


def soak(args):
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    rng = random.Random(args.seed)
    env = {"RDMA_DEVICE_ARENA_BYTES": args.arena} if args.arena else {}
    steps = args.steps
    base_at = 1000 if steps >= 10000 else max(1, steps // 10)
    kill_at = steps // 2 if args.kill_at is None else args.kill_at
    res = dict(protocol=args.protocol, steps=steps, lanes=args.lanes, tensors=0, empty_tensors=0, hops=0, lost=0, corrupt=0, bytes=0,
               failed_attempts=0, retried_steps=0, errors=[], restarted_at_step=None)
    t0 = time.time()
    cluster = LocalCluster(args.protocol, {"ps": 1, "worker": 2}, env=env)
    rss = _Rss(cluster)
    options = tf.compat.v1.RunOptions(timeout_in_ms=args.step_timeout_ms)
    g, lanes = _graph(tf, cluster)
    sess = tf.compat.v1.Session(cluster.target("worker", 0), graph=g)
    try:
        for step in range(steps):
            mid = step == kill_at and step > 0 and args.kill_mid_stream
            if step == kill_at and step > 0 and not mid:
                cluster.kill(*VICTIM)
                cluster.restart(*VICTIM)
                res["restarted_at_step"] = step
            picked = rng.sample(DTYPES, args.lanes)
            shapes = {name: (_random_shape(rng) if name in picked else [0]) for name in DTYPES}
            if mid:
                # The largest tensors, so that they stream through a small
                # arena while worker:1 dies.
                shapes = {name: ([1 << 21] if name in picked else [0]) for name in DTYPES}
            feed = {lanes[n][0]: shapes[n] for n in DTYPES}
            fetch = [lanes[n][1] for n in DTYPES]
            for attempt in range(args.retries + 1):
                try:
                    if mid and attempt == 0:
                        res["restarted_at_step"] = step
                        out = _run_killing_mid_stream(cluster, sess, fetch, feed, options, res)
                    else:
                        out = sess.run(fetch, feed, options=options)
                    break
                except tf.errors.OpError as e:
                    res["failed_attempts"] += 1
                    res["retried_steps"] += int(attempt == 0 and args.retries > 0)
                    if len(res["errors"]) < 5:
                        msg = " ".join(e.message.split())
                        res["errors"].append(f"step {step}: {type(e).__name__}: {msg[:1500]}")
                    sess.close()
                    sess = tf.compat.v1.Session(cluster.target("worker", 0), graph=g)
            else:
                res["lost"] += len(picked)
                res["tensors"] += len(picked)
                continue
            for name, (c0, c1, c2, c3, zs) in zip(DTYPES, out):
                want = shapes[name]
                # Empty lanes are checked too, counted apart.
                res["corrupt"] += int(c1 != c0) + int(c2 != c1) + int(c3 != c2) + int(list(zs) != list(want))
                if name not in picked:
                    res["empty_tensors"] += 1
                    continue
                res["tensors"] += 1
                res["hops"] += HOPS
                n = 1
                for d in want:
                    n *= d
                res["bytes"] += HOPS * n * tf.as_dtype(name).size
            if step == 0:
                rss.mark("start")
            if step + 1 == base_at:
                # Without a restart (--kill-at -1) every task has its
                # baseline here; else the victim's comes after its restart.
                rss.mark("base", [t for t in TASKS if t != VICTIM or not 0 < kill_at < steps])
                res["arena_bytes_in_use_baseline"] = _arena_in_use(cluster)
            if res["restarted_at_step"] is not None and step + 1 == res["restarted_at_step"] + base_at:
                rss.mark("base_victim", [VICTIM])
            if args.progress and (step + 1) % args.progress == 0:
                print(f"soak: step {step + 1}/{steps}, {res['tensors']} tensors, lost {res['lost']}, "
                      f"corrupt {res['corrupt']}, {time.time() - t0:.0f} s", flush=True)
        rss.mark("end")
        sess.close()
        sess = None
        stats = cluster.stats()
    finally:
        if sess is not None:
            sess.close()
        cluster.close()
    counters = {t: s.get("counters", {}) for t, s in stats.items()}
    base_labels = ("base", "base_victim") if "base_victim" in rss.points else ("base",)
    base_tasks = set().union(*(rss.points.get(lb, {}) for lb in base_labels))
    end_same = sum(v for k, v in rss.points["end"].items() if k in base_tasks)
    base_total = rss.total(*base_labels)
    anon_base = rss.total(*base_labels, anon=True)
    anon_end = round(sum(v for k, v in rss.anon["end"].items() if k in base_tasks), 1)
    res.update(
        seconds=round(time.time() - t0, 1),
        rss_baseline_step=base_at,
        rss_mb_start=rss.total("start"),
        rss_mb_baseline=base_total,
        rss_mb_end=rss.total("end"),
        rss_growth_pct=round(100.0 * (end_same - base_total) / base_total, 2) if base_total else None,
        rss_anon_mb_baseline=anon_base,
        rss_anon_mb_end=anon_end,
        rss_anon_growth_pct=round(100.0 * (anon_end - anon_base) / anon_base, 2) if anon_base else None,
        rss_mb_by_task={k: {lb: p.get(k) for lb, p in rss.points.items() if k in p} for k in rss.points["end"]},
        arena_bytes_in_use_end=sum(c.get("arena_bytes_in_use", 0) for c in counters.values()),
        arena_bytes_total=sum(c.get("arena_bytes_total", 0) for c in counters.values()),
        tensors_pushed=sum(c.get("tensors_pushed", 0) for c in counters.values()),
        inline_tensors=sum(c.get("inline_tensors", 0) for c in counters.values()),
        fallback_tensors=sum(c.get("fallback_tensors", 0) for c in counters.values()),
    )
    if args.json:
        print(json.dumps(res))
    else:
        print(f"soak: {steps} steps, {res['tensors']} tensors ({res['hops']} task-to-task moves, "
              f"{res['bytes'] / 2**30:.2f} GiB), lost {res['lost']}, corrupt {res['corrupt']}, "
              f"{res['retried_steps']} step(s) retried after {res['failed_attempts']} failed attempt(s) "
              f"(worker:1 killed and restarted at step "
              f"{res['restarted_at_step']}), {res['seconds']} s")
        print(f"  RSS (3 tasks): start {res['rss_mb_start']} MiB, at step {base_at} {res['rss_mb_baseline']} MiB, "
              f"end {res['rss_mb_end']} MiB, growth after the baseline {res['rss_growth_pct']}% "
              f"(private memory alone: {res['rss_anon_growth_pct']}%)")
        print(f"  transport: pushed {res['tensors_pushed']}, streamed {res['inline_tensors']}, "
              f"fallback {res['fallback_tensors']}, arena in use at the end {res['arena_bytes_in_use_end']} B")
        if "kill" in res:
            k = res["kill"]
            print(f"  worker:1 killed inside step {res['restarted_at_step']}, after the ps had written "
                  f"{k['ps_stream_chunks_before_kill']} stream chunks of that step (step still running: "
                  f"{k['step_still_running']}; runs of that step that ended before a poll saw their stream: {k['missed']})")
        for e in res["errors"]:
            print(f"  failed attempt: {e}")
    return res


def _run_killing_mid_stream(cluster, sess, fetch, feed, options, res, tries=5):
    """Run one step and SIGKILL worker:1 while the ps streams a tensor to
    it: once the ps has sent a chunk of a streamed tensor since the step
    began (the ps -> worker:1 hop is the ps's only send), then restart it.
    A chunk goes through a stream slot (``stream_chunks``) or, when the
    receiver has no room for stream slots, as a control message
    (``stream_messages``): both count. The ps's counters are polled (one
    round trip to the task per poll), so a step can stream and end
    between two polls: such a run is not a kill mid-stream; it is counted
    (``missed``) and the same step is run again, up to ``tries`` times.
    Records the chunks the ps had sent by the kill in ``res["kill"]``."""
    import threading

    def chunks():
        c = cluster.task_stats("ps", 0).get("counters", {})
        return c.get("stream_chunks", 0) + c.get("stream_messages", 0)

    missed = 0
    while True:
        before = chunks()
        out, err = {}, {}

        def run():
            try:
                out["v"] = sess.run(fetch, feed, options=options)
            except Exception as e:  # noqa: BLE001 (re-raised on the caller's thread)
                err["e"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        deadline = time.time() + 60
        now = before
        while t.is_alive() and time.time() < deadline:
            now = chunks()
            if now > before:
                break
        running = t.is_alive()
        if running or missed + 1 >= tries or "e" in err:
            break
        # The step ended before a poll saw its stream: not mid-stream.
        t.join()
        missed += 1
    cluster.kill(*VICTIM)
    res["kill"] = {"ps_stream_chunks_before_kill": now - before, "step_still_running": running,
                   "missed": missed}
    cluster.restart(*VICTIM)
    t.join(timeout=options.timeout_in_ms / 1e3 + 30)
    if t.is_alive():
        raise RuntimeError("the step running while worker:1 was killed never returned")
    if "e" in err:
        raise err["e"]
    return out["v"]


def add_parser(sub):
    s = sub.add_parser("soak", help="long random-tensor run with a worker killed and restarted halfway")
    s.add_argument("--steps", type=int, default=1000)
    s.add_argument("--lanes", type=int, default=3, help="dtypes that carry a tensor each step (of 10)")
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--retries", type=int, default=3, help="attempts after a failed step before its tensors count as lost")
    s.add_argument("--step-timeout-ms", type=int, default=60000)
    s.add_argument("--kill-at", type=int, default=None,
                   help="step at which worker:1 is killed and restarted (default N/2; -1: never)")
    s.add_argument("--protocol", default="grpc+rdma_device",
                   help="the tasks' protocol; \"grpc\" runs the same soak on stock gRPC as a baseline")
    s.add_argument("--kill-mid-stream", action="store_true",
                   help="kill worker:1 inside the kill step, while the ps streams a tensor to it (use a small --arena so "
                        "that tensors stream)")
    s.add_argument("--arena", default=None, help="RDMA_DEVICE_ARENA_BYTES for the tasks (default: the library's)")
    s.add_argument("--progress", type=int, default=0, help="print a line every this many steps")
    s.add_argument("--json", action="store_true")
    return soak
