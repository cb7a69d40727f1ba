"""A short soak (the bench's `soak` command) on a real 3-task cluster: random
shapes and dtypes, a checksum per hop, worker:1 killed with SIGKILL and
restarted halfway. Nothing may be lost or corrupted, and the tensors must
have gone over the transport (not a gRPC fallback). Also: the soak's
checksum detects corruption and allocates no tensor-sized temporaries from
TensorFlow's CPU allocator (whose pool keeps its high-water mark, so such
temporaries made the soak's RSS grow on any transport)."""

import json
import os
import subprocess
import sys

import rdma_device

STEPS = 300
# Private memory (RssAnon) of the three tasks from the baseline (step 30)
# to the end: under 5%, the soak's goal. The tasks run with glibc's mmap
# threshold fixed at its default 128 KiB (`GLIBC_TUNABLES`, below): by
# default glibc raises that threshold to the size of every large block
# freed (up to 32 MiB), so after the first tensor-sized frees later
# tensors come from malloc's heaps, which keep their high-water mark; over
# 300 steps that made +12.8%, +16.7% and +14.8% on this tree (and +33.2%,
# +35.2% on stock gRPC), still rising, while with the threshold fixed
# freed tensors go back to the kernel and the growth is +0.9% and +0.8%
# (stock gRPC: +0.1%): what the tasks hold, not what malloc caches. A task that kept every
# tensor it received would add ~0.8 MB a step, ~240 MB over 300 steps:
# about +30%.
ANON_GROWTH_PCT_MAX = 5.0
SOAK_MALLOC = "glibc.malloc.mmap_threshold=131072"
# Total RSS per task at the end (arena pages a task touched included; 776-
# 823 MiB measured, against ~620 MiB after the first step).
TASK_RSS_MB_MAX = 1024.0


def _env():
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(rdma_device.__file__))
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


_CHECKSUM_CHECK = r"""
import json
import numpy as np
import tensorflow as tf
from rdma_device.bench.soak import _checksum

tf.compat.v1.disable_eager_execution()
g = tf.Graph()
with g.as_default():
    x = tf.compat.v1.placeholder(tf.float64, [None])
    before = set(op.name for op in g.get_operations())
    c = _checksum(tf, x)
    ops = set(op.name for op in g.get_operations()) - before
    x2 = tf.compat.v1.placeholder(tf.float64, [None, None])
    c2 = _checksum(tf, x2)
    b = tf.compat.v1.placeholder(tf.bool, [None])
    cb = _checksum(tf, b)
v = np.random.default_rng(0).uniform(-1e3, 1e3, 1 << 21)  # 16 MiB, the soak's largest
flipped = v.copy()
flipped[12345] = np.nextafter(flipped[12345], 0.0)  # one bit of one element
swapped = v.copy()
swapped[[7, 8]] = swapped[[8, 7]]
with tf.compat.v1.Session(graph=g) as s:
    md = tf.compat.v1.RunMetadata()
    full = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    ref = s.run(c, {x: v}, options=full, run_metadata=md)
    largest = 0
    for dev in md.step_stats.dev_stats:
        for n in dev.node_stats:
            if n.node_name not in ops:
                continue
            for o in n.output:
                largest = max(largest, o.tensor_description.allocation_description.requested_bytes)
            for m in n.memory:
                largest = max(largest, m.peak_bytes)
    print(json.dumps(dict(
        ops_traced=sum(n.node_name in ops for dev in md.step_stats.dev_stats for n in dev.node_stats),
        largest_allocation=largest,
        same=bool(s.run(c, {x: v.copy()}) == ref),
        flipped=bool(s.run(c, {x: flipped}) != ref),
        swapped=bool(s.run(c, {x: swapped}) != ref),
        reshaped=bool(s.run(c2, {x2: v.reshape(2, -1)}) != ref),
        bools=bool(s.run(cb, {b: [True, False]}) != s.run(cb, {b: [False, True]})),
    )))
"""


