"""``python -m rdma_device.bench suite``: every workload under every mode,
interleaved, with the communication/compute breakdown, tensor sizes, CPU
cost, a transfer sweep, ``results.json``, ``summary.md`` and colour plots.

Runs on the client thread of this process; the tasks are local
subprocesses (``LocalCluster``), one cluster per mode, all started once and
reused by every workload (graphs with fewer workers use a subset). The
tasks' logs go to DIR/logs/. CPU time is counted per mode on that mode's
tasks and this client.

MultiWorkerMirroredStrategy: one data-parallel workload (an MLP with
4 MiB of weights, gradients all-reduced by the ring algorithm every step)
on 2 workers (``--mwms-workers``) under ``grpc`` and ``grpc+rdma_device``,
interleaved in blocks; median step, ratio, the collective bytes per step
the transport counted, and whether both ended with bit-identical weights.
The ``rpc`` ablation does not apply (it changes send/recv, not collectives).

Modes: ``grpc`` (stock), ``grpc+rdma_device`` (one-sided writes into
receiver-placed slots), ``rpc`` (``grpc+rdma_device`` with
``RDMA_DEVICE_MODE=rpc``: the receiver requests each tensor when its Recv
runs, one round trip, then the sender writes it exactly as in push; listed
only when the installed transport knows that setting).

Beside them, the floor (``floor``): the same step with every tensor kept
on the task that produced it, run on a ``grpc+rdma_device`` cluster of its
own (its RunGraph calls take that mode's channel), interleaved with the
modes. A transport mode's ``headroom_captured`` is (grpc − mode) /
(grpc − floor) of the median steps. (It replaces an earlier compute-only
run on stock gRPC with every variable on its worker, which did not average
on the ps and put the pipeline's stages on one worker.)
"""

import json
import os
import random
import statistics
import sys
import time

from rdma_device import _quiet
from rdma_device._cluster import LocalCluster, cpu_seconds, timed_block
from rdma_device.bench import workloads
from rdma_device.bench.progress import Progress
from rdma_device.bench.report_tables import headroom_captured

_TICK = os.sysconf("SC_CLK_TCK")


def modes_available():
    """(name, protocol, env) for each mode the installed transport offers."""
    import rdma_device

    out = [("grpc", "grpc", {}), ("grpc+rdma_device", "grpc+rdma_device", {})]
    if any(row.get("name") == "RDMA_DEVICE_MODE" for row in _config_rows(rdma_device)):
        out.append(("rpc", "grpc+rdma_device", {"RDMA_DEVICE_MODE": "rpc"}))
    return out


def _config_rows(rdma_device):
    try:
        cfg = rdma_device.config()
    except Exception:  # noqa: BLE001 - an old transport without config(): two modes
        return []
    return cfg if isinstance(cfg, list) else [{"name": k} for k in cfg]


def _transport_count(stats):
    """(tensors, bytes) the transport carried, summed over tasks (received,
    whether pushed or streamed, plus fallbacks to gRPC)."""
    t = b = 0
    for st in stats.values():
        c = st.get("counters", {})
        t += c.get("tensors_received", 0) + c.get("fallback_tensors", 0)
        b += c.get("bytes_received", 0) + c.get("fallback_bytes", 0)
    return t, b


def cross_task_tensors(tf, sess, op):
    """Graph analysis: run one step asking for the partition graphs; every
    _Send between different tasks is one tensor per step. Returns the byte
    sizes of those tensors (evaluated once; resource/variant edges skipped)."""
    meta = tf.compat.v1.RunMetadata()
    opts = tf.compat.v1.RunOptions(output_partition_graphs=True)
    sess.run(op, options=opts, run_metadata=meta)
    g = sess.graph
    names = set()
    for pg in meta.partition_graphs:
        for node in pg.node:
            if node.op not in ("_Send", "_HostSend") or node.attr["client_terminated"].b:
                continue
            src, dst = node.attr["send_device"].s.decode(), node.attr["recv_device"].s.decode()
            if src.split("/device:")[0] == dst.split("/device:")[0]:
                continue
            inp = node.input[0]
            if inp.startswith("^"):
                continue
            names.add(inp if ":" in inp else inp + ":0")
    tensors = []
    for n in sorted(names):
        try:
            t = g.get_tensor_by_name(n)
        except (KeyError, ValueError):
            continue
        if t.dtype in (tf.resource, tf.variant, tf.string):
            continue
        tensors.append(t)
    values = sess.run(tensors) if tensors else []
    return sorted(int(getattr(v, "nbytes", 0)) for v in values)


