"""A cancelled tf.function whose receive crosses tasks (how ClusterCoordinator
cancels closures) fails fast with CancelledError and leaves the eager
context usable, under stock gRPC and over the transport alike."""

import pytest

import harness
from conftest import ServerSet

STRICT = {"RDMA_DEVICE_STRICT": "1"}


@pytest.mark.parametrize("protocol", [harness.PROTOCOL_GRPC, harness.PROTOCOL_RDMA])
def test_a_cancelled_cross_task_function_fails_fast_and_the_next_call_runs(protocol, log_dir, plugin_built):
    servers = ServerSet(protocol, log_dir, env=STRICT if protocol != "grpc" else None)
    try:
        before = [t.stats() for t in servers.servers] if protocol != "grpc" else None
        got = servers.run_client("more_scenarios.eager_cancel", timeout=90)
        after = [t.stats() for t in servers.servers] if protocol != "grpc" else None
    finally:
        servers.close()
    assert got["error"] == "CancelledError", got
    assert 0.9 <= got["cancelled_after"] < 3.0, got  # cancelled at 1 s
    assert got["value"] == 1024 * 1.5 * 2.0, got
    if protocol == "grpc":
        return
    # Servers are [worker, ps]: the worker's waiting receive was failed by
    # the cancel (exactly one), and the next call's tensor came over the
    # transport, nothing over gRPC.
    w0, w1 = before[0]["counters"], after[0]["counters"]
    assert w1["waiters_failed"] - w0["waiters_failed"] == 1, (w0, w1)
    assert w1["tensors_received"] - w0["tensors_received"] >= 1, (w0, w1)
    assert w1["bytes_received"] - w0["bytes_received"] >= 4096, (w0, w1)
    for b, a in zip(before, after):
        assert a["counters"]["fallback_tensors"] == b["counters"]["fallback_tensors"], a


@pytest.mark.parametrize("protocol", [harness.PROTOCOL_GRPC, harness.PROTOCOL_RDMA])
def test_failed_ops_across_tasks_leave_the_eager_context_usable(protocol, log_dir, plugin_built):
    """A tf.function whose op on the worker fails on a tensor from the ps,
    called again on good data, three times; then an op-by-op failure on
    the worker and copies between the tasks: every failure is TF's
    InvalidArgumentError and every later call returns the exact value,
    under stock gRPC and over the transport (which carried the tensors,
    with nothing falling back)."""
    servers = ServerSet(protocol, log_dir, env=STRICT if protocol != "grpc" else None)
    try:
        before = [t.stats() for t in servers.servers] if protocol != "grpc" else None
        got = servers.run_client("more_scenarios.eager_errors", timeout=90)
        after = [t.stats() for t in servers.servers] if protocol != "grpc" else None
    finally:
        servers.close()
    assert got["errors"] == ["InvalidArgumentError"] * 4, got
    assert got["values"] == [4096 * 2.0 * s for s in (1, 2, 3, 4)] + [4096 * 4.0], got
    if protocol == "grpc":
        return
    # Servers are [worker, ps]: each of the 7 calls moved the ps's tensor
    # to the worker over the transport.
    w0, w1 = before[0]["counters"], after[0]["counters"]
    assert w1["tensors_received"] - w0["tensors_received"] >= 7, (w0, w1)
    for b, a in zip(before, after):
        assert a["counters"]["fallback_tensors"] == b["counters"]["fallback_tensors"], a
