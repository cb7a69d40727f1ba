"""``python -m rdma_device.bench trace``: where a step's time goes, recorded.

A 2-task TF1 workload (a variable on the ps, ``reduce_sum`` of it on worker
0, so every received byte is read) runs a few steps per size with the
transport's timeline on in both tasks (``rdma_device.trace_enable``). The
spans of both tasks (the transport's: send, write, arrive, deliver,
release, ...; the shim's: tf:Send, tf:RecvFromRemote, RunGraph,
CleanupGraph) and the client's ``session.run`` are merged into one Chrome
trace (``--out``, open it in chrome://tracing or https://ui.perfetto.dev).

It also prints, per size, the median timeline of a traced step (when each
span starts and how long it lasts, from the start of ``session.run``), and
the untraced medians of the same step under stock ``grpc``, under
``grpc+rdma_device`` (and the same with its per-step worker RPCs over
gRPC, ``RDMA_DEVICE_WORKER_RPCS=0``), and with both ends on one task (no
tensor crosses tasks): what the transfer costs over the local step, and
which recorded span holds that time.

With ``--tensorboard DIR`` the tasks also record TensorFlow's profiler
during the traced steps (``DIR/<task>/plugins/profile/...``): the same
spans appear in TensorBoard's trace viewer, next to TensorFlow's ops.
"""

import copy
import json
import os
import statistics
import sys
import time

from rdma_device._cluster import LocalCluster
from rdma_device._units import parse_size, size_label

RPCS_OVER_GRPC = "grpc+rdma_device, worker RPCs over gRPC"

# Spans shown in the printed timeline, in the order a transfer meets them.
TIMELINE = (
    ("call:RunGraph", "/job:worker/task:0", "the master's RunGraph call to the ps, to its reply"),
    ("call in", "/job:ps/task:0", "the call read by the ps's reader thread"),
    ("serve", "/job:ps/task:0", "the call handed to TF's worker (on the reader thread; rdev-callbacks for a call not served inline)"),
    ("RunGraph", "/job:ps/task:0", "ps's partition (worker RPC)"),
    ("tf:Send", "/job:ps/task:0", "TF's Send → transport"),
    ("send", "/job:ps/task:0", "rdev send (queue the write)"),
    ("write", "/job:ps/task:0", "write into the receiver's slot"),
    ("arrive", "/job:worker/task:0", "receiver sees the write"),
    ("deliver", "/job:worker/task:0", "tensor handed to TF's Recv"),
    ("tf:RecvFromRemote", "/job:worker/task:0", "Recv posted → tensor in TF"),
    ("RunGraph", "/job:worker/task:0", "worker's partition (local RPC)"),
    ("release", "/job:worker/task:0", "slot released (credit)"),
    ("send_done", "/job:ps/task:0", "sender's done callback"),
    ("reply", "/job:ps/task:0", "the RunGraph reply written (by the thread that ended the partition)"),
    ("reply in", "/job:worker/task:0", "the reply read by the worker's reader thread"),
    ("call done", "/job:worker/task:0", "the reply handed to the master (on the reader thread; rdev-callbacks for a failure or a reply over 64 KiB)"),
)


# The hand-offs between spans on a step's path: (what, (span, task, edge),
# (span, task, edge)), edge "start" or "end"; the gap is the second point
# minus the first, in each traced step (the first span of each name in it).
W, P = "/job:worker/task:0", "/job:ps/task:0"
HANDOFFS = (
    ("the RunGraph call reaches the ps's reader thread", ("call:RunGraph", W, "start"), ("call in", P, "start")),
    ("the call read → TF's worker serves it (start to start: served on the reader thread)",
     ("call in", P, "start"), ("serve", P, "start")),
    ("served call → the ps's Send (TF's executor)", ("serve", P, "start"), ("tf:Send", P, "start")),
    ("Send → the write starts", ("tf:Send", P, "start"), ("write", P, "start")),
    ("write done → the receiver sees it (< 0: the doorbell rang before the write's span ended)",
     ("write", P, "end"), ("arrive", W, "start")),
    ("seen → handed to TF's Recv", ("arrive", W, "start"), ("deliver", W, "start")),
    ("handed over → the worker's partition ends (TF: consumer, end of step)", ("deliver", W, "end"), ("RunGraph", W, "end")),
    ("RunGraph reply written → read by the worker's reader thread", ("reply", P, "end"), ("reply in", W, "start")),
    ("the reply read → handed to the master (start to start: on the reader thread)",
     ("reply in", W, "start"), ("call done", W, "start")),
)


