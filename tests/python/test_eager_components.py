"""An eager function with two components on one task: TensorFlow runs each
as its own call there, and its rendezvous cache holds the step's rendezvous
weakly, so when the first component finishes before the second starts, the
second makes the step's rendezvous anew. What peers pushed for the step
meanwhile must still be there for it: every call gives stock gRPC's value,
over the transport, with nothing falling back (strict mode)."""

import pytest

import harness

STRICT = {"RDMA_DEVICE_STRICT": "1"}
CALLS = 60


def _run(protocol, log_dir):
    cluster = harness.make_cluster({"chief": 1, "worker": 1, "ps": 1})
    env = STRICT if protocol != harness.PROTOCOL_GRPC else None
    servers = harness.start_tasks(
        [dict(role="server", cluster=cluster, job="worker", task=0, protocol=protocol, cpus=2),
         dict(role="server", cluster=cluster, job="ps", task=0, protocol=protocol)], log_dir, env)
    try:
        before = [t.stats() for t in servers] if protocol != harness.PROTOCOL_GRPC else None
        client = harness.Task(dict(role="more_scenarios.eager_two_components", cluster=cluster,
                                   job="chief", task=0, protocol=protocol, calls=CALLS), log_dir, env)
        try:
            client.wait_ready()
            got = client.result(120)
        finally:
            client.close()
        after = [t.stats() for t in servers] if protocol != harness.PROTOCOL_GRPC else None
    finally:
        for t in servers:
            t.close()
    return got, before, after


@pytest.fixture(scope="module")
def grpc_results(log_dir, plugin_built):
    got, _, _ = _run(harness.PROTOCOL_GRPC, log_dir)
    return got


def test_a_later_component_finds_what_peers_pushed_for_its_step(grpc_results, log_dir, plugin_built):
    want = [16.0 * s + 4096 * 3.0 * s for s in range(1, CALLS + 1)]
    assert "/job:worker/replica:0/task:0/device:CPU:1" in grpc_results["devices"], grpc_results["devices"]
    assert grpc_results["results"] == want, grpc_results["results"]

    got, before, after = _run(harness.PROTOCOL_RDMA, log_dir)
    failed = [r for r in got["results"] if isinstance(r, str)]
    assert not failed, f"{len(failed)} of {CALLS} calls failed; the first: {failed[0]}"
    assert got["results"] == want

    worker0, worker1 = before[0]["counters"], after[0]["counters"]
    delta = {k: worker1[k] - worker0[k] for k in (
        "tensors_received", "bytes_received", "steps_reopened", "fallback_tensors")}
    print(f"worker over {CALLS} calls: {delta}")
    # Each call: the argument from the client (CPU:0's component) and the
    # ps's tensor (CPU:1's), both over the transport.
    assert delta["tensors_received"] == 2 * CALLS, delta
    assert delta["bytes_received"] == (4 + 4 * 4096) * CALLS, delta
    # The case this test is about happened: a component made its step's
    # rendezvous after the other's had gone.
    assert delta["steps_reopened"] >= 1, delta
    for b, a in zip(before, after):
        assert a["counters"]["fallback_tensors"] == b["counters"]["fallback_tensors"], a
