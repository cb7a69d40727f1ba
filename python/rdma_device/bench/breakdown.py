"""Where a step's time goes, from recorded spans (the suite's breakdown).

A step is one ``session.run`` in the client, ``[t0, t1]``. Its partitions
run as ``RunGraph`` spans on their tasks; the step ends when the last one
(the *critical* partition) is done. Every component below is a measured
interval, not "step minus compute":

``client_master``
    ``t0`` to the first partition's start, and the critical partition's
    end to ``t1``: the client's ``RunStep`` to the master, the master's
    work, and the way back.
``dispatch``
    the first partition's start to the critical partition's start: the
    master reaching the critical partition's task (a worker RPC when it is
    remote; 0 when the critical partition is the first to start).
``waiting_for_sender``
    inside the critical partition, time when one of its receives
    (``tf:RecvFromRemote``) was posted but the sender's TensorFlow had not
    yet handed that tensor to the transport (``tf:Send`` on the sender,
    matched by rendezvous key and step): the sending partition's own
    start and compute.
``in_transport``
    inside the critical partition, time when one of its tensors was in
    the transport: from the sender's ``tf:Send`` to the tensor reaching
    TensorFlow on this task (the write, the receiver's wake-up, the hop to
    the callback thread).
``partition_other``
    the rest of the critical partition's ``RunGraph`` span: its own ops and
    TensorFlow's executor while no receive of it was outstanding.

Overlapping intervals are merged, and ``in_transport`` wins where the two
waits overlap (several tensors). ``partition_other`` is a residual (the
critical span less the two waits), not a recorded span, so that the
components add up to the step says nothing by itself: the tests check each
measured component against spans whose answer is known, and the traced
steps against the suite's timed steps (another block, timeline off).
"""

import statistics


def union(iv):
    """Sorted, merged copy of intervals ``[(a, b)]`` (empty ones dropped)."""
    out = []
    for a, b in sorted((a, b) for a, b in iv if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(iv):
    return sum(b - a for a, b in iv)


def subtract(a, b):
    """Merged intervals ``a`` minus merged intervals ``b``."""
    out = []
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out


def clip(iv, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in iv if min(b, hi) > max(a, lo)]


COMPONENTS = ("client_master", "dispatch", "waiting_for_sender", "in_transport", "partition_other")

LABELS = {
    "client_master": "client & master (RunStep)",
    "dispatch": "reaching the partition (worker RPC)",
    "waiting_for_sender": "waiting for the sender's TF",
    "in_transport": "tensor in the transport",
    "partition_other": "partition's own work",
}


def one_step(spans, names, t0, t1):
    """The components (µs) of the step ``[t0, t1]``, or None when it has
    no recorded partition."""
    parts = [e for e in spans if e["name"] == "RunGraph" and t0 <= e["ts"] <= t1]
    if not parts:
        return None
    crit = max(parts, key=lambda e: e["ts"] + e["dur"])
    c0, c1 = crit["ts"], crit["ts"] + crit["dur"]
    first = min(e["ts"] for e in parts)
    sends = {}
    for e in spans:
        if e["name"] == "tf:Send" and t0 <= e["ts"] <= t1:
            k = (e["args"].get("step"), e["args"].get("key"))
            sends[k] = min(sends.get(k, e["ts"]), e["ts"])
    wait, xfer = [], []
    for r in spans:
        if r["name"] != "tf:RecvFromRemote" or r["pid"] != crit["pid"] or not (c0 <= r["ts"] <= c1):
            continue
        r0, r1 = r["ts"], r["ts"] + r["dur"]
        s = sends.get((r["args"].get("step"), r["args"].get("key")))
        if s is None:  # the sender's span fell outside this step: all of it waited
            wait.append((r0, r1))
            continue
        m = min(max(r0, s), r1)
        wait.append((r0, m))
        xfer.append((m, r1))
    x = union(clip(xfer, c0, c1))
    w = subtract(union(clip(wait, c0, c1)), x)
    out = {
        "step": t1 - t0,
        "client_master": max(first - t0, 0.0) + max(t1 - c1, 0.0),
        "dispatch": max(c0 - first, 0.0),
        "waiting_for_sender": length(w),
        "in_transport": length(x),
        "critical_task": names.get(crit["pid"], "?"),
    }
    out["partition_other"] = max(crit["dur"] - out["waiting_for_sender"] - out["in_transport"], 0.0)
    return out


def breakdown(events, runs):
    """Median (over the traced steps ``runs`` = [(t0_us, t1_us)]) of each
    component in ms, the median traced step, how many steps had spans, and
    which task's partition was critical most often."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    steps = [s for s in (one_step(spans, names, t0, t1) for t0, t1 in runs) if s]
    if not steps:
        return None
    out = {c: round(statistics.median(s[c] for s in steps) / 1e3, 3) for c in COMPONENTS}
    out["traced_step_ms"] = round(statistics.median(s["step"] for s in steps) / 1e3, 3)
    out["steps"] = len(steps)
    crit = [s["critical_task"] for s in steps]
    out["critical_task"] = max(set(crit), key=crit.count)
    return out
