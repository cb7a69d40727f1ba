"""Training over real 3-task clusters (chief client, worker, ps).

Each scenario runs under protocol "grpc" (long-lived reference servers) and
under "grpc+rdma_device" on a fresh cluster in strict mode (any fallback to
gRPC is an error), and must fetch bit-identical results. Clients that come
back to long-lived servers are test_fault.py's business.
"""

import pytest

import harness
from conftest import ServerSet

STEPS = 50
STRICT = {"RDMA_DEVICE_STRICT": "1"}


@pytest.fixture
def rdma_set(log_dir, plugin_built):
    s = ServerSet(harness.PROTOCOL_RDMA, log_dir, env=STRICT)
    yield s
    s.close()


def counters(stats):
    return stats["counters"]


@pytest.mark.parametrize("role", ["tf1_train", "eager_train", "function_train", "pss_train"])
def test_matches_grpc_bit_for_bit(role, grpc_reference, rdma_set):
    want = grpc_reference(role, STEPS)
    before = [counters(t.stats()) for t in rdma_set.servers]
    got = rdma_set.run_client(role, steps=STEPS)
    after = [counters(t.stats()) for t in rdma_set.servers]

    assert got["seen"] == want["seen"] > 0
    assert got["losses"] == want["losses"]
    assert got["digest"] == want["digest"]

    # Strict mode: nothing fell back to gRPC, and the transport carried
    # tensors in this scenario (servers' deltas plus the client's totals).
    client = counters(got["stats"])
    assert client["fallback_tensors"] == 0, got["stats"]
    for b, a in zip(before, after):
        assert a["fallback_tensors"] == b["fallback_tensors"], a
    pushed = client["tensors_pushed"] + sum(
        a["tensors_pushed"] - b["tensors_pushed"] for b, a in zip(before, after))
    received = client["tensors_received"] + sum(
        a["tensors_received"] - b["tensors_received"] for b, a in zip(before, after))
    assert pushed > 0 and received > 0, (got["stats"], after)

    # Static placement reached these APIs: TF1 at graph registration,
    # tf.function and PSS when the function is instantiated (the process
    # that partitions it places every partition's edges). Op-by-op eager
    # has no graph to place ahead.
    static = client["edges_static"] + sum(
        a["edges_static"] - b["edges_static"] for b, a in zip(before, after))
    if role != "eager_train":
        assert static > 0, (got["stats"], after)
    if role == "pss_train":
        # The worker instantiates the step function a closure sends it, on a
        # TF compute-pool thread, which must not wait on the network: the
        # function's edges are placed in the background while its first step
        # runs, so an edge whose first tensor wins that race is placed on
        # first use instead. Either way each edge is placed exactly once,
        # never again: every step sends a tensor on each of the function's
        # edges into worker and ps, so each one placed as many edges as it
        # received tensors per step, and replaced none.
        for b, a in zip(before, after):
            received = a["tensors_received"] - b["tensors_received"]
            placed = (a["edges_static"] - b["edges_static"]
                      + a["edges_traced"] - b["edges_traced"])
            assert received > 0 and received % STEPS == 0, a
            assert placed == received // STEPS, a
            assert a["replacements"] == b["replacements"], a
