"""`python -m rdma_device.bench trace`: the recorded timeline of a 2-task
step is all there, in both tasks, with the right sizes: one write of each
step's tensor on the ps, its arrival and delivery on worker 0, and the
worker RPCs (RunGraph) on both tasks; the Chrome trace file is valid and
names every process; the picture is drawn. No time is asserted (speed
belongs to benchmarks); what is asserted is what a reader of the trace
relies on.
"""

import json
import os
import subprocess
import sys

import rdma_device

STEPS = 4
SIZES = (4 << 10, 1 << 20)


def test_bench_trace_records_both_tasks(tmp_path, plugin_built):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(rdma_device.__file__)))
    cmd = [sys.executable, "-m", "rdma_device.bench", "trace", "--out", str(out), "--plot", str(png),
           "--sizes", "4K,1M", "--steps", str(STEPS), "--blocks", "1", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["size"] for r in rows] == list(SIZES)
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert {"client", "/job:ps/task:0", "/job:worker/task:0"} <= set(names.values()), names
    spans = [e for e in events if e.get("ph") == "X"]
    by = lambda name, task: [e for e in spans if e["name"] == name and names[e["pid"]] == task]  # noqa: E731
    ps, w0 = "/job:ps/task:0", "/job:worker/task:0"
    # Exactly one write per traced step, of the step's tensor, from the ps.
    writes = by("write", ps)
    assert sorted(e["args"]["bytes"] for e in writes) == sorted([s for s in SIZES for _ in range(STEPS)]), writes
    assert len(by("arrive", w0)) == len(writes) and len(by("deliver", w0)) == len(writes)
    assert len(by("tf:Send", ps)) == len(writes) and len(by("tf:RecvFromRemote", w0)) == len(writes)
    # Each traced step ran a partition on each task (the worker RPCs).
    assert len(by("RunGraph", ps)) == len(writes) and len(by("RunGraph", w0)) == len(writes)
    # Every span of a step lies in its session.run, in causal order.
    runs = sorted((e for e in spans if e["name"].startswith("session.run")), key=lambda e: e["ts"])
    assert len(runs) == len(writes)
    for w in writes:
        run = next(r for r in runs if r["ts"] <= w["ts"] <= r["ts"] + r["dur"])
        arrive = min((e for e in by("arrive", w0) if e["ts"] >= w["ts"]), key=lambda e: e["ts"])
        assert arrive["ts"] <= run["ts"] + run["dur"], "the arrival belongs to the same step"
    for r in rows:
        assert {t["span"] for t in r["timeline"]} >= {"write", "arrive", "deliver", "RunGraph"}, r
    assert png.stat().st_size > 10_000