def _steps(sess, op, n):
    for _ in range(n):
        sess.run(op)


def run_workload(tf, name, n, modes, clusters, floor_cluster, args):
    """Interleaved blocks of every mode and of the floor for one (workload,
    workers). Returns one row per mode, then the floor's row."""
    from rdma_device.bench import floor

    runs = {}
    for mode, *_ in modes:
        g, init, op, _ = workloads.build(tf, name, clusters[mode], n, args.quick)
        s = tf.compat.v1.Session(clusters[mode].target(), graph=g)
        s.run(init)
        runs[mode] = (s, op)
    g, init, op, _ = workloads.build(tf, name, floor_cluster, n, args.quick)
    fl = floor.build_floor(tf, g, init, op, floor_cluster)
    runs["floor"] = (fl.session, fl.targets)
    own = dict(clusters, floor=floor_cluster)  # CPU and counters: the running mode's tasks only
    sizes = cross_task_tensors(tf, *runs["grpc"])
    for s, op in runs.values():
        _steps(s, op, args.warmup)
    counted = [m for m in runs if m != "grpc"]  # the clusters with the transport's counters
    before = {m: _transport_count(own[m].stats()) for m in counted}
    steps_run = {m: 0 for m in runs}
    times = {m: [] for m in runs}
    cpu = {m: 0.0 for m in runs}
    # Each repetition runs every mode's block in a new random order: no
    # mode always runs right after another (a cache or a CPU frequency
    # left by it would favour or handicap the same mode every time).
    rng = random.Random()
    for _ in range(args.reps):
        for m in rng.sample(list(runs), len(runs)):
            s, op = runs[m]
            cpu[m] += timed_block(s, op, [own[m]], args.block, times[m])
            steps_run[m] += args.block + 1
    after = {m: _transport_count(own[m].stats()) for m in counted}
    # Then a few traced steps per transport mode: the measured breakdown.
    parts = {m: traced_breakdown(clusters[m], *runs[m], args.block) for m, *_ in modes if m != "grpc"}
    for s, _ in runs.values():
        s.close()
    step = {m: statistics.median(v) for m, v in times.items()}
    floor_ms = step["floor"]
    rows = []
    graph_t, graph_b = len(sizes), sum(sizes)
    for mode in [m for m, *_ in modes] + ["floor"]:
        if mode in before:
            dt = (after[mode][0] - before[mode][0]) / steps_run[mode]
            db = (after[mode][1] - before[mode][1]) / steps_run[mode]
            src = "transport counters"
        else:
            dt, db, src = graph_t, graph_b, "graph analysis"
        row = {
            "workload": name, "mode": mode, "workers": n,
            "samples_per_s": round(workloads.samples_per_step(name, n) / step[mode] * 1e3, 2),
            "step_ms": round(step[mode], 3), "floor_ms": round(floor_ms, 3),
            "comm_ms": round(max(step[mode] - floor_ms, 0.0), 3),
            "headroom_captured": _round(headroom_captured(step["grpc"], step[mode], floor_ms), 4)
            if mode not in ("grpc", "floor") else None,
            "tensors_per_step": round(dt, 2), "bytes_per_step": int(db),
            "avg_tensor_bytes": int(db / dt) if dt else 0,
            "median_tensor_bytes": int(statistics.median(sizes)) if sizes else 0,
            "cpu_s_per_step": round(cpu[mode] / (args.reps * args.block), 5),
            "tensors_source": src, "tensor_sizes": sizes,
            "breakdown": parts.get(mode),
        }
        if mode == "floor":
            # What each task reads from its own copy instead of receiving.
            row["copied_tensors"], row["copied_bytes"] = fl.copies, fl.copied_bytes
        rows.append(row)
    return rows


