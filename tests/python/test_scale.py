"""Scale: 1 ps + 15 workers, 16 processes, each worker its own client
session (between-graph replication), all registering and stepping against
the one ps at once, on a 2-core machine.

What a user notices: every worker's fetched values are bit-identical to
stock "grpc" (the reference runs the same 16 tasks as servers of one
process: TensorFlow imported once); under "grpc+rdma_device" in strict mode (a fallback to gRPC
is an error) nothing fell back, every worker pushed its tensors to the ps
and received the ps's over the transport; and the round ends within its
deadline (a hang fails with every task's stacks)."""

import time

import pytest

import harness
from test_concurrency import STRICT, Replicas

JOBS = {"ps": 1, "worker": 15}
# One round: 15 sessions registering graphs on the ps at once, then their
# steps (a hang fails with every task's stacks).
ROUND_DEADLINE_S = 240
# 16 processes importing TensorFlow at once on 2 cores shared with other
# jobs: the first may wait minutes for its READY.
START_TIMEOUT_S = 600
STEPS = 3


def grpc_reference(log_dir, args):
    """The workload's digests under stock "grpc": the same 16 tasks as
    servers in one process (TensorFlow imported once, not 16 times), each
    worker's session in its own thread."""
    cluster = harness.make_cluster(JOBS)
    task = harness.Task(dict(role="more_scenarios.servers_in_one_process", cluster=cluster,
                             job="chief", task=0, protocol=harness.PROTOCOL_GRPC,
                             workload="ps_round", args=args), log_dir)
    try:
        task.wait_ready(START_TIMEOUT_S)
        try:
            replies = task.result(ROUND_DEADLINE_S)["replies"]
        except TimeoutError:
            pytest.fail(f"the grpc reference hung\n{task.dump_stacks()}")
    finally:
        task.close()
    for r in replies:
        assert "error" not in r, r
    return [r["digest"] for r in replies]


def test_one_ps_fifteen_workers_each_its_own_session(log_dir, plugin_built):
    args = {"steps": STEPS, "round": 0}
    t0 = time.monotonic()
    want = grpc_reference(log_dir, args)
    print(f"grpc reference (one process): {time.monotonic() - t0:.1f} s")
    t1 = time.monotonic()
    cluster = Replicas(JOBS, log_dir, harness.PROTOCOL_RDMA, STRICT, start_timeout=START_TIMEOUT_S)
    try:
        up = time.monotonic() - t1
        replies = cluster.round("ps_round", args, deadline_s=ROUND_DEADLINE_S)
        ran = time.monotonic() - t1 - up
        stats = [t.stats() for t in cluster.tasks]
    finally:
        cluster.close()
    print(f"grpc+rdma_device: 16 processes up in {up:.1f} s, the round in {ran:.1f} s; "
          f"total {time.monotonic() - t0:.1f} s")
    got = [r["digest"] for r in replies]
    assert len(got) == JOBS["worker"] and got == want
    counters = [s["counters"] for s in stats]
    # Zero fallback anywhere; every worker pushed its gradients to the ps
    # and received the ps's variables over the transport.
    for c in counters:
        assert c["fallback_tensors"] == 0 and c["collective_fallback_tensors"] == 0, counters
    ps, workers = counters[0], counters[1:]
    assert len(workers) == JOBS["worker"]
    for c in workers:
        assert c["tensors_pushed"] > 0 and c["tensors_received"] > 0, counters
    assert ps["tensors_received"] >= sum(c["tensors_pushed"] for c in workers) > 0, counters
