"""TF1 graphs over tf.compat.v1.Session(server.target) on 3-task clusters."""

import pytest

import harness
from conftest import ServerSet


@pytest.fixture(scope="module")
def grpc_set(log_dir):
    s = ServerSet(harness.PROTOCOL_GRPC, log_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def rdma_set(log_dir, plugin_built):
    s = ServerSet(harness.PROTOCOL_RDMA, log_dir)
    yield s
    s.close()


def test_tf1_session_trains_like_grpc(grpc_set, rdma_set):
    want = grpc_set.run_client("tf1_train", steps=50)
    got = rdma_set.run_client("tf1_train", steps=50)
    assert got["seen"] == want["seen"] > 0
    assert got["losses"] == want["losses"]
    assert got["digest"] == want["digest"]
