"""The suite's further tables in `bench report`, from every run of it:
where a step's time goes (the traced breakdown), the transfer sweep and
MultiWorkerMirroredStrategy. Cells are medians over the runs; a ratio is
the median of the per-run ratios with their range, as in report_tables.

The suite writes the sweep and MWMS rows to transfer.json and mwms.json
in its --out directory (the run's raw directory here); the breakdown is
part of its rows on stdout.
"""

import json
import os
from collections import Counter

from rdma_device._units import size_label
from rdma_device.bench.report_tables import _med, _rng, _table, aggregate

# Block name -> the benchmark whose runs it comes from (its header, its
# command and its staleness are that benchmark's).
EXTRAS = {"suite_breakdown": "suite", "suite_sweep": "suite", "suite_mwms": "suite"}


def breakdown_table(runs):
    """Per traced (workload, workers, mode): the traced step and each
    measured component (ms), and the partition that ended last in most
    runs."""
    from rdma_device.bench.breakdown import COMPONENTS, LABELS

    per_run, critical = [], {}
    for rows in runs:
        flat = []
        for r in rows:
            b = r.get("breakdown")
            if not b:
                continue
            key = (r["workload"], r["workers"], r["mode"])
            flat.append({"key": key, "traced_step_ms": b.get("traced_step_ms"), **{c: b.get(c) for c in COMPONENTS}})
            critical.setdefault(key, Counter())[str(b.get("critical_task", "?")).replace("/job:", "")] += 1
        per_run.append(flat)
    agg = aggregate(per_run, lambda r: r["key"])
    if not agg:
        return None
    rows = []
    for key, d in agg.items():
        (task, k), = critical[key].most_common(1)
        rows.append([key[0], str(key[1]), key[2], _rng(d.get("traced_step_ms"))]
                    + [_med(d.get(c)) for c in COMPONENTS]
                    + [f"{task} ({k} of {d['n']})"])
    return _table(["workload", "workers", "mode", "traced step ms (median, range)"]
                  + [f"{LABELS[c]} ms" for c in COMPONENTS] + ["critical partition (runs)"],
                  ["---", "---:", "---"] + ["---:"] * (1 + len(COMPONENTS)) + ["---"], rows)


def sweep_table(sweeps):
    """sweeps: per run, the suite's transfer sweep rows ({size, mode,
    step_ms, gbps, cpu_s_per_gb, memcpy_gbps}). Per size: each mode's step,
    stock gRPC's step over each other mode's (per run), GB/s, CPU s/GB and
    memcpy."""
    modes, per_run = [], []
    for rows in sweeps:
        by = {}
        for s in rows:
            by.setdefault(s["size"], {})[s["mode"]] = s
            if s["mode"] not in modes:
                modes.append(s["mode"])
        flat = []
        for size, m in by.items():
            row = {"size": size, "memcpy_gbps": next(iter(m.values())).get("memcpy_gbps")}
            for mode, s in m.items():
                row[f"{mode} ms"], row[f"{mode} gbps"], row[f"{mode} cpu"] = s["step_ms"], s["gbps"], s["cpu_s_per_gb"]
                if mode != "grpc" and m.get("grpc") and s["step_ms"]:
                    row[f"vs {mode}"] = m["grpc"]["step_ms"] / s["step_ms"]
            flat.append(row)
        per_run.append(flat)
    agg = aggregate(per_run, lambda r: r["size"])
    if not agg:
        return None
    others = [m for m in modes if m != "grpc"]
    rows = []
    for size in sorted(agg):
        d = agg[size]
        rows.append([size_label(size), " / ".join(_med(d.get(f"{m} ms")) for m in modes)]
                    + [_rng(d.get(f"vs {m}"), bold=True) for m in others]
                    + [" / ".join(_med(d.get(f"{m} gbps")) for m in modes),
                       " / ".join(_med(d.get(f"{m} cpu")) for m in modes), _med(d.get("memcpy_gbps"), "{:.1f}")])
    return _table(["size", "step ms " + " / ".join(modes)]
                  + [f"grpc / {m} (median, range)" for m in others]
                  + ["GB/s " + " / ".join(modes), "CPU s/GB " + " / ".join(modes), "memcpy GB/s"],
                  ["---:"] * (5 + len(others)), rows)


def mwms_table(runs):
    """runs: per run, the suite's MWMS rows."""
    agg = aggregate(runs, lambda r: (r["workload"], r["workers"]))
    if not agg:
        return None
    same = all(r.get("weights_bit_identical") for rows in runs for r in rows)
    rows = []
    for (w, n), d in agg.items():
        rows.append([w, str(n), _med(d.get("weights_mib")),
                     f"{_med(d.get('grpc_step_ms'))} / {_med(d.get('rdma_device_step_ms'))}",
                     _rng(d.get("ratio"), bold=True),
                     f"{_med(d.get('grpc_cpu_ms'), '{:.1f}')} / {_med(d.get('rdma_device_cpu_ms'), '{:.1f}')}",
                     _med(d.get("collective_mb_per_step")),
                     str(max(int(r.get("collective_fallback", 0)) for rows in runs for r in rows
                             if (r["workload"], r["workers"]) == (w, n))),
                     "yes, every run" if same else "**no**"])
    return _table(["workload", "workers", "weights MiB", "step ms grpc / grpc+rdma_device", "ratio (median, range)",
                   "CPU ms/step grpc / grpc+rdma_device", "collective MB/step over the transport",
                   "fallback chunks (most in a run)", "weights bit-identical"],
                  ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---"], rows)


def _raw(out, records, name):
    """Each completed suite run's `name` (transfer.json, mwms.json) from its
    raw directory; runs without the file count as none."""
    got = []
    for r in records:
        if r["bench"] != "suite" or "error" in r:
            continue
        path = os.path.join(out, "raw", f"suite-{r['run']}", name)
        try:
            with open(path) as f:
                rows = json.load(f)
        except (OSError, ValueError):
            continue
        if rows:
            got.append(rows)
    return got


def tables(records, out):
    """The extra blocks of the completed suite runs: {name: table}."""
    runs = [r["rows"] for r in records if r["bench"] == "suite" and "error" not in r]
    found = {"suite_breakdown": breakdown_table(runs), "suite_sweep": sweep_table(_raw(out, records, "transfer.json")),
             "suite_mwms": mwms_table(_raw(out, records, "mwms.json"))}
    return {k: v for k, v in found.items() if v}
