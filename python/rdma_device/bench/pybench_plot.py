"""Table and plot of ``python -m rdma_device.bench py`` (see pybench)."""

from rdma_device._units import size_label

COLORS = {"rdma_device": "#d62728", "shared_memory+pipe": "#1f77b4", "gloo": "#2ca02c",
          "tensorpipe_rpc": "#9467bd", "memcpy": "#7f7f7f"}


def table(rows, cfg, prod_stats, cons_stats):
    lines = [f"Endpoint API vs stock inter-process transports: 2 processes, {cfg['reps']} "
             "interleaved blocks per size and baseline, medians; ratio = ours / baseline"]
    lines.append("")
    lines.append("ping-pong (one array there and back; latency = half the round trip)")
    lines.append(f"{'size':>8} {'baseline':>20} {'ours us':>9} {'base us':>9} {'ratio':>6} "
                 f"{'ours CPU us/rt':>15} {'base CPU us/rt':>15}")
    for r in rows:
        if r["kind"] == "ping":
            lines.append(f"{size_label(r['size']):>8} {r['baseline']:>20} {r['ours_latency_us']:9.1f} "
                         f"{r['baseline_latency_us']:9.1f} {r['ratio']:6.2f} "
                         f"{r['ours_cpu_us_per_roundtrip']:15.1f} "
                         f"{r['baseline_cpu_us_per_roundtrip']:15.1f}")
    lines.append("")
    lines.append("stream (consumer touches every byte; CPU = both processes, every thread)")
    lines.append(f"{'size':>8} {'baseline':>20} {'ours GB/s':>10} {'base GB/s':>10} {'ratio':>6} "
                 f"{'ours CPU s/GB':>14} {'base CPU s/GB':>14} {'memcpy GB/s':>12}")
    for r in rows:
        if r["kind"] == "stream":
            lines.append(f"{size_label(r['size']):>8} {r['baseline']:>20} {r['ours_gbps']:10.2f} "
                         f"{r['baseline_gbps']:10.2f} {r['ratio']:6.2f} "
                         f"{r['ours_cpu_s_per_gb']:14.3f} {r['baseline_cpu_s_per_gb']:14.3f} "
                         f"{r['memcpy_gbps']:12.2f}")
    lines.append("")
    lines.append("transport counters: producer pushed {} arrays / {} bytes, consumer received "
                 "{} / {} bytes, fallback {}, chunked {}".format(
                     prod_stats["tensors_pushed"], prod_stats["bytes_pushed"],
                     cons_stats["tensors_received"], cons_stats["bytes_received"],
                     prod_stats["fallback_tensors"] + cons_stats["fallback_tensors"],
                     cons_stats["stream_chunks"]))
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    stream = [r for r in rows if r["kind"] == "stream"]
    sizes = sorted({r["size"] for r in stream})
    series = {"rdma_device": {r["size"]: r["ours_gbps"] for r in stream},
              "memcpy": {r["size"]: r["memcpy_gbps"] for r in stream}}
    for r in stream:
        series.setdefault(r["baseline"], {})[r["size"]] = r["baseline_gbps"]
    for name, pts in series.items():
        style = "--" if name == "memcpy" else "-o"
        label = "memcpy (one thread, np.copyto)" if name == "memcpy" else name
        ax1.plot(sizes, [pts[s] for s in sizes], style, color=COLORS.get(name), label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(sizes, [size_label(s) for s in sizes])
    ax1.set_yscale("log")
    ax1.set_xlabel("array size")
    ax1.set_ylabel("GB/s (median; consumer touches every byte)")
    ax1.set_title("stream of arrays, process to process")
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    ping = [r for r in rows if r["kind"] == "ping"]
    psizes = sorted({r["size"] for r in ping})
    lat = {"rdma_device": {r["size"]: r["ours_latency_us"] for r in ping}}
    for r in ping:
        lat.setdefault(r["baseline"], {})[r["size"]] = r["baseline_latency_us"]
    width = 0.8 / max(1, len(lat))
    for i, (name, pts) in enumerate(lat.items()):
        xs = [j + i * width for j in range(len(psizes))]
        ax2.bar(xs, [pts[s] for s in psizes], width, color=COLORS.get(name), label=name)
    ax2.set_xticks([j + width * (len(lat) - 1) / 2 for j in range(len(psizes))],
                   [size_label(s) for s in psizes])
    ax2.set_yscale("log")
    top = max(v for pts in lat.values() for v in pts.values())
    ax2.set_ylim(top=top * 30)  # room for the legend above the bars
    ax2.set_ylabel("one-way latency, us (half a round trip, median)")
    ax2.set_title("ping-pong")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
