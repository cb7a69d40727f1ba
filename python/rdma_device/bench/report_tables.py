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


def _rng(cell, fmt="{:.2f}", bold=False, unit=""):
    """'median (min–max)'; with `unit`, 'median unit (min–max)'."""
    if cell is None:
        return "—"
    m = fmt.format(cell[0])
    m = f"{'**' + m + '**' if bold else m}{' ' + unit if unit else ''}"
    return f"{m} ({fmt.format(cell[1])}–{fmt.format(cell[2])})"


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


# The ratio over stock gRPC the project set as its goal for the suite's
# workloads; the suite's sentences count the rows that reach it.
GOAL = 1.3


def headroom_captured(grpc_ms, mode_ms, floor_ms):
    """(grpc − mode) / (grpc − floor): the share of what stock gRPC's step
    spends above the floor that a mode removes (1.0: down to the floor;
    above 1.0: below it). None where gRPC's step is not above the floor."""
    if not (grpc_ms and mode_ms and floor_ms) or grpc_ms <= floor_ms:
        return None
    return (grpc_ms - mode_ms) / (grpc_ms - floor_ms)


def _suite_per_run(rows, modes):
    """One run's rows -> one flat row per (workload, workers): each mode's
    step, the ratios to grpc+rdma_device's, the floor, gRPC over the floor
    and each transport mode's headroom captured."""
    by = {}
    for r in rows:
        if "mode" not in r or "step_ms" not in r:
            continue
        by.setdefault((r["workload"], r["workers"]), {})[r["mode"]] = r["step_ms"]
        if r["mode"] != "floor" and r["mode"] not in modes:
            modes.append(r["mode"])
    flat = []
    for (w, n), m in by.items():
        row = {"workload": w, "workers": n}
        for mode, ms in m.items():
            row[f"{mode} ms"] = ms
            if mode not in ("grpc+rdma_device", "floor") and m.get("grpc+rdma_device"):
                row[f"vs {mode}"] = ms / m["grpc+rdma_device"]
        if m.get("floor") and m.get("grpc"):
            row["grpc / floor"] = m["grpc"] / m["floor"]
            for mode in m:
                if mode not in ("grpc", "floor"):
                    row[f"headroom {mode}"] = headroom_captured(m["grpc"], m[mode], m["floor"])
        flat.append(row)
    return flat


def suite_md(runs):
    """Median step per workload and worker count for every mode, and the
    ratios of each other mode's step to grpc+rdma_device's, per run; the
    floor's step (the same step with every tensor kept on the task that
    produced it, on grpc+rdma_device), stock gRPC's step over it and each
    transport mode's headroom captured, (grpc − mode) / (grpc − floor), per
    run. Under the table, the sentences counted from it (``suite_claims``)."""
    modes = []
    per_run = [_suite_per_run(rows, modes) for rows in runs]
    agg = aggregate(per_run, lambda r: (r["workload"], r["workers"]))
    others = [m for m in modes if m != "grpc+rdma_device"]
    transports = [m for m in modes if m != "grpc"]
    rows = []
    for (w, n), d in agg.items():
        rows.append([w, str(n), " / ".join(_med(d.get(f"{m} ms"), "{:.1f}") for m in modes)]
                    + [_rng(d.get(f"vs {m}"), bold=True) for m in others]
                    + [_med(d.get("floor ms"), "{:.1f}"), _rng(d.get("grpc / floor"))]
                    + [_rng(_scaled(d.get(f"headroom {m}"), 100), "{:.0f}%") for m in transports])
    table = _table(["workload", "workers", "step ms " + " / ".join(modes)]
                   + [f"vs {m} (median, range)" for m in others]
                   + ["floor step ms", "grpc / floor (median, range)"]
                   + [f"headroom captured by {m} (median, range)" for m in transports],
                   ["---", "---:", "---:"] + ["---:"] * (len(others) + 2 + len(transports)), rows)
    claims = suite_claims(agg, modes)
    return table + ("\n\n" + "\n".join(claims) if claims else "")


def _scaled(cell, k):
    return None if cell is None else tuple(v * k for v in cell)


def _span(values, fmt, unit=""):
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def _by_workload(agg, field, fmt, unit=""):
    """"lo–hi over the N rows (w1 lo–hi, w2 …)" of the medians of ``field``."""
    vals = {}
    for (w, _), d in agg.items():
        if d.get(field) is not None:
            vals.setdefault(w, []).append(d[field][0])
    every = [v for vs in vals.values() for v in vs]
    rows = len(every)
    return (f"{_span(every, fmt, unit)} over the {rows} row{'s' if rows != 1 else ''} ("
            + ", ".join(f"{w} {_span(vs, fmt, unit)}" for w, vs in vals.items()) + ")")