def _round(x, digits):
    return None if x is None else round(x, digits)


def traced_breakdown(cluster, sess, op, n):
    """``n`` steps with the transport's timeline on in every task: where
    each step's time went (``breakdown``), from the recorded spans."""
    from rdma_device.bench import breakdown

    cluster.trace(True)
    runs = []
    try:
        for _ in range(n):
            t0 = time.time_ns()
            sess.run(op)
            runs.append((t0 / 1e3, time.time_ns() / 1e3))
    finally:
        cluster.trace(False)
    return breakdown.breakdown(cluster.trace_take(), runs)


def plan(args):
    names = [w.strip() for w in args.workloads.split(",")] if args.workloads else list(workloads.WORKLOADS)
    for w in names:
        if w not in workloads.WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; choose from {', '.join(workloads.WORKLOADS)}")
    workers = [int(x) for x in args.workers.split(",")]
    return [(w, n) for w in names for n in workers if n >= workloads.WORKLOADS[w].min_workers]


def add_parser(sub):
    u = sub.add_parser("suite", help="workloads x modes x workers, breakdown, tensor sizes, plots")
    u.add_argument("--quick", action="store_true", help="small models and few steps (a 2-vCPU machine: minutes)")
    u.add_argument("--out", default="rdma_device_suite", help="output directory (default ./rdma_device_suite)")
    u.add_argument("--json", action="store_true", help="print results.json's rows on stdout instead of the table")
    u.add_argument("--workloads", default="", help="comma-separated subset (default: all)")
    u.add_argument("--workers", default="1,2,4", help="worker counts (default 1,2,4; the pipeline needs 2+)")
    u.add_argument("--reps", type=int, default=None, help="interleaved blocks per mode (default 5)")
    u.add_argument("--block", type=int, default=None, help="counted steps per block (default 5 quick, 10)")
    u.add_argument("--warmup", type=int, default=2, help="uncounted steps per mode first")
    u.add_argument("--no-sweep", action="store_true", help="skip the transfer sweep")
    u.add_argument("--sweep-sizes", default="", help="transfer sweep sizes, e.g. 64K,16M (default: by --quick)")
    u.add_argument("--mwms-workers", default="2",
                   help="worker counts of the MultiWorkerMirroredStrategy workload (default 2; '' skips it)")
    return suite


def suite(args):
    """``bench suite``: the run, then its files in --out and its summary
    (or its rows, --json) on stdout."""
    from rdma_device.bench import suite_report

    if args.reps is None:
        args.reps = 5
    if args.block is None:
        args.block = 5 if args.quick else 10
    res = run(args)
    md, pngs = suite_report.write(res, args.out)
    if args.json:
        print(json.dumps(res["rows"]))
    else:
        print(md)
        print("plots:", ", ".join(pngs))
    return res


def run(args):
    """The whole suite. TensorFlow's own log lines (some are written before
    its log level applies) go to DIR/logs/: this process's stderr is
    redirected there while the suite runs; progress goes to the terminal."""
    logs = os.path.join(args.out, "logs")  # the tasks' TensorFlow logs, off the terminal
    os.makedirs(logs, exist_ok=True)
    _quiet.quiet_env()
    sys.stderr.flush()
    saved = os.dup(2)
    term = os.fdopen(os.dup(saved), "w")
    with open(os.path.join(logs, "client.log"), "w") as client_log:
        os.dup2(client_log.fileno(), 2)
        try:
            return _run(args, logs, term)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            term.close()


