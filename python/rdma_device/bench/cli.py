"""Benchmarks against stock gRPC, side by side in one run.

    python -m rdma_device.bench transfer [--sizes 4K,1M,16M,64M] [--reps 15] [--json]
    python -m rdma_device.bench train    [--steps 100] [--json]
    python -m rdma_device.bench suite    [--quick] [--out DIR] [--json]
    python -m rdma_device.bench soak     [--steps 1000] [--json]   (see rdma_device.bench.soak)
    python -m rdma_device.bench allreduce [--sizes 1M,4M,16M,64M] [--workers 2,3] [--json]
    python -m rdma_device.bench trace    [--out t.json] [--sizes 4K,1M,16M] [--tensorboard DIR]
    python -m rdma_device.bench py       [--sizes 4K,64K,1M,16M,64M] [--quick] [--plot F] [--json]
    python -m rdma_device.bench report   [--quick] [--runs 3] [--out DIR]   (see rdma_device.bench.report)

``py``: the endpoint API (rdma_device.endpoint, no TensorFlow) between two
processes against multiprocessing.shared_memory with a pipe and against
torch.distributed gloo, interleaved (see rdma_device.bench.pybench).

``report``: every benchmark the README quotes (fabric, transfer, train,
allreduce, suite, soak), N runs each in randomised interleaved order;
medians and ranges, machine, date and commit; rewrites the README's
generated tables and docs/eval plots (``--quick``: fewer runs and smaller
settings, written only to DIR).

``suite``: six workloads (AlexNet- and ResNet-class CNNs, an LSTM language
model, a Transformer encoder, wide & deep with sparse embedding lookups, a
model-parallel pipeline) with one parameter server and 1/2/4 workers,
under every mode (stock grpc, grpc+rdma_device and, where the transport
offers it, the RPC-over-RDMA ablation), interleaved; the
communication/compute breakdown, tensor sizes, CPU cost and a transfer
sweep; writes DIR/results.json, DIR/transfer.json, DIR/summary.md and
colour plots (DIR/*.png).

``transfer``: a tensor of each size moves task→task in a TF1 session (task 1
holds a variable, task 0 consumes it), on two local clusters started side by
side, one with protocol "grpc" and one with "grpc+rdma_device"; steps
alternate between them. Prints the median step time of each, the ratio
(gRPC time / rdma_device time), and the first step of each fresh graph on
three clusters: "grpc", "grpc+rdma_device" (edges placed when the graph is
registered, so step 1 already pushes) and "grpc+rdma_device traced"
(RDMA_DEVICE_STATIC_PLACEMENT=0: placed on first use, inside step 1). A
first step includes TensorFlow registering the graph on the tasks.

``allreduce``: MultiWorkerMirroredStrategy (ring all-reduce, the CPU
implementation) all-reducing one float32 tensor of each size across 2 and
3 workers, on two local clusters started side by side ("grpc" and
"grpc+rdma_device", strict), calls interleaved in blocks. The baseline is
stock TensorFlow: the same strategy and algorithm whose chunks travel as
RecvBuf RPCs. Algorithm bandwidth = size / median time of one all-reduce
(the slowest worker's); the ratio is gRPC time / rdma_device time; CPU is
the CPU time of the cluster's worker processes per all-reduce.

``trace``: where a 2-task step's time goes, recorded span by span in both
tasks (see rdma_device.bench.trace); writes a Chrome trace and prints the
median timeline of a step per size.

``train``: a short parameter-server training run (variables on a PS task,
gradient steps on a worker) under both protocols, interleaved in blocks (in a
random order per round; the first step after a switch is not counted); prints
median step times, the ratio, and whether the final weights are
bit-identical.

Every subcommand takes ``--verbose``: without it, TensorFlow's C++ log
lines (its own and its task processes') are kept off the terminal
(``TF_CPP_MIN_LOG_LEVEL=2`` and a filter for the lines written before that
applies); progress goes to stderr, results to stdout.
"""

import argparse
import json
import random
import statistics
import sys
import time

