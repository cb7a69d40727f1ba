"""Heap allocations per step in real TensorFlow tasks, stock "grpc" against
"grpc+rdma_device": every task (chief client, worker, ps) runs under an
LD_PRELOAD allocation counter (malloc_count/malloc_count.c, built here),
which counts malloc, posix_memalign, operator new and the rest per call
stack. Four variables (4 KiB to 4 MiB) cross ps -> worker and four sums
worker -> chief every step. After warm-up steps the test snapshots every
task, runs counted steps, snapshots again, and attributes each new
allocation to the first frame outside the allocator, libc, libstdc++ and
libgcc: the shim (librdma_device_tf.so) by function, the transport
(librdma_device.so), TensorFlow, gRPC and so on by library.

Prints a table per protocol; asserts that the counter saw every task's
allocations (so a zero below is a measurement, not a blind spot) and that
the transport library allocates nothing per tensor in the steady state
(docs/design.md, "The tensor path allocates nothing", here with the shim and
TensorFlow around it and several edges at once)."""

import collections
import glob
import json
import os
import shutil
import signal
import struct
import subprocess
import time

import pytest

import harness
import tf_fingerprint

WARMUP, STEPS = 20, 50
DEPTH = 8
RECORD = struct.Struct(f"<{3 + DEPTH}Q")
# Frames that only pass an allocation on: attribution starts past them.
PASS_THROUGH = ("libmalloc_count.so", "libc.so", "libstdc++.so", "libgcc_s.so", "ld-linux")
SHIM, CORE = "librdma_device_tf.so", "librdma_device.so"


@pytest.fixture(scope="module")
def counter_lib(tmp_path_factory):
    return harness.build_preload(tmp_path_factory, "malloc_count", "the allocation counter")