def _run(args, logs, term):
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    tf.compat.v1.disable_eager_execution()
    from rdma_device.bench.sweep import sweep as transfer_sweep

    modes = modes_available()
    todo = plan(args)
    max_w = max(n for _, n in todo)
    prog = Progress(len(modes) + 1 + len(todo) + (0 if args.no_sweep else 1)
                    + len(_ints(getattr(args, "mwms_workers", ""))), term)
    clusters = {}
    floor_cluster = None
    rows, sweep, mwms = [], [], []
    t0 = time.time()
    try:
        for mode, proto, env in modes:
            clusters[mode] = LocalCluster(proto, {"ps": 1, "worker": max_w}, env=env, log_dir=logs,
                                          name=mode.replace("+", "_"))
            prog.step(f"started the {mode} cluster")
        # The floor runs under grpc+rdma_device, so that its RunGraph calls
        # take the same channel as that mode's.
        floor_cluster = LocalCluster("grpc+rdma_device", {"ps": 1, "worker": max_w}, log_dir=logs, name="floor")
        prog.step("started the floor cluster")
        for name, n in todo:
            rows += run_workload(tf, name, n, modes, clusters, floor_cluster, args)
            prog.step(f"{name}, {n} worker(s)")
        if not args.no_sweep:
            sweep = transfer_sweep(tf, modes, clusters, args)
            prog.step("transfer sweep")
        for c in list(clusters.values()) + [floor_cluster]:
            c.close()  # free the CPUs for the MWMS clusters
        clusters, floor_cluster = {}, None
        for n in _ints(getattr(args, "mwms_workers", "")):
            mwms.append(mwms_workload(n, args, logs))
            prog.step(f"MultiWorkerMirroredStrategy, {n} workers")
    finally:
        prog.close()
        for c in list(clusters.values()) + [floor_cluster]:
            if c is not None:
                c.close()
    return {"rows": rows, "sweep": sweep, "mwms": mwms, "modes": [m for m, *_ in modes],
            "seconds": round(time.time() - t0, 1)}


def _ints(csv):
    return [int(x) for x in str(csv).split(",") if x.strip()]


def mwms_workload(n, args, logs, width=1024):
    """The data-parallel MLP under MultiWorkerMirroredStrategy on ``n``
    workers, both protocols interleaved in blocks (first step of each block
    not counted)."""
    from rdma_device.bench.mwms import MwmsCluster

    protos = [("grpc", None), ("grpc+rdma_device", {"RDMA_DEVICE_STRICT": "1"})]
    clusters = {}
    try:
        for p, env in protos:
            clusters[p] = MwmsCluster(p, n, env=env, log_dir=logs, name=p.replace("+", "_"))
        times = {p: [] for p in clusters}
        cpu = {p: 0.0 for p in clusters}
        digests = {}
        for p, c in clusters.items():
            c.command("train", steps=max(1, args.warmup), width=width)
            c.reset_stats()
        for _ in range(args.reps):
            for p, c in clusters.items():
                c.command("train", steps=1, width=width)  # absorbs the switch
                c0 = cpu_seconds([c])
                out = c.command("train", steps=args.block, width=width)
                cpu[p] += cpu_seconds([c]) - c0
                times[p] += [max(step) for step in zip(*[r["ms"] for r in out])]
                digests[p] = {r["weights"] for r in out}
        counters = [s.get("counters", {}) for s in clusters["grpc+rdma_device"].stats()]
    finally:
        for c in clusters.values():
            c.close()
    steps_run = args.reps * (args.block + 1)
    med = {p: statistics.median(v) for p, v in times.items()}
    counted = args.reps * args.block
    return {
        "workload": "mlp_allreduce", "workers": n, "weights_mib": round((width * width + width) * 4 / 2**20, 2),
        "grpc_step_ms": round(med["grpc"], 2), "rdma_device_step_ms": round(med["grpc+rdma_device"], 2),
        "ratio": round(med["grpc"] / med["grpc+rdma_device"], 2),
        "grpc_cpu_ms": round(cpu["grpc"] / counted * 1e3, 1),
        "rdma_device_cpu_ms": round(cpu["grpc+rdma_device"] / counted * 1e3, 1),
        "collective_mb_per_step": round(sum(c.get("collective_bytes", 0) for c in counters) / steps_run / 1e6, 2),
        "collective_fallback": sum(c.get("collective_fallback_tensors", 0) for c in counters),
        # Each protocol's run is deterministic and the two run the same
        # steps, so their final weights must agree bit for bit.
        "weights_bit_identical": len(digests["grpc"] | digests["grpc+rdma_device"]) == 1,
    }