from rdma_device import _quiet
from rdma_device._cluster import LocalCluster, cpu_seconds, timed_block
from rdma_device._units import parse_size, size_label
from rdma_device.bench.progress import Progress

PROTOCOLS = ("grpc", "grpc+rdma_device")
# A third cluster for first steps only: placement on first use.
TRACED = "grpc+rdma_device traced"
TRACED_ENV = {"RDMA_DEVICE_STATIC_PLACEMENT": "0"}


def transfer(args):
    import tensorflow as tf

    from rdma_device.bench.sweep import transfer_graph

    tf.compat.v1.disable_eager_execution()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    env = {"RDMA_DEVICE_STRICT": "1"} if args.strict else {}
    clusters = {p: LocalCluster(p, {"worker": 2}, env=env) for p in PROTOCOLS}
    clusters[TRACED] = LocalCluster("grpc+rdma_device", {"worker": 2}, env=dict(env, **TRACED_ENV))
    results = []
    prog = Progress(len(sizes))
    try:
        for size in sizes:
            sessions = {}
            first = {}
            for p, c in clusters.items():
                # Task 1 holds the variable, task 0 reads all of it.
                g, init, out = transfer_graph(tf, c.device("worker", 1), c.device("worker", 0), size)
                s = tf.compat.v1.Session(c.target(), graph=g)
                s.run(init)
                t = time.perf_counter()
                s.run(out)  # first step of this graph: registration (and placement) happen here
                first[p] = (time.perf_counter() - t) * 1e3
                if p in PROTOCOLS:
                    sessions[p] = (s, out)
                else:
                    s.close()
            times = {p: [] for p in PROTOCOLS}
            cpu = {p: 0.0 for p in PROTOCOLS}
            rng = random.Random(size)
            for _ in range(args.reps):
                # Interleaved, in blocks of --block steps, in a random order
                # per round (no protocol always runs right after the other).
                for p in rng.sample(PROTOCOLS, len(PROTOCOLS)):
                    s, out = sessions[p]
                    cpu[p] += timed_block(s, out, [clusters[p]], args.block, times[p])
            gb = size * args.reps * args.block / 1e9
            for s, _ in sessions.values():
                s.close()
            med = {p: statistics.median(v) for p, v in times.items()}
            r = {
                "size": size,
                "grpc_ms": round(med["grpc"], 3),
                "rdma_device_ms": round(med["grpc+rdma_device"], 3),
                "ratio": round(med["grpc"] / med["grpc+rdma_device"], 2),
                "grpc_gbps": round(size / med["grpc"] / 1e6, 3),
                "rdma_device_gbps": round(size / med["grpc+rdma_device"] / 1e6, 3),
                "grpc_cpu_s_per_gb": round(cpu["grpc"] / gb, 3),
                "rdma_device_cpu_s_per_gb": round(cpu["grpc+rdma_device"] / gb, 3),
                "first_step_grpc_ms": round(first["grpc"], 3),
                "first_step_rdma_device_ms": round(first["grpc+rdma_device"], 3),
                "first_step_rdma_device_traced_ms": round(first[TRACED], 3),
            }
            results.append(r)
            prog.step(f"{size_label(size)}: grpc {r['grpc_ms']:.2f} ms, grpc+rdma_device {r['rdma_device_ms']:.2f} ms")
            if args.json:
                print(json.dumps(r), flush=True)
        prog.close()
        stats = clusters["grpc+rdma_device"].stats()
    finally:
        for c in clusters.values():
            c.close()
    if not args.json:
        print("consumer: reduce_sum on task 0 (reads every byte); CPU s/GB: CPU time of the protocol's task "
              "process and this client, per GB moved")
        print(f"transfer task1 -> task0 in a TF1 session: median of {args.reps * args.block} steps per protocol, "
              f"in {args.reps} interleaved blocks of {args.block} (+1 uncounted)")
        print("first step of each fresh graph (ms, includes graph registration): 1st grpc, 1st rdma "
              "(static placement), 1st traced (RDMA_DEVICE_STATIC_PLACEMENT=0)")
        print(f"{'size':>8} {'grpc ms':>9} {'rdma ms':>9} {'ratio':>6} {'grpc GB/s':>10} {'rdma GB/s':>10} "
              f"{'grpc CPU s/GB':>13} {'rdma CPU s/GB':>13} {'1st grpc':>9} {'1st rdma':>9} {'1st traced':>10}")
        for r in results:
            print(f"{size_label(r['size']):>8} {r['grpc_ms']:>9.2f} {r['rdma_device_ms']:>9.2f} {r['ratio']:>6.2f} "
                  f"{r['grpc_gbps']:>10.2f} {r['rdma_device_gbps']:>10.2f} {r['grpc_cpu_s_per_gb']:>13.2f} "
                  f"{r['rdma_device_cpu_s_per_gb']:>13.2f} {r['first_step_grpc_ms']:>9.2f} "
                  f"{r['first_step_rdma_device_ms']:>9.2f} {r['first_step_rdma_device_traced_ms']:>10.2f}")
        _print_transport(stats)
    return results


