"""The suite's step breakdown (``rdma_device.bench.breakdown``) on hand-made
spans whose answer is known: each component is the interval it names, and
overlaps are counted once. (That the components add up to the step is true
by construction, ``partition_other`` being the rest, so it is not tested.)"""

from rdma_device.bench import breakdown as b


def _meta(pid, name):
    return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}


def _x(name, pid, ts, dur, step="7", key=None):
    args = {"step": step}
    if key:
        args["key"] = key
    return {"ph": "X", "name": name, "pid": pid, "ts": ts, "dur": dur, "args": args}


def test_components_of_a_known_step():
    ps, w = 1, 2
    events = [
        _meta(ps, "/job:ps/task:0"), _meta(w, "/job:worker/task:0"),
        # The worker's partition starts first (local), the ps's 100 µs later.
        _x("RunGraph", w, 300, 700),          # 300..1000: the critical one
        _x("RunGraph", ps, 400, 200),         # 400..600
        # Two tensors from the ps: TF's Send at 450 and 500.
        _x("tf:Send", ps, 450, 10, key="a"), _x("tf:Send", ps, 500, 10, key="b"),
        # The worker posted both receives at 320; they reached TF at 560 and 650.
        _x("tf:RecvFromRemote", w, 320, 240, key="a"), _x("tf:RecvFromRemote", w, 320, 330, key="b"),
    ]
    got = b.one_step([e for e in events if e["ph"] == "X"], {ps: "/job:ps/task:0", w: "/job:worker/task:0"},
                     0, 1200)
    assert got["critical_task"] == "/job:worker/task:0"
    assert got["client_master"] == 300 + 200   # 0..300 and 1000..1200
    assert got["dispatch"] == 0                # the critical partition started first
    assert got["in_transport"] == 650 - 450    # 450..650: a tensor in flight
    assert got["waiting_for_sender"] == 450 - 320  # 320..450: posted, nothing sent yet
    assert got["partition_other"] == 700 - 200 - 130
    assert got["step"] == 1200


def test_a_remote_critical_partition_counts_its_dispatch():
    ps, w = 1, 2
    events = [
        _x("RunGraph", w, 100, 200),   # 100..300
        _x("RunGraph", ps, 250, 400),  # 250..650: ends last
        _x("tf:Send", w, 150, 5, key="g"),
        _x("tf:RecvFromRemote", ps, 260, 40, key="g"),  # sent before it was posted: all in transport
        _x("tf:RecvFromRemote", ps, 270, 30, key="unmatched"),  # its sender's span is missing: waiting
    ]
    got = b.one_step(events, {ps: "/job:ps/task:0", w: "/job:worker/task:0"}, 0, 700)
    assert got["critical_task"] == "/job:ps/task:0"
    assert got["dispatch"] == 150
    assert got["client_master"] == 100 + 50
    assert got["in_transport"] == 40
    assert got["waiting_for_sender"] == 0    # 270..300 lies inside the transfer's 260..300
    assert got["partition_other"] == 360


def test_steps_without_partitions_are_left_out():
    assert b.breakdown([], [(0, 10)]) is None
    ev = [_meta(1, "/job:worker/task:0"), _x("RunGraph", 1, 1, 8)]
    got = b.breakdown(ev, [(0, 10), (20, 30)])
    assert got["steps"] == 1 and got["partition_other"] == 0.008 and got["client_master"] == 0.002
