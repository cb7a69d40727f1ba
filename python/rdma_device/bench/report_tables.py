"""Tables of `bench report`: medians and ranges over runs, in Markdown,
and the README's generated regions.

Every cell is the median over the runs of that run's own number (each
benchmark already reports medians within a run); a ratio is the median of
the per-run ratios, with their range (min-max), never a ratio of medians,
so the printed ratio is one some run actually measured.
"""

import re
import statistics

from rdma_device._units import size_label


def _stat(values):
    vals = [v for v in values if isinstance(v, (int, float))]
    if not vals:
        return None
    return statistics.median(vals), min(vals), max(vals)


def aggregate(runs, key):
    """runs: [[row, ...] per run] -> {key: {field: (median, min, max)}},
    keys in first-seen order; `n` counts the runs that had the key."""
    out = {}
    for rows in runs:
        for row in rows:
            k = key(row)
            out.setdefault(k, {"_rows": []})["_rows"].append(row)
    for k, d in out.items():
        rows = d.pop("_rows")
        fields = dict.fromkeys(f for r in rows for f in r)
        for f in fields:
            s = _stat([r.get(f) for r in rows])
            if s is not None:
                d[f] = s
        d["n"] = len(rows)
    return out


def _med(cell, fmt="{:.2f}"):
    return "—" if cell is None else fmt.format(cell[0])


def _rng(cell, fmt="{:.2f}", bold=False):
    if cell is None:
        return "—"
    m = fmt.format(cell[0])
    return f"{'**' + m + '**' if bold else m} ({fmt.format(cell[1])}–{fmt.format(cell[2])})"