def _read_snapshot(prefix, pid, n):
    with open(f"{prefix}.{pid}.{n}.bin", "rb") as f:
        data = f.read()
    recs = [RECORD.unpack_from(data, i) for i in range(0, len(data), RECORD.size)]
    dropped = recs[0][1]
    stacks = {r[0]: (r[1], r[2], r[3:]) for r in recs[1:]}
    maps = []
    with open(f"{prefix}.{pid}.{n}.maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "x" in fields[1]:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                maps.append((lo, hi, int(fields[2], 16), fields[5].strip()))
    return dropped, stacks, maps


def _snapshot(tasks, prefix, n, timeout=60):
    for t in tasks:
        os.kill(t.proc.pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    for t in tasks:
        while not os.path.exists(f"{prefix}.{t.proc.pid}.{n}.done"):
            assert time.monotonic() < deadline, f"{t.name} wrote no snapshot {n} within {timeout}s"
            time.sleep(0.05)


def _attribute(pcs, maps):
    """(library, path, file offsets) of the first frame that is not a
    pass-through and of the frames after it in the same library, or
    ("?", None, ())."""
    found = None
    offsets = []
    for pc in pcs:
        if pc == 0:
            break
        hit = next(((lo, off, path) for lo, hi, off, path in maps if lo <= pc < hi), None)
        if hit is None:
            break
        lib = os.path.basename(hit[2])
        if found is None:
            if lib.startswith(PASS_THROUGH):
                continue
            found = (lib, hit[2])
        elif lib != found[0]:
            break
        offsets.append(pc - hit[0] + hit[1])
    return (found[0], found[1], tuple(offsets)) if found else ("?", None, ())


def _symbolize(path, offsets):
    """File offsets -> "function (file:line)" through addr2line."""
    segs = tf_fingerprint.pt_loads(path)
    vaddr = {}
    for off in offsets:
        vaddr[off] = next((off - o + v for o, v, n, _ in segs if o <= off < o + n), off)
    if not offsets or shutil.which("addr2line") is None:
        return {a: hex(vaddr[a]) for a in offsets}
    # -i would list inlined frames too; the outermost function names the site.
    out = subprocess.run(["addr2line", "-f", "-C", "-e", path] + [hex(vaddr[a] - 1) for a in offsets],
                         capture_output=True, text=True, timeout=120).stdout.splitlines()
    names = {}
    for i, a in enumerate(offsets):
        fn = out[2 * i] if 2 * i < len(out) else "?"
        line = out[2 * i + 1] if 2 * i + 1 < len(out) else "?"
        names[a] = f"{fn[:140]} ({os.path.basename(line.split(' ')[0])})"
    return names


def _measure(protocol, lib, log_dir, tmp_path):
    prefix = str(tmp_path / protocol.replace("+", "_"))
    env = {"LD_PRELOAD": lib, "MALLOC_COUNT_PREFIX": prefix, "RDMA_DEVICE_STRICT": "1"}
    cluster = harness.make_cluster({"chief": 1, "worker": 1, "ps": 1})
    servers = harness.start_tasks([dict(role="server", cluster=cluster, job=job, task=0, protocol=protocol)
                                   for job in ("worker", "ps")], log_dir, env)
    client = harness.Task(dict(role="alloc_scenarios.marked_steps", cluster=cluster, job="chief", task=0,
                               protocol=protocol, warmup=WARMUP, steps=STEPS), log_dir, env)
    tasks = [client] + servers
    try:
        client.wait_ready()
        client.expect("MARK1", 300)
        _snapshot(tasks, prefix, 0)
        client.proc.stdin.write("go\n")
        client.proc.stdin.flush()
        client.expect("MARK2", 300)
        _snapshot(tasks, prefix, 1)
        client.proc.stdin.write("go\n")
        client.proc.stdin.flush()
        result = client.result(120)
    finally:
        for t in tasks:
            t.close()
    per_task = {}
    for t, name in zip(tasks, ("chief", "worker", "ps")):
        _, before, _ = _read_snapshot(prefix, t.proc.pid, 0)
        dropped, after, maps = _read_snapshot(prefix, t.proc.pid, 1)
        assert dropped == 0, f"{name}: {dropped} stacks did not fit the counter's table"
        by_lib = collections.Counter()
        shim_sites = collections.Counter()
        core_sites = collections.Counter()
        paths = {}
        for key, (calls, _, pcs) in after.items():
            new = calls - before.get(key, (0, 0, None))[0]
            if new <= 0:
                continue
            lib_name, path, frames = _attribute(pcs, maps)
            by_lib[lib_name] += new
            if lib_name in (SHIM, CORE):
                paths[lib_name] = path
                (shim_sites if lib_name == SHIM else core_sites)[frames] += new
        per_task[name] = dict(by_lib=by_lib, shim=shim_sites, core=core_sites, paths=paths)
    return result, per_task


# A thread's first wait on a contended lock sets up its parking record for
# the thread's whole life (parking_lot's ThreadData, inside the transport
# library): one allocation per thread, which a busy machine can delay into
# the counted steps (each of TensorFlow's pool threads meets our locks for
# the first time at some step). Not a per-tensor allocation. The record is
# a thread-local, so the same first wait can also register the thread-local's
# destructor with the standard library (register_dtor, under a parking_lot
# lock call): once per thread too.
THREAD_SETUP = ("parking_lot::ThreadData", "parking_lot::with_thread_data", "parking_lot::grow_hashtable",
                "parking_lot::HashTable")
THREAD_LOCAL_DTOR = "thread_local::native::lazy"

# The worker RPCs a task serves over the transport (RunGraph and
# CleanupGraph bodies in, replies out): allocations per call, not per
# tensor. The ps serves them once the master has a connection with it.
RPC_SERVING = ("on_call_msg", "call_part", "rpc_reply", "rdev_serve_reply")


def _inlined(path, offsets):
    """File offsets -> every function at that address, inlined ones
    included (addr2line -i), as one string."""
    segs = tf_fingerprint.pt_loads(path)
    vaddr = {off: next((off - o + v for o, v, n, _ in segs if o <= off < o + n), off) for off in offsets}
    if not offsets or shutil.which("addr2line") is None:
        return {a: "" for a in offsets}
    out = subprocess.run(["addr2line", "-a", "-f", "-C", "-i", "-e", path] + [hex(vaddr[a] - 1) for a in offsets],
                         capture_output=True, text=True, timeout=120).stdout.splitlines()
    groups, cur = [], None
    for line in out:
        if line.startswith("0x"):
            cur = []
            groups.append(cur)
        elif cur is not None:
            cur.append(line)
    return {a: " ".join(groups[i]) if i < len(groups) else "" for i, a in enumerate(offsets)}


def _rpc_serving(path, sites):
    """The allocation sites of `sites` made serving worker RPCs (any frame,
    inlined ones included, in the RPC code)."""
    if not sites:
        return collections.Counter()
    names = _inlined(path, sorted({a for frames in sites for a in frames}))
    return collections.Counter({frames: n for frames, n in sites.items()
                                if any(k in names[a] for a in frames for k in RPC_SERVING)})


def _thread_setup(path, sites):
    """The allocation sites of `sites` that set up a thread's parking record."""
    if not sites:
        return collections.Counter()
    names = _symbolize(path, sorted({a for frames in sites for a in frames}))
    def setup(frames):
        syms = [names[a] for a in frames]
        if any(k in s for s in syms for k in THREAD_SETUP):
            return True
        # The thread-local's destructor registration, made by a parking_lot
        # lock call: the innermost frames are the standard library's
        # thread-local machinery, the first one outside it is parking_lot.
        outside = next((s for s in syms if not s.startswith(("alloc::", "core::", "std::", "<()"))
                        and THREAD_LOCAL_DTOR not in s), "")
        return any(THREAD_LOCAL_DTOR in s for s in syms) and "parking_lot" in outside
    return collections.Counter({frames: n for frames, n in sites.items() if setup(frames)})


def _report(protocol, result, per_task):
    per_step = result["tensors_per_step"]
    print(f"\n== {protocol}: heap allocations per step over {STEPS} steps "
          f"({per_step} tensors cross tasks per step)")
    for name, t in per_task.items():
        total = sum(t["by_lib"].values())
        top = ", ".join(f"{lib} {n / STEPS:.1f}" for lib, n in t["by_lib"].most_common(6))
        print(f"  {name}: {total / STEPS:.1f} per step; by caller: {top}")
        for label, sites in (("shim", t["shim"]), ("transport", t["core"])):
            if not sites:
                continue
            lib = SHIM if label == "shim" else CORE
            names = _symbolize(t["paths"][lib], sorted({a for frames in sites for a in frames}))
            funcs = collections.Counter()
            for frames, n in sites.items():
                # The first frame of our own code: Rust's allocation
                # wrappers (alloc::, core::, std::) are generic.
                own = [names[a] for a in frames if names[a].startswith("rdma_device") or "rdma_device::" in names[a]]
                funcs[(own or [names[frames[0]]])[0]] += n
            print(f"    {label} ({lib}): {sum(sites.values()) / STEPS:.2f} per step, "
                  f"{sum(sites.values()) / STEPS / per_step:.2f} per tensor")
            for fn, n in funcs.most_common(12):
                print(f"      {n / STEPS:7.2f}/step  {fn}")


def test_allocations_per_step_grpc_vs_rdma_device(counter_lib, log_dir, tmp_path, plugin_built):
    results = {}
    for protocol in (harness.PROTOCOL_GRPC, harness.PROTOCOL_RDMA):
        result, per_task = _measure(protocol, counter_lib, log_dir, tmp_path)
        _report(protocol, result, per_task)
        results[protocol] = (result, per_task)
        for name, t in per_task.items():
            # TensorFlow allocates every step on every task: a counter that
            # saw nothing would be blind, not a result.
            assert sum(t["by_lib"].values()) >= STEPS, (protocol, name, t["by_lib"])
    (g, _), (r, rt) = results[harness.PROTOCOL_GRPC], results[harness.PROTOCOL_RDMA]
    assert g["total"] == r["total"], (g["total"], r["total"])
    # Every ps -> worker variable went over the transport.
    assert r["stats"]["counters"]["fallback_tensors"] == 0, r["stats"]
    setup = {name: _thread_setup(t["paths"].get(CORE), t["core"]) for name, t in rt.items()}
    rpc = {name: _rpc_serving(t["paths"].get(CORE), t["core"] - setup[name]) for name, t in rt.items()}
    core = {name: sum(t["core"].values()) - sum(setup[name].values()) - sum(rpc[name].values())
            for name, t in rt.items()}
    print(f"transport library (librdma_device.so) allocations in {STEPS} steps: {core}, besides threads' "
          f"one-time parking records: { {name: sum(c.values()) for name, c in setup.items()} } and serving "
          f"worker RPCs: { {name: sum(c.values()) for name, c in rpc.items()} }")
    # One line per task for `bench report` (it runs this test with -s).
    for name, t in rt.items():
        print(json.dumps({"task": name, "steps": STEPS, "tensors_per_step": r["tensors_per_step"],
                          "grpc": sum(results[harness.PROTOCOL_GRPC][1][name]["by_lib"].values()) / STEPS,
                          "rdma_device": sum(t["by_lib"].values()) / STEPS, "shim": sum(t["shim"].values()) / STEPS,
                          "transport": sum(t["core"].values()) / STEPS,
                          "transport_rpc": sum(rpc[name].values()) / STEPS,
                          "transport_setup": sum(setup[name].values()) / STEPS,
                          "transport_other": core[name] / STEPS}), flush=True)
    # The ps only sends tensors (its variables) and serves the master's
    # worker RPCs: the transport's send path allocates nothing in the
    # steady state, as tests/alloc.rs shows at unit level (the chief's and
    # worker's counts include the worker RPCs that ride on the transport,
    # see the printout).
    if core["ps"]:
        left = rt["ps"]["core"] - setup["ps"] - rpc["ps"]
        names = _symbolize(rt["ps"]["paths"][CORE], sorted({a for frames in left for a in frames}))
        pytest.fail("the ps's transport allocated in the steady state: "
                    + "; ".join(f"{n}x " + " < ".join(names[a] for a in frames) for frames, n in left.items()))
    # Fewer allocations per step than stock gRPC on every task (measured:
    # 434 vs 541 on the chief, 306 vs 671 on the worker, 200 vs 316 on the
    # ps).
    for name, t in rt.items():
        ours, theirs = sum(t["by_lib"].values()), sum(results[harness.PROTOCOL_GRPC][1][name]["by_lib"].values())
        assert ours <= theirs, (name, ours / STEPS, theirs / STEPS)
