"""RDMA_DEVICE_MODE=rpc, the RPC-over-RDMA ablation: the receiver requests
each tensor when its Recv runs (one round trip), then the sender writes it
as in push mode (the same copy into a receiver-placed slot). Results must be bit-identical to stock gRPC,
the counters must show one request per received tensor, and a cluster
whose tasks disagree on the mode must fail with the reason, not hang.
"""

import pytest

import harness
from conftest import ServerSet

STEPS = 30
RPC = {"RDMA_DEVICE_STRICT": "1", "RDMA_DEVICE_MODE": "rpc"}


@pytest.fixture
def rpc_set(log_dir, plugin_built):
    s = ServerSet(harness.PROTOCOL_RDMA, log_dir, env=RPC)
    yield s
    s.close()


@pytest.mark.parametrize("role", ["tf1_train", "pss_train"])
def test_rpc_mode_matches_grpc_and_requests_every_tensor(role, grpc_reference, rpc_set):
    want = grpc_reference(role, STEPS)
    before = [t.stats()["counters"] for t in rpc_set.servers]
    got = rpc_set.run_client(role, steps=STEPS)
    after = [t.stats()["counters"] for t in rpc_set.servers]

    assert got["losses"] == want["losses"]
    assert got["digest"] == want["digest"]

    def delta(name):
        return got["stats"]["counters"][name] + sum(a[name] - b[name] for b, a in zip(before, after))

    received, sent, served = delta("tensors_received"), delta("requests_sent"), delta("requests_served")
    assert received > 0
    assert delta("fallback_tensors") == 0
    # One request per tensor: every received tensor was asked for, and
    # every request was answered (streamed tensors included).
    assert sent == served == received, (sent, served, received)

