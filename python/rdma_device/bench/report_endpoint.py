"""Tables of `bench report` for the endpoint API (no TensorFlow): `bench
py` and `examples/param_server.py`, each against the stock ways to move
arrays between Python processes. Cells as in report_tables: medians over
the runs of each run's own median, ratios the median of the per-run
ratios with their range."""

from rdma_device._units import size_label
from rdma_device.bench.report_tables import _med, _rng, _table, aggregate


def py_md(runs):
    """`bench py`: the endpoint API against each baseline, per size."""
    agg = aggregate(runs, lambda r: (r["kind"], r["size"], r["baseline"]))
    rows = []
    for (kind, size, base), d in agg.items():
        if kind == "ping":
            what = f"ping {size_label(size)}, one way"
            ours, theirs = _med(d.get("ours_latency_us"), "{:.1f} µs"), _med(d.get("baseline_latency_us"), "{:.1f} µs")
            cpu = (f"{_med(d.get('ours_cpu_us_per_roundtrip'), '{:.0f}')} / "
                   f"{_med(d.get('baseline_cpu_us_per_roundtrip'), '{:.0f}')} µs per round trip")
        else:
            what = f"stream {size_label(size)}"
            ours, theirs = _med(d.get("ours_gbps"), "{:.2f} GB/s"), _med(d.get("baseline_gbps"), "{:.2f} GB/s")
            cpu = (f"{_med(d.get('ours_cpu_s_per_gb'), '{:.2f}')} / "
                   f"{_med(d.get('baseline_cpu_s_per_gb'), '{:.2f}')} s per GB")
        rows.append([what, base, ours, theirs, _rng(d.get("ratio"), bold=True), cpu])
    return _table(["", "baseline", "ours", "baseline", "speed ours / baseline (median, range; above 1: ours faster)",
                   "CPU ours / baseline (both processes, every thread)"],
                  ["---", "---", "---:", "---:", "---:", "---:"], rows)


def param_server_md(runs):
    """examples/param_server.py: a NumPy parameter-server step, ours
    against each baseline, per model size."""
    agg = aggregate(runs, lambda r: (r["bytes"], r["baseline"]))
    rows = []
    for (nbytes, base), d in agg.items():
        same = all(r.get("identical") for rs in runs for r in rs if (r["bytes"], r["baseline"]) == (nbytes, base))
        rows.append([size_label(nbytes), base, _med(d.get("ours_step_ms"), "{:.2f} ms"),
                     _med(d.get("baseline_step_ms"), "{:.2f} ms"), _rng(d.get("ratio"), bold=True),
                     f"{_med(d.get('ours_cpu_ms'), '{:.2f}')} / {_med(d.get('baseline_cpu_ms'), '{:.2f}')} ms",
                     "yes" if same else "**no**"])
    return _table(["weights (and gradient)", "baseline", "ours: step", "baseline: step",
                   "baseline step / ours (median, range; above 1: ours faster)", "CPU per step ours / baseline",
                   "weights bit-identical"], ["---:", "---", "---:", "---:", "---:", "---:", "---"], rows)


RENDER = {"py": py_md, "py_rpc": py_md, "param_server": param_server_md}