def _print_transport(stats):
    for task, st in stats.items():
        c = st.get("counters", {})
        print(f"  {task}: pushed {c.get('tensors_pushed', 0)} tensors / {c.get('bytes_pushed', 0)} B, "
              f"received {c.get('tensors_received', 0)}, fallback {c.get('fallback_tensors', 0)}, "
              f"peers {st.get('peers', {})}")


def allreduce(args):
    from rdma_device.bench.mwms import MwmsCluster

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    env = {"RDMA_DEVICE_STRICT": "1"} if args.strict else {}
    results, stats = [], {}
    counts = [int(w) for w in args.workers.split(",")]
    prog = Progress(len(counts) * len(sizes))
    for n in counts:
        clusters = {}
        try:
            for p in PROTOCOLS:
                clusters[p] = MwmsCluster(p, n, env=env if p != "grpc" else None)
            for size in sizes:
                times = {p: [] for p in PROTOCOLS}
                cpu = {p: 0.0 for p in PROTOCOLS}
                for p, c in clusters.items():
                    c.command("allreduce", size=size, reps=1)  # trace, connect, place
                rng = random.Random(size * 10 + n)
                for _ in range(args.reps):
                    for p in rng.sample(PROTOCOLS, len(PROTOCOLS)):  # interleaved, in blocks, random order
                        c = clusters[p]
                        c.command("allreduce", size=size, reps=1)  # absorbs the switch: not counted
                        c0 = cpu_seconds([c])
                        per_worker = [r["ms"] for r in c.command("allreduce", size=size, reps=args.block)]
                        cpu[p] += cpu_seconds([c]) - c0
                        times[p] += [max(call) for call in zip(*per_worker)]
                med = {p: statistics.median(v) for p, v in times.items()}
                calls = args.reps * args.block
                r = {"size": size, "workers": n,
                     "grpc_gbps": round(size / med["grpc"] / 1e6, 3),
                     "rdma_gbps": round(size / med["grpc+rdma_device"] / 1e6, 3),
                     "ratio": round(med["grpc"] / med["grpc+rdma_device"], 2),
                     "grpc_ms": round(med["grpc"], 3), "rdma_ms": round(med["grpc+rdma_device"], 3),
                     "grpc_cpu_ms": round(cpu["grpc"] / calls * 1e3, 2),
                     "rdma_cpu_ms": round(cpu["grpc+rdma_device"] / calls * 1e3, 2)}
                results.append(r)
                prog.step(f"{size_label(size)} on {n} workers: grpc {r['grpc_ms']:.2f} ms, "
                          f"grpc+rdma_device {r['rdma_ms']:.2f} ms")
                if args.json:
                    print(json.dumps(r), flush=True)
            stats[n] = clusters["grpc+rdma_device"].stats()
        finally:
            for c in clusters.values():
                c.close()
    if not args.json:
        print(f"MultiWorkerMirroredStrategy ring all-reduce of one float32 tensor; median of "
              f"{args.reps * args.block} calls per protocol in {args.reps} interleaved blocks of "
              f"{args.block} (+1 uncounted); baseline: the same strategy on stock gRPC (RecvBuf RPCs)")
        print(f"{'size':>8} {'workers':>7} {'grpc ms':>9} {'rdma ms':>9} {'ratio':>6} {'grpc GB/s':>10} "
              f"{'rdma GB/s':>10} {'grpc CPU ms':>11} {'rdma CPU ms':>11}")
        for r in results:
            print(f"{size_label(r['size']):>8} {r['workers']:>7} {r['grpc_ms']:>9.2f} {r['rdma_ms']:>9.2f} "
                  f"{r['ratio']:>6.2f} {r['grpc_gbps']:>10.2f} {r['rdma_gbps']:>10.2f} "
                  f"{r['grpc_cpu_ms']:>11.1f} {r['rdma_cpu_ms']:>11.1f}")
        for n, per_worker in stats.items():
            c = [s.get("counters", {}) for s in per_worker]
            print(f"  {n} workers, grpc+rdma_device: collective chunks received over the transport "
                  f"{sum(x.get('collective_tensors', 0) for x in c)} "
                  f"({sum(x.get('collective_bytes', 0) for x in c)} B), over gRPC "
                  f"{sum(x.get('collective_fallback_tensors', 0) for x in c)}")
    return results


