"""The suite's outputs: ``results.json`` (one row per workload, workers and
mode), ``transfer.json`` (the sweep), ``summary.md`` and colour PNG plots
(matplotlib, Agg backend; no display needed). Runs on the client thread
after every measurement is done.
"""

import json
import os
import platform

from rdma_device._units import size_label

COLOURS = {"grpc": "#d62728", "grpc+rdma_device": "#1f77b4", "rpc": "#ff7f0e", "memcpy": "#7f7f7f",
           "floor": "#bcbcbc"}
LABELS = {"grpc": "stock gRPC", "grpc+rdma_device": "grpc+rdma_device",
          "rpc": "RPC over the same fabric (RDMA_DEVICE_MODE=rpc)", "memcpy": "memcpy (1 thread)",
          "floor": "floor (no tensor crosses tasks)"}


def _kib(n):
    return f"{n / 1024:.1f}"


def _by(rows, **kw):
    return [r for r in rows if all(r[k] == v for k, v in kw.items())]


def _ratio(a, b):
    return f"{a / b:.2f}" if a and b else "—"


def _pct(x):
    return "—" if x is None else f"{x * 100:.0f}%"


def summary_md(res, machine):
    rows, modes = res["rows"], res["modes"]
    out = [f"# rdma_device evaluation suite ({res['date']}, {machine})", "",
           "Median step times, modes interleaved in blocks in one run. floor = the same step with every "
           "tensor kept on the task that produced it (each task reads its own copy of what it would "
           "receive), run on grpc+rdma_device; comm = step − floor; headroom captured = (grpc − mode) / "
           "(grpc − floor). Tensors per step come from the transport's counters (rdma_device modes and "
           "the floor) or from the partition graphs (grpc); CPU is the CPU time of the mode's task "
           "processes and the client, per counted step.", "",
           "| workload | workers | mode | samples/s | step ms | floor ms | comm ms | vs grpc | vs rpc "
           "| headroom captured | tensors/step | MB/step | avg tensor KiB | median KiB | CPU ms/step |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = _by(rows, workload=r["workload"], workers=r["workers"], mode="grpc")
        rpc = _by(rows, workload=r["workload"], workers=r["workers"], mode="rpc")
        out.append(
            f"| {r['workload']} | {r['workers']} | {r['mode']} | {r['samples_per_s']:.1f} | {r['step_ms']:.2f} "
            f"| {r['floor_ms']:.2f} | {r['comm_ms']:.2f} "
            f"| {_ratio(base[0]['step_ms'], r['step_ms']) if base else '—'} "
            f"| {_ratio(rpc[0]['step_ms'], r['step_ms']) if rpc else '—'} "
            f"| {_pct(r.get('headroom_captured'))} "
            f"| {r['tensors_per_step']:.1f} | {r['bytes_per_step'] / 1e6:.2f} | {_kib(r['avg_tensor_bytes'])} "
            f"| {_kib(r['median_tensor_bytes'])} | {r['cpu_s_per_step'] * 1e3:.1f} |")
    floors = _by(rows, mode="floor")
    if floors:
        out += ["", "The floor's tasks read " + ", ".join(
            f"{r['copied_tensors']} tensors ({r['copied_bytes'] / 1e6:.2f} MB) for {r['workload']} with "
            f"{r['workers']} worker{'s' if r['workers'] != 1 else ''}" for r in floors)
            + " from copies of their own, each the value it had in one step of the cross-task graph."]
    out += breakdown_md(rows)
    if res.get("sweep"):
        out += ["", "Transfer sweep (ps → worker, consumer `reduce_sum` reads every byte):", "",
                "| size | mode | step ms | GB/s | CPU s/GB | memcpy GB/s |", "|---:|---|---:|---:|---:|---:|"]
        for s in res["sweep"]:
            out.append(f"| {size_label(s['size'])} | {s['mode']} | {s['step_ms']:.2f} | {s['gbps']:.2f} "
                       f"| {s['cpu_s_per_gb']:.2f} | {s['memcpy_gbps']:.1f} |")
    if "rpc" not in modes:
        out += ["", "The rpc mode was not run: the installed transport has no RDMA_DEVICE_MODE setting."]
    out += ["", f"Suite wall time: {res['seconds']:.0f} s."]
    return "\n".join(out) + "\n"


def breakdown_md(rows):
    """The measured breakdown of the transport modes' traced steps (see
    ``breakdown``); stock gRPC is not traced."""
    from rdma_device.bench.breakdown import COMPONENTS, LABELS as PARTS

    traced = [r for r in rows if r.get("breakdown")]
    if not traced:
        return []
    out = ["", "Where a step's time goes, measured (`rdma_device.bench.breakdown`: a traced block of steps per "
           "transport mode after the timed ones; medians of each component over the traced steps, ms; the "
           "critical partition is the one that ended last; stock gRPC has no spans, see comm above):", "",
           "| workload | workers | mode | traced step | " + " | ".join(PARTS[c] for c in COMPONENTS)
           + " | critical partition |", "|---|---:|---|---:|" + "---:|" * len(COMPONENTS) + "---|"]
    for r in traced:
        b = r["breakdown"]
        out.append(f"| {r['workload']} | {r['workers']} | {r['mode']} | {b['traced_step_ms']:.2f} | "
                   + " | ".join(f"{b[c]:.2f}" for c in COMPONENTS)
                   + f" | {b['critical_task'].replace('/job:', '')} |")
    return out


def cpus_and_kernel():
    cpus = os.cpu_count()
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    return f"{cpus} vCPUs {model}, {platform.system()} {platform.release()}".strip()


def _grid(n):
    cols = min(3, n)
    return (n + cols - 1) // cols, cols


def plots(res, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, modes = res["rows"], res["modes"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    written = []

    def save(fig, name, rect=(0, 0, 1, 1)):
        fig.tight_layout(rect=rect)
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)

    def at_workers(w):
        ns = sorted({r["workers"] for r in _by(rows, workload=w)})
        return 2 if 2 in ns else ns[-1]

    # 1. throughput per workload, by mode, and the floor's
    nr, nc = _grid(len(workloads))
    fig, axes = plt.subplots(nr, nc, figsize=(max(4 * nc, 7), 3 * nr), squeeze=False)
    bars = modes + ["floor"]
    for ax, w in zip(axes.flat, workloads):
        n = at_workers(w)
        vals = [(_by(rows, workload=w, workers=n, mode=m) or [{"samples_per_s": 0}])[0]["samples_per_s"] for m in bars]
        ax.bar(range(len(bars)), vals, color=[COLOURS[m] for m in bars])
        ax.set_xticks(range(len(bars)), [m.replace("grpc+", "grpc+\n") for m in bars], fontsize=8)
        ax.set_title(f"{w} ({n} workers)", fontsize=10)
        ax.set_ylabel("samples/s")
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    fig.suptitle("Training throughput by transport (higher is better)")
    save(fig, "throughput.png")

    # 2. where the step goes: measured components for the transport modes,
    # floor + (step - floor) for stock gRPC, which has no spans
    from rdma_device.bench.breakdown import COMPONENTS, LABELS as PARTS

    part_colours = {"client_master": "#9e9e9e", "dispatch": "#8172b3", "waiting_for_sender": "#dd8452",
                    "in_transport": "#c44e52", "partition_other": "#2ca02c"}
    fig_h = 3.2 * nr + 1.0  # + room for the legend below the plots
    fig, axes = plt.subplots(nr, nc, figsize=(max(4.5 * nc, 8), fig_h), squeeze=False)
    for ax, w in zip(axes.flat, workloads):
        n = at_workers(w)
        for x, m in enumerate(modes):
            r = (_by(rows, workload=w, workers=n, mode=m) or [None])[0]
            if not r:
                continue
            b = r.get("breakdown")
            if b:
                bottom = 0.0
                for c in COMPONENTS:
                    ax.bar(x, b[c], bottom=bottom, color=part_colours[c], edgecolor="black", linewidth=0.3)
                    bottom += b[c]
            else:
                ax.bar(x, r["floor_ms"], color="#2ca02c", edgecolor="black", linewidth=0.3)
                ax.bar(x, r["comm_ms"], bottom=r["floor_ms"], color="white", edgecolor=COLOURS[m],
                       hatch="//", linewidth=0.8)
            ax.plot([x - 0.45, x + 0.45], [r["step_ms"]] * 2, color="black", linewidth=1.2)
        ax.set_xticks(range(len(modes)), [m.replace("grpc+", "grpc+\n") for m in modes], fontsize=8)
        ax.set_title(f"{w} ({n} workers)", fontsize=10)
        ax.set_ylabel("ms per step")
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=part_colours[c], edgecolor="black", label=PARTS[c]) for c in COMPONENTS]
    handles += [Patch(facecolor="white", edgecolor=COLOURS["grpc"], hatch="//",
                      label="stock gRPC, untraced: step − floor"),
                Patch(facecolor="black", label="untraced median step (line)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle("Where a step's time goes: measured from recorded spans (median traced step per component)",
                 fontsize=11)
    save(fig, "breakdown.png", rect=(0, 1.0 / fig_h, 1, 1 - 0.35 / fig_h))

    # 3. transfer sweep
    if res.get("sweep"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        sizes = sorted({s["size"] for s in res["sweep"]})
        for m in modes:
            pts = [(s["size"], s["gbps"]) for s in res["sweep"] if s["mode"] == m]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLOURS[m], label=LABELS[m])
        mc = {s["size"]: s["memcpy_gbps"] for s in res["sweep"]}
        ax.plot(sizes, [mc[s] for s in sizes], "s--", color=COLOURS["memcpy"], label=LABELS["memcpy"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB" for s in sizes])
        ax.set_xlabel("tensor size")
        ax.set_ylabel("GB/s (log)")
        ax.set_title("Task-to-task transfer, consumer reads every byte")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "transfer.png")

    # 4. scaling with workers
    fig, axes = plt.subplots(nr, nc, figsize=(max(4 * nc, 7), 3 * nr), squeeze=False)
    for ax, w in zip(axes.flat, workloads):
        for m in modes:
            pts = sorted((r["workers"], r["samples_per_s"]) for r in _by(rows, workload=w, mode=m))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLOURS[m], label=m)
        ns = sorted({r["workers"] for r in _by(rows, workload=w)})
        ax.set_xticks(ns)
        ax.set_xlabel("workers (1 ps)")
        ax.set_ylabel("samples/s")
        ax.set_title(w, fontsize=10)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Scaling with workers (2 vCPUs shared by all tasks)" if os.cpu_count() <= 2 else "Scaling with workers")
    save(fig, "scaling.png")

    # 5. tensor-size histogram per workload
    fig, axes = plt.subplots(nr, nc, figsize=(max(4 * nc, 7), 3 * nr), squeeze=False)
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    bins = [2 ** k for k in range(2, 28)]
    for i, (ax, w) in enumerate(zip(axes.flat, workloads)):
        r = _by(rows, workload=w, workers=at_workers(w), mode=modes[0])[0]
        sizes = [max(s, 4) for s in r["tensor_sizes"]]
        ax.hist(sizes, bins=bins, color=palette[i % len(palette)])
        ax.set_xscale("log", base=2)
        ax.set_xticks([2 ** 4, 2 ** 10, 2 ** 16, 2 ** 22], ["16 B", "1 KiB", "64 KiB", "4 MiB"])
        ax.set_title(f"{w}: {len(sizes)} tensors/step, avg {_kib(r['avg_tensor_bytes'])} KiB", fontsize=9)
        ax.set_xlabel("tensor size")
        ax.set_ylabel("tensors")
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    fig.suptitle("Sizes of the tensors crossing tasks per step (from the partition graphs)")
    save(fig, "tensor_sizes.png")

    # 6. CPU cost per step
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(modes)
    for j, m in enumerate(modes):
        vals = [(_by(rows, workload=w, workers=at_workers(w), mode=m) or [{"cpu_s_per_step": 0}])[0]["cpu_s_per_step"] * 1e3
                for w in workloads]
        ax.bar([i + j * width for i in range(len(workloads))], vals, width, color=COLOURS[m], label=m)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(workloads))], workloads, fontsize=8)
    ax.set_ylabel("CPU ms per step (tasks + client)")
    ax.set_title("CPU cost per training step, 2 workers (lower is better)")
    ax.legend(fontsize=8)
    save(fig, "cpu.png")
    return written