def _table(header, align, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _us(cell):
    if cell is None:
        return "—"
    return f"{cell[0]:.2f} µs" if cell[0] < 1000 else f"{cell[0] / 1000:.1f} ms"


def fabric_md(runs):
    agg = aggregate(runs, lambda r: r["size"])
    rows = []
    for size, d in agg.items():
        threads = int(d["memcpy_threads"][0]) if "memcpy_threads" in d else 1
        rows.append([size_label(size), _med(d.get("gbps")), f"{_med(d.get('memcpy_gbps'))} ({threads} thr)",
                     _rng(d.get("ratio"), bold=True), _med(d.get("memcpy1_gbps")), _rng(d.get("ratio1")),
                     _us(d.get("p50_us")), _us(d.get("p99_us"))])
    return _table(["size", "write GB/s", "memcpy GB/s (threads as the write)", "ratio (median, range)",
                   "1-thread memcpy GB/s", "ratio to 1 thread", "one-way p50", "p99"],
                  ["---:"] * 8, rows)


def transfer_md(runs):
    agg = aggregate(runs, lambda r: r["size"])
    rows = []
    for size, d in agg.items():
        rows.append([size_label(size), _med(d.get("grpc_ms")) + " ms", _med(d.get("rdma_device_ms")) + " ms",
                     _rng(d.get("ratio"), bold=True), _med(d.get("grpc_gbps")), _med(d.get("rdma_device_gbps")),
                     f"{_med(d.get('grpc_cpu_s_per_gb'))} / {_med(d.get('rdma_device_cpu_s_per_gb'))}",
                     f"{_med(d.get('first_step_grpc_ms'), '{:.1f}')} / {_med(d.get('first_step_rdma_device_ms'), '{:.1f}')}"
                     f" / {_med(d.get('first_step_rdma_device_traced_ms'), '{:.1f}')} ms"])
    return _table(["size", "grpc", "grpc+rdma_device", "ratio (median, range)", "grpc GB/s", "rdma_device GB/s",
                   "CPU s/GB grpc / rdma_device", "first step grpc / static / traced"], ["---:"] * 8, rows)


def train_md(runs):
    d = aggregate(runs, lambda r: "train").get("train", {})
    same = all(r.get("weights_bit_identical") for rows in runs for r in rows)
    return _table(["steps", "grpc step", "grpc+rdma_device step", "ratio (median, range)", "weights bit-identical"],
                  ["---:", "---:", "---:", "---:", "---"],
                  [[_med(d.get("steps"), "{:.0f}"), _med(d.get("grpc_step_ms")) + " ms",
                    _med(d.get("rdma_device_step_ms")) + " ms", _rng(d.get("ratio"), bold=True),
                    "yes, every run" if same else "**no**"]])


def allreduce_md(runs):
    agg = aggregate(runs, lambda r: (r["workers"], r["size"]))
    rows = []
    for (n, size), d in agg.items():
        rows.append([str(n), size_label(size), _med(d.get("grpc_ms")) + " ms", _med(d.get("rdma_ms")) + " ms",
                     _rng(d.get("ratio"), bold=True), f"{_med(d.get('grpc_gbps'))} / {_med(d.get('rdma_gbps'))}",
                     f"{_med(d.get('grpc_cpu_ms'), '{:.1f}')} / {_med(d.get('rdma_cpu_ms'), '{:.1f}')}"])
    return _table(["workers", "size", "grpc", "grpc+rdma_device", "ratio (median, range)",
                   "GB/s grpc / rdma_device", "CPU ms per all-reduce grpc / rdma_device"], ["---:"] * 7, rows)


def soak_md(runs):
    d = aggregate(runs, lambda r: "soak").get("soak", {})
    lost = sum(r.get("lost", 0) for rows in runs for r in rows)
    corrupt = sum(r.get("corrupt", 0) for rows in runs for r in rows)
    fallback = sum(r.get("fallback_tensors", 0) for rows in runs for r in rows)
    # Steps that failed and were run again (the kill of worker:1 makes at
    # least one), and their failed attempts: shown, never hidden behind
    # the retry.
    retried = sum(r.get("retried_steps", 0) for rows in runs for r in rows)
    failed = sum(r.get("failed_attempts", 0) for rows in runs for r in rows)
    return _table(["steps", "tensors / moves per run", "lost / corrupt (all runs)",
                   "steps retried / failed attempts (all runs)",
                   "fallback to gRPC (all runs)",
                   "RSS growth after the baseline (median, range)", "private memory growth", "seconds per run"],
                  ["---:"] * 8,
                  [[_med(d.get("steps"), "{:.0f}"),
                    f"{_med(d.get('tensors'), '{:,.0f}')} / {_med(d.get('hops'), '{:,.0f}')}",
                    f"**{lost} / {corrupt}**", f"{retried} / {failed}", str(fallback), _rng(d.get("rss_growth_pct"), "{:+.1f}%"),
                    _rng(d.get("rss_anon_growth_pct"), "{:+.1f}%"), _rng(d.get("seconds"), "{:.0f}")]])


def suite_md(runs):
    """Median step per workload and worker count for every mode, and the
    ratios of each other mode's step to grpc+rdma_device's, per run; then
    the compute-only step (the same graph with every variable on the worker
    that uses it: no tensor crosses tasks) and the ceiling it sets, stock
    gRPC's step over it: what a transport that moved every tensor for free
    would reach against gRPC."""
    per_run = []
    modes = []
    for rows in runs:
        by = {}
        compute = {}
        for r in rows:
            if "mode" not in r or "step_ms" not in r:
                continue
            key = (r["workload"], r["workers"])
            by.setdefault(key, {})[r["mode"]] = r["step_ms"]
            if r.get("compute_ms"):
                compute[key] = r["compute_ms"]
            if r["mode"] not in modes:
                modes.append(r["mode"])
        flat = []
        for (w, n), m in by.items():
            row = {"workload": w, "workers": n}
            for mode, ms in m.items():
                row[f"{mode} ms"] = ms
                if mode != "grpc+rdma_device" and m.get("grpc+rdma_device"):
                    row[f"vs {mode}"] = ms / m["grpc+rdma_device"]
            c = compute.get((w, n))
            if c:
                row["compute ms"] = c
                if m.get("grpc"):
                    row["ceiling"] = m["grpc"] / c
            flat.append(row)
        per_run.append(flat)
    agg = aggregate(per_run, lambda r: (r["workload"], r["workers"]))
    others = [m for m in modes if m != "grpc+rdma_device"]
    rows = []
    for (w, n), d in agg.items():
        rows.append([w, str(n), " / ".join(_med(d.get(f"{m} ms"), "{:.1f}") for m in modes)]
                    + [_rng(d.get(f"vs {m}"), bold=True) for m in others]
                    + [_med(d.get("compute ms"), "{:.1f}"), _rng(d.get("ceiling"))])
    return _table(["workload", "workers", "step ms " + " / ".join(modes)] + [f"vs {m} (median, range)" for m in others]
                  + ["compute-only step ms", "ceiling vs grpc: grpc / compute-only (median, range)"],
                  ["---", "---:", "---:"] + ["---:"] * (len(others) + 2), rows)


RENDER = {"fabric": fabric_md, "transfer": transfer_md, "train": train_md, "allreduce": allreduce_md,
          "soak": soak_md, "suite": suite_md}


def marker(name, end=False):
    return f"<!-- report:{name} {'end' if end else 'begin'} -->"


def replace_region(text, name, body):
    """text with the region between NAME's markers replaced by body, or
    None when the markers are missing."""
    pat = re.compile(re.escape(marker(name)) + r"\n.*?" + re.escape(marker(name, True)), re.S)
    if not pat.search(text):
        return None
    return pat.sub(lambda _: f"{marker(name)}\n{body}\n{marker(name, True)}", text, count=1)