def test_soak_checksum_detects_corruption_without_large_temporaries():
    p = subprocess.run([sys.executable, "-c", _CHECKSUM_CHECK], env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["same"] and r["flipped"] and r["swapped"] and r["reshaped"] and r["bools"], r
    # The earlier checksum (bytes cast to int64, weighted by position)
    # allocated 128 MiB at once for this 16 MiB tensor, 944 MiB in all.
    assert r["ops_traced"] > 0, r
    assert r["largest_allocation"] <= 1 << 20, r


def _retried_steps_are_reported(r):
    """The soak reports the steps it ran again (a retry hides nothing): as
    many as the distinct steps its failed attempts name (every failed
    attempt's error is kept while there are at most 5), the kill step
    among them."""
    assert len(r["errors"]) == r["failed_attempts"] <= 5, r["errors"]
    named = {e.split(":")[0] for e in r["errors"]}
    assert r["retried_steps"] == len(named), (r["retried_steps"], r["errors"])
    assert f"step {r['restarted_at_step']}" in named, (r["restarted_at_step"], r["errors"])


def test_soak_random_tensors_with_worker_restart(plugin_built):
    env = _env()
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), SOAK_MALLOC) if t)
    p = subprocess.run([sys.executable, "-m", "rdma_device.bench", "soak", "--steps", str(STEPS), "--json",
                        "--step-timeout-ms", "30000"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(r, indent=1))
    assert r["steps"] == STEPS
    assert r["tensors"] == STEPS * r["lanes"]
    assert r["lost"] == 0, r["errors"]
    assert r["corrupt"] == 0
    assert r["restarted_at_step"] == STEPS // 2
    # The step that met the dead worker failed and was retried; at most a
    # few attempts fail around the restart.
    assert 1 <= r["failed_attempts"] <= 3, r["errors"]
    _retried_steps_are_reported(r)
    # Every tensor moved 3 times between tasks, over the transport: counters
    # of ps and worker:0 cover the whole run, worker:1's its second life.
    assert r["tensors_pushed"] >= r["hops"]
    assert r["fallback_tensors"] == 0
    assert r["arena_bytes_in_use_end"] > 0
    assert r["rss_anon_growth_pct"] < ANON_GROWTH_PCT_MAX, r
    for task, points in r["rss_mb_by_task"].items():
        assert points["end"] < TASK_RSS_MB_MAX, (task, r["rss_mb_by_task"])


def test_soak_worker_killed_mid_stream(plugin_built):
    """Issue 18: worker:1 is SIGKILLed while the ps streams a tensor to it
    (an 8 MiB arena, so 16 MiB tensors stream in chunks): the step that
    meets it fails and is retried, nothing is lost or corrupted, no
    survivor crashes (the soak goes on to its last step), nothing falls
    back to gRPC."""
    steps = 60
    p = subprocess.run([sys.executable, "-m", "rdma_device.bench", "soak", "--steps", str(steps), "--json",
                        "--arena", "8M", "--kill-mid-stream", "--step-timeout-ms", "30000"],
                       env=dict(_env(), RDMA_DEVICE_LOG="warn"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # The tasks' own account of a failure: every warning and error of the
    # transport but the arena's (expected: the arena is made too small).
    said = [line for line in p.stderr.splitlines()
            if ("WARN" in line or "ERROR" in line) and "rdma_device" in line
            and "receive arena" not in line]
    why = (f"{r['kill']}; step errors:\n" + "\n".join(r["errors"])
           + "\ntasks said:\n" + "\n".join(said[-40:]))
    assert r["lost"] == 0 and r["corrupt"] == 0, why
    assert r["tensors"] == steps * r["lanes"]
    assert r["restarted_at_step"] == steps // 2
    # Killed inside the step, after the ps had begun streaming to it.
    # (A run of that step that streams and ends between two polls of the
    # ps's counters is run again: `missed` counts them.)
    assert r["kill"]["step_still_running"], why
    assert r["kill"]["ps_stream_chunks_before_kill"] >= 1, why
    assert 1 <= r["failed_attempts"] <= 3, why
    _retried_steps_are_reported(r)
    assert r["inline_tensors"] > 0, "nothing streamed: the arena was not small enough"
    assert r["fallback_tensors"] == 0