def mwms_md(rows):
    if not rows:
        return ""
    out = ["", "## MultiWorkerMirroredStrategy (ring all-reduce of the gradients every step)", "",
           "| workload | workers | weights MiB | step ms grpc / rdma_device | vs grpc | CPU ms/step grpc / rdma_device "
           "| collective MB/step over the transport | fallback chunks | weights bit-identical |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['workload']} | {r['workers']} | {r['weights_mib']} | {r['grpc_step_ms']} / "
                   f"{r['rdma_device_step_ms']} | {r['ratio']} | {r['grpc_cpu_ms']} / {r['rdma_device_cpu_ms']} "
                   f"| {r['collective_mb_per_step']} | {r['collective_fallback']} | {r['weights_bit_identical']} |")
    return "\n".join(out) + "\n"


def write(res, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    mach = cpus_and_kernel()
    res.setdefault("date", __import__("time").strftime("%Y-%m-%d"))
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(res["rows"], f, indent=1)
    with open(os.path.join(out_dir, "transfer.json"), "w") as f:
        json.dump(res.get("sweep", []), f, indent=1)
    with open(os.path.join(out_dir, "mwms.json"), "w") as f:
        json.dump(res.get("mwms", []), f, indent=1)
    md = summary_md(res, mach) + mwms_md(res.get("mwms", []))
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(md)
    pngs = plots(res, out_dir)
    return md, pngs