def handoffs(events, client_runs):
    """Per hand-off of HANDOFFS: the median, 10th and 90th percentile gap
    in µs over the traced steps ``client_runs``; and in how many of them
    the RunGraph reply reached the master after the worker's own
    partition ended (the reply on the step's critical path)."""
    names = _process_names(events)
    spans = [e for e in events if e.get("ph") == "X"]
    gaps = {what: [] for what, _, _ in HANDOFFS}
    late, steps = 0, 0
    for t0, t1 in client_runs:
        inside = [e for e in spans if t0 <= e["ts"] <= t1]

        def first(name, task):
            hit = [e for e in inside if e["name"] == name and names.get(e["pid"]) == task]
            return min(hit, key=lambda e: e["ts"]) if hit else None

        def at(point):
            e = first(point[0], point[1])
            return None if e is None else e["ts"] + (e["dur"] if point[2] == "end" else 0)

        for what, a, b in HANDOFFS:
            x, y = at(a), at(b)
            if x is not None and y is not None:
                gaps[what].append(y - x)
        done, part = at(("call done", W, "end")), at(("RunGraph", W, "end"))
        if done is not None and part is not None:
            steps += 1
            late += done > part
    rows = []
    for what, g in gaps.items():
        if g:
            g = sorted(g)
            rows.append({"handoff": what, "steps": len(g), "median_us": round(statistics.median(g), 1),
                         "p10_us": round(g[len(g) // 10], 1), "p90_us": round(g[len(g) * 9 // 10], 1)})
    return rows, {"reply_after_partition": late, "steps": steps}


def _timed(session, out, n):
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        session.run(out)
        t.append(time.perf_counter() - t0)
    return t


def _process_names(events):
    return {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}


def timeline(events, client_runs):
    """Median (start offset, duration) in µs of each TIMELINE span within
    the traced ``session.run`` calls ``client_runs`` ([(t0_us, t1_us)]),
    and the median session.run time. A span counts for the run whose
    interval holds its start; the first of its kind per run is taken."""
    names = _process_names(events)
    spans = [e for e in events if e.get("ph") == "X"]
    rows = []
    for name, task, what in TIMELINE:
        offs, durs = [], []
        for t0, t1 in client_runs:
            hit = [e for e in spans if e["name"] == name and names.get(e["pid"]) == task and t0 <= e["ts"] <= t1]
            if hit:
                first = min(hit, key=lambda e: e["ts"])
                offs.append(first["ts"] - t0)
                durs.append(first["dur"])
        if offs:
            rows.append({"span": name, "task": task, "what": what, "runs": len(offs),
                         "start_us": round(statistics.median(offs), 1), "dur_us": round(statistics.median(durs), 1)})
    step = statistics.median([t1 - t0 for t0, t1 in client_runs]) if client_runs else 0.0
    return rows, step


def record(args):
    """One measurement: the untraced steps of every mode, then the traced
    ones; writes the Chrome trace (and the plot) and returns the results."""
    import tensorflow as tf

    from rdma_device.bench.sweep import transfer_graph

    tf.compat.v1.disable_eager_execution()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    log_dir = args.log_dir
    env = {"RDMA_DEVICE_STRICT": "1"}
    clusters = {
        "grpc": LocalCluster("grpc", {"ps": 1, "worker": 1}, log_dir=log_dir, name="trace-grpc"),
        "grpc+rdma_device": LocalCluster("grpc+rdma_device", {"ps": 1, "worker": 1}, env=env, log_dir=log_dir,
                                         name="trace-rdma"),
        # The same transport with the per-step worker RPCs over gRPC: what
        # moving them onto the transport buys, measured in the same run.
        RPCS_OVER_GRPC: LocalCluster("grpc+rdma_device", {"ps": 1, "worker": 1},
                                     env=dict(env, RDMA_DEVICE_WORKER_RPCS="0"), log_dir=log_dir,
                                     name="trace-rdma-rpcs-grpc"),
    }
    rdma = clusters["grpc+rdma_device"]
    events, results = [], []
    client_pid = os.getpid()
    events.append({"ph": "M", "name": "process_name", "pid": client_pid, "tid": 0, "args": {"name": "client"}})
    try:
        for size in sizes:
            sess = {}
            for mode, c in clusters.items():
                g, init, out = transfer_graph(tf, c.device("ps", 0), c.device("worker", 0), size)
                s = tf.compat.v1.Session(c.target(), graph=g)
                s.run(init)
                sess[mode] = (s, out)
            # The same step with both ends on one task: nothing crosses tasks.
            g, init, out = transfer_graph(tf, rdma.device("worker", 0), rdma.device("worker", 0), size)
            s = tf.compat.v1.Session(rdma.target(), graph=g)
            s.run(init)
            sess["one task"] = (s, out)
            untraced = {m: [] for m in sess}
            for _ in range(args.blocks):
                for m, (s, out) in sess.items():
                    s.run(out)  # absorbs the switch
                    untraced[m] += _timed(s, out, args.steps)
            # Traced steps (the transport's timeline and the client's runs).
            s, out = sess["grpc+rdma_device"]
            for _ in range(3):
                s.run(out)
            rdma.trace(True)
            if args.tensorboard:
                rdma._ask("profile_start " + os.path.abspath(os.path.join(args.tensorboard, size_label(size))))
            runs = []
            for _ in range(args.steps):
                t0 = time.time_ns()
                s.run(out)
                t1 = time.time_ns()
                runs.append((t0 / 1000.0, t1 / 1000.0))
                events.append({"ph": "X", "cat": "client", "name": f"session.run {size_label(size)}", "pid": client_pid,
                               "tid": 1, "ts": t0 / 1000.0, "dur": (t1 - t0) / 1000.0, "args": {"bytes": size}})
            if args.tensorboard:
                rdma._ask("profile_stop")
            rdma.trace(False)
            got = rdma.trace_take()
            events += got
            rows, traced_step = timeline(got, runs)
            hand, reply = handoffs(got, runs)
            for s, _ in sess.values():
                s.close()
            med = {m: statistics.median(t) * 1e3 for m, t in untraced.items()}
            results.append({"size": size, "step_ms": {m: round(v, 3) for m, v in med.items()},
                            "over_one_task_ms": {m: round(med[m] - med["one task"], 3)
                                                 for m in ("grpc", "grpc+rdma_device", RPCS_OVER_GRPC)},
                            "traced_step_us": round(traced_step, 1), "timeline": rows,
                            "handoffs": hand, "reply": reply,
                            "spans": sum(1 for e in got if e.get("ph") == "X")})
    finally:
        for c in clusters.values():
            c.close()
    with open(args.out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns",
                   "otherData": {"tool": "python -m rdma_device.bench trace", "sizes": sizes}}, f)
    if args.plot:
        plot_steps(events, results, args.plot)
    return results


def plot_steps(events, results, path):
    """One traced step per size (the one closest to the median
    session.run), its spans as bars on a row per task and span: the
    picture of where the step's time goes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _process_names(events)
    spans = [e for e in events if e.get("ph") == "X"]
    colors = {"RunGraph": "#4c72b0", "CleanupGraph": "#8172b3", "tf:Send": "#dd8452", "send": "#e6a06b",
              "write": "#c44e52", "arrive": "#55a868", "deliver": "#2a9d8f", "tf:RecvFromRemote": "#b0b0b0",
              "release": "#937860", "send_done": "#da8bc3", "recv": "#8c8c8c", "call:RunGraph": "#64b5cd",
              "call in": "#8ecfe0", "serve": "#4c9fb0", "reply": "#ccb974", "reply in": "#e0d08a",
              "call done": "#a8963c", "Credit": "#a07850"}
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.6 * len(results) + 0.6), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        runs = sorted((e for e in spans if e["name"] == f"session.run {size_label(r['size'])}"), key=lambda e: e["dur"])
        if not runs:
            continue
        run = runs[len(runs) // 2]
        t0, t1 = run["ts"], run["ts"] + run["dur"]
        inside = [e for e in spans if e["pid"] != run["pid"] and t0 <= e["ts"] <= t1]
        rows = [("client", "session.run")] + sorted({(names.get(e["pid"], "?"), e["name"]) for e in inside},
                                                    key=lambda k: (k[0], min(x["ts"] for x in inside if (names.get(x["pid"]), x["name"]) == k)))
        for y, (task, name) in enumerate(rows):
            bars = [run] if task == "client" else [e for e in inside if names.get(e["pid"]) == task and e["name"] == name]
            for e in bars:
                ax.barh(y, max(e["dur"], (t1 - t0) / 400), left=e["ts"] - t0, color=colors.get(name, "#4c4c4c"),
                        edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{t.replace('/job:', '')}  {n}" for t, n in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, (t1 - t0) * 1.02)
        ax.set_xlabel("µs from the start of session.run", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        sm = r["step_ms"]
        ax.set_title(f"{size_label(r['size'])}: one traced step ({run['dur']:.0f} µs); untraced medians "
                     f"{sm['grpc+rdma_device']:.2f} ms grpc+rdma_device, {sm['grpc']:.2f} ms grpc, "
                     f"{sm['one task']:.2f} ms on one task", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("Where a 2-task step's time goes (python -m rdma_device.bench trace)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(results, out, plot_path=""):
    for r in results:
        sm, over = r["step_ms"], r["over_one_task_ms"]
        print(f"\n== {size_label(r['size'])}: median step {sm['grpc']:.3f} ms grpc, {sm['grpc+rdma_device']:.3f} ms "
              f"grpc+rdma_device, {sm['one task']:.3f} ms on one task (untraced)")
        print(f"   over the one-task step: grpc +{over['grpc']:.3f} ms, grpc+rdma_device "
              f"+{over['grpc+rdma_device']:.3f} ms (with its worker RPCs over gRPC: {sm[RPCS_OVER_GRPC]:.3f} ms, "
              f"+{over[RPCS_OVER_GRPC]:.3f} ms)")
        print(f"   traced grpc+rdma_device step ({r['spans']} spans): session.run {r['traced_step_us']:.0f} µs; "
              "median timeline from its start:")
        print(f"   {'span':<20} {'task':<20} {'start µs':>9} {'dur µs':>8}  what")
        for t in r["timeline"]:
            print(f"   {t['span']:<20} {t['task']:<20} {t['start_us']:>9.1f} {t['dur_us']:>8.1f}  {t['what']}")
        print(f"   hand-offs, µs per traced step (median [10th–90th percentile]); the RunGraph reply reached the "
              f"master after the worker's partition ended in {r['reply']['reply_after_partition']} of "
              f"{r['reply']['steps']} steps:")
        for h in r["handoffs"]:
            print(f"   {h['median_us']:>8.1f} [{h['p10_us']:.0f}–{h['p90_us']:.0f}]  {h['handoff']}")
    print(f"\nChrome trace: {out} (chrome://tracing or https://ui.perfetto.dev)")
    if plot_path:
        print(f"Picture of one step per size: {plot_path}")


def _med_range(xs, fmt="{:.2f}"):
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}–{fmt.format(max(xs))}]"


def markdown_tables(runs):
    """The README's tables from ``runs`` (each one run's results): per
    size, the median over runs of each mode's median step, the cost over
    the one-task step and the step ratios, with the runs' range in
    brackets; then the first run's median timeline per size."""
    lines = ["| size | step ms: grpc / grpc+rdma_device / its worker RPCs over gRPC / one task "
             "| over one task ms: grpc / grpc+rdma_device / worker RPCs over gRPC | vs grpc | vs worker RPCs over gRPC |",
             "|---:|---:|---:|---:|---:|"]
    for i, r0 in enumerate(runs[0]):
        per = [run[i] for run in runs]
        step = {m: statistics.median(r["step_ms"][m] for r in per) for m in r0["step_ms"]}
        over = {m: [r["over_one_task_ms"][m] for r in per] for m in r0["over_one_task_ms"]}
        vs_grpc = [r["step_ms"]["grpc"] / r["step_ms"]["grpc+rdma_device"] for r in per]
        vs_rpcs = [r["step_ms"][RPCS_OVER_GRPC] / r["step_ms"]["grpc+rdma_device"] for r in per]
        lines.append(f"| {size_label(r0['size'])} | {step['grpc']:.2f} / {step['grpc+rdma_device']:.2f} / "
                     f"{step[RPCS_OVER_GRPC]:.2f} / {step['one task']:.2f} | {_med_range(over['grpc'])} / "
                     f"**{_med_range(over['grpc+rdma_device'])}** / {_med_range(over[RPCS_OVER_GRPC])} | "
                     f"{_med_range(vs_grpc)} | {_med_range(vs_rpcs)} |")
    for r in runs[0]:
        lines += ["", f"{size_label(r['size'])}, the first run's median traced step (`session.run` "
                      f"{r['traced_step_us']:.0f} µs):", "",
                  "| span | task | start µs | duration µs |", "|---|---|---:|---:|"]
        for t in r["timeline"]:
            lines.append(f"| {t['span']} | {t['task'].replace('/job:', '')} | "
                         f"{t['start_us']:.0f} | {t['dur_us']:.0f} |")
    lines += ["", "Hand-offs, the first run's traced steps (µs per step: median [10th–90th percentile]):", "",
              "| hand-off | " + " | ".join(size_label(r["size"]) for r in runs[0]) + " |",
              "|---|" + "---:|" * len(runs[0])]
    for i, (what, _, _) in enumerate(HANDOFFS):
        cells = []
        for r in runs[0]:
            h = next((h for h in r["handoffs"] if h["handoff"] == what), None)
            cells.append("–" if h is None else f"{h['median_us']:.0f} [{h['p10_us']:.0f}–{h['p90_us']:.0f}]")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    lines.append("| steps whose RunGraph reply reached the master after the worker's partition ended | "
                 + " | ".join(f"{r['reply']['reply_after_partition']} of {r['reply']['steps']}" for r in runs[0]) + " |")
    return "\n".join(lines)


def add_parser(sub):
    t = sub.add_parser("trace", help="record where a 2-task step's time goes; write a Chrome trace")
    t.add_argument("--out", default="rdma_device_trace.json", help="Chrome trace file to write")
    t.add_argument("--sizes", default="4K,1M,16M")
    t.add_argument("--steps", type=int, default=20, help="steps per block and traced steps per size")
    t.add_argument("--blocks", type=int, default=3, help="interleaved untraced blocks per mode")
    t.add_argument("--plot", default="", help="also draw one traced step per size into this PNG")
    t.add_argument("--tensorboard", default="", help="also record TensorFlow's profiler into this directory")
    t.add_argument("--log-dir", default=None, help="task logs here instead of stderr")
    t.add_argument("--runs", type=int, default=1,
                   help="repeat the whole measurement; the trace, picture and profile come from the first run")
    t.add_argument("--markdown", action="store_true",
                   help="print the tables of the README's 'Where a step's time goes' (medians over --runs)")
    t.add_argument("--json", action="store_true")
    return trace


def trace(args):
    """``bench trace``: --runs measurements; prints the first one's summary,
    the tables over all (--markdown), or every run's rows (--json)."""
    runs = []
    for i in range(max(1, args.runs)):
        a = args
        if i:
            # Later runs measure only: the files are the first run's.
            a = copy.copy(args)
            a.out, a.plot, a.tensorboard = os.devnull, "", ""
            print(f"run {i + 1} of {args.runs}", file=sys.stderr, flush=True)
        runs.append(record(a))
    if args.json:
        for i, results in enumerate(runs):
            for r in results:
                print(json.dumps(dict(r, run=i)))
    elif args.markdown:
        print(markdown_tables(runs))
    else:
        print_summary(runs[0], args.out, args.plot)