def _train_graph(tf, cluster, seed=7):
    """A small MLP regression: variables on the PS, compute on the worker."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(seed)
        with tf.device(cluster.device("ps", 0)):
            w1 = tf.Variable(tf.random.normal([512, 1024], seed=1) * 0.05, name="w1")
            w2 = tf.Variable(tf.random.normal([1024, 256], seed=2) * 0.05, name="w2")
            step = tf.Variable(0, dtype=tf.int64, name="step")
        with tf.device(cluster.device("worker", 0)):
            x = tf.random.normal([256, 512], seed=3)
            y = tf.random.normal([256, 256], seed=4)
            h = tf.nn.relu(tf.matmul(x, w1))
            loss = tf.reduce_mean(tf.square(tf.matmul(h, w2) - y))
            opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)
            train = opt.minimize(loss, global_step=step)
        init = tf.compat.v1.global_variables_initializer()
    return g, init, train, loss, [w1, w2]


def train(args):
    import numpy as np
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    env = {"RDMA_DEVICE_STRICT": "1"} if args.strict else {}
    clusters = {p: LocalCluster(p, {"ps": 1, "worker": 1}, env=env) for p in PROTOCOLS}
    try:
        runs = {}
        for p, c in clusters.items():
            g, init, op, loss, ws = _train_graph(tf, c)
            s = tf.compat.v1.Session(c.target("worker", 0), graph=g)
            s.run(init)
            runs[p] = (s, op, loss, ws)
        times = {p: [] for p in PROTOCOLS}
        losses = {p: [] for p in PROTOCOLS}
        rng = random.Random(args.steps)
        prog = Progress(args.steps)
        while len(times["grpc"]) < args.steps:
            prog.step(f"{len(times['grpc'])} of {args.steps} counted steps under both protocols",
                      done=len(times["grpc"]))
            # Blocks of --block steps per protocol, in a random order per
            # round; the first step after a switch runs but is not counted.
            # Both protocols run the same steps, so their weights compare.
            for p in rng.sample(PROTOCOLS, len(PROTOCOLS)):
                s, op, loss, _ = runs[p]
                for i in range(args.block + 1):
                    t = time.perf_counter()
                    _, l = s.run([op, loss])
                    if i:
                        times[p].append((time.perf_counter() - t) * 1e3)
                    losses[p].append(l)
        prog.close()
        finals = {p: runs[p][0].run(runs[p][3]) for p in PROTOCOLS}
        identical = all(np.array_equal(a, b) for a, b in zip(finals["grpc"], finals["grpc+rdma_device"]))
        stats = clusters["grpc+rdma_device"].stats()
        for s, *_ in runs.values():
            s.close()
    finally:
        for c in clusters.values():
            c.close()
    med = {p: statistics.median(v) for p, v in times.items()}
    r = {
        "steps": len(times["grpc"]),
        "grpc_step_ms": round(med["grpc"], 3),
        "rdma_device_step_ms": round(med["grpc+rdma_device"], 3),
        "ratio": round(med["grpc"] / med["grpc+rdma_device"], 2),
        "final_loss_grpc": float(losses["grpc"][-1]),
        "final_loss_rdma_device": float(losses["grpc+rdma_device"][-1]),
        "weights_bit_identical": bool(identical),
    }
    if args.json:
        print(json.dumps(r))
    else:
        print(f"parameter-server training (PS holds 3 MiB of weights; the worker reads them and pushes gradients every step), "
              f"{len(times['grpc'])} counted steps per protocol in interleaved blocks of {args.block} (+1 uncounted)")
        print(f"  median step: grpc {r['grpc_step_ms']:.2f} ms, grpc+rdma_device {r['rdma_device_step_ms']:.2f} ms, ratio {r['ratio']:.2f}")
        print(f"  final loss: grpc {r['final_loss_grpc']:.6f}, grpc+rdma_device {r['final_loss_rdma_device']:.6f}; "
              f"weights bit-identical: {r['weights_bit_identical']}")
        _print_transport(stats)
    return r


def main(argv=None):
    # Each of these modules adds its own subcommand (add_parser) and
    # returns the function that runs it.
    from rdma_device.bench import pybench, report, soak, suite, trace

    ap = argparse.ArgumentParser(prog="python -m rdma_device.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("transfer", help="task-to-task tensor transfer, grpc vs grpc+rdma_device")
    t.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="comma-separated sizes (K/M suffix)")
    t.add_argument("--reps", type=int, default=5, help="interleaved blocks per size and protocol")
    t.add_argument("--json", action="store_true", help="one JSON object per size")
    t.add_argument("--block", type=int, default=10,
                   help="steps per protocol before switching to the other; the first step after "
                        "each switch is run but not counted (default 10; 1 alternates every step, "
                        "which on a 2-vCPU machine charges each protocol with the other cluster's "
                        "after-step work)")
    t.add_argument("--no-strict", dest="strict", action="store_false",
                   help="allow fallback to gRPC (default: RDMA_DEVICE_STRICT=1 in the tasks)")
    r = sub.add_parser("train", help="short parameter-server training run under both protocols")
    r.add_argument("--steps", type=int, default=100, help="counted steps per protocol")
    r.add_argument("--block", type=int, default=10,
                   help="counted steps per protocol before switching (the first step after each switch "
                        "is run but not counted)")
    r.add_argument("--json", action="store_true")
    r.add_argument("--no-strict", dest="strict", action="store_false")
    run = {"transfer": transfer, "train": train, "suite": suite.add_parser(sub), "allreduce": allreduce}
    a = sub.add_parser("allreduce", help="MultiWorkerMirroredStrategy all-reduce, grpc vs grpc+rdma_device")
    a.add_argument("--sizes", default="1M,4M,16M,64M", help="comma-separated sizes (K/M suffix)")
    a.add_argument("--workers", default="2,3", help="comma-separated worker counts")
    a.add_argument("--reps", type=int, default=5, help="interleaved blocks per size and protocol")
    a.add_argument("--block", type=int, default=4, help="counted all-reduces per block")
    a.add_argument("--json", action="store_true", help="one JSON object per size and worker count")
    a.add_argument("--no-strict", dest="strict", action="store_false")
    for name, module in (("soak", soak), ("trace", trace), ("py", pybench), ("report", report)):
        run[name] = module.add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" in argv:  # anywhere on the line, for every subcommand
        argv.remove("--verbose")
        _quiet.set_verbose(True)
    _quiet.filter_stderr()
    args = ap.parse_args(argv)
    if args.cmd == "report":
        return run["report"](args)
    run[args.cmd](args)