def _workers(ns):
    ns = [str(n) for n in ns]
    return ns[0] if len(ns) == 1 else ", ".join(ns[:-1]) + " and " + ns[-1]


def suite_claims(agg, modes):
    """The sentences the documentation used to write by hand, counted from
    the table's cells (medians over the runs, before rounding): how many
    rows beat stock gRPC and reach GOAL, the ranges by workload, and the
    headroom captured."""
    out = []
    ratios = [((w, n), d["vs grpc"][0]) for (w, n), d in agg.items() if d.get("vs grpc")]
    if ratios:
        total = len(ratios)
        ahead = sum(r > 1 for _, r in ratios)
        short = {}
        for (w, n), r in ratios:
            if r < GOAL:
                short.setdefault(w, []).append((n, r))
        line = (f"- grpc+rdma_device's step was shorter than stock gRPC's on {ahead} of the {total} rows, and "
                f"at least {GOAL}× shorter on {total - sum(len(v) for v in short.values())} of the {total}")
        if short:
            line += ("; not on " + "; ".join(
                f"{w} with {_workers([n for n, _ in v])} worker{'s' if len(v) > 1 or v[0][0] != 1 else ''} "
                f"({', '.join(f'{r:.3f}' for _, r in v)})" for w, v in short.items()))
        out.append(line + ".")
        out.append("- vs grpc: " + _by_workload(agg, "vs grpc", "{:.2f}") + ".")
    for m in modes:
        if m not in ("grpc", "grpc+rdma_device") and any(d.get(f"vs {m}") for d in agg.values()):
            out.append(f"- vs {m}: " + _by_workload(agg, f"vs {m}", "{:.2f}") + ".")
    if any(d.get("grpc / floor") for d in agg.values()):
        out.append("- Stock gRPC's step over the floor's (the most any transport could gain here): "
                   + _by_workload(agg, "grpc / floor", "{:.2f}") + ".")
    for m in modes:
        field = f"headroom {m}"
        cells = {k: d[field][0] for k, d in agg.items() if d.get(field)}
        if m == "grpc" or not cells:
            continue
        pct = {k: {field: _scaled(d[field], 100)} for k, d in agg.items() if d.get(field)}
        line = f"- Headroom captured by {m}, (grpc − {m}) / (grpc − floor): " + _by_workload(pct, field, "{:.0f}", "%")
        below = sorted(k for k, v in cells.items() if v > 1)
        if below:
            line += (f"; its step was below the floor's on {len(below)} row{'s' if len(below) != 1 else ''} ("
                     + ", ".join(f"{w} {n}" for w, n in below) + ")")
        out.append(line + ".")
    none = sorted(k for k, d in agg.items() if d.get("floor ms") and not d.get("grpc / floor", (0,))[0] > 1)
    if none:
        out.append(f"- No headroom measured on {len(none)} row{'s' if len(none) != 1 else ''} (stock gRPC's "
                   "step not above the floor's): " + ", ".join(f"{w} {n}" for w, n in none) + ".")
    return out


def allocs_md(runs):
    """tests/python/test_allocs.py: heap allocations per step of each task,
    stock gRPC against grpc+rdma_device, and the shim's and the transport's
    shares of the latter (the transport's split into serving worker RPCs,
    threads' one-time set-up and the rest)."""
    agg = aggregate(runs, lambda r: r["task"])
    rows = []
    for task, d in agg.items():
        rows.append([task, _med(d.get("grpc"), "{:.1f}"), _med(d.get("rdma_device"), "{:.1f}"),
                     _rng(d.get("shim"), "{:.1f}"), _rng(d.get("transport"), "{:.1f}"),
                     " / ".join(_med(d.get(f), "{:.2f}") for f in ("transport_rpc", "transport_setup", "transport_other"))])
    return _table(["task", "grpc", "grpc+rdma_device", "of which the shim (median, range)",
                   "of which the transport (median, range)",
                   "transport: serving worker RPCs / thread set-up / the rest"],
                  ["---", "---:", "---:", "---:", "---:", "---:"], rows)


def trace_md(runs):
    """`bench trace`: its own tables (the step per mode over the runs, the
    first run's median timeline per size and its hand-offs)."""
    from rdma_device.bench.trace import markdown_tables

    return markdown_tables(runs)


RENDER = {"trace": trace_md, "allocs": allocs_md, "fabric": fabric_md, "transfer": transfer_md, "train": train_md, "allreduce": allreduce_md,
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
