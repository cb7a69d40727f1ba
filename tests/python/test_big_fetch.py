"""Issue 31: a TF1 fetch of more than 1 GiB from another task, and a
RunGraph reply of more than 1 GiB, each compared with stock gRPC, twice in
a row (the link stays up for the next step).

TF's master receives a fetch on its own device, so the 1.2 GB tensor
crosses from the worker to the chief as a tensor over the transport, not
inside a RunGraph reply (TensorFlow 2.21 puts fetches in the reply only
for the master's own, in-process partition). What does put a large body
in a reply is a partition's graph (RunOptions.output_partition_graphs)
holding a large constant. Calls and replies of more than 1 GiB over verbs
are tested at the call channel (tests/node_rpc.rs, in the VM).
"""

import hashlib
import os

import numpy as np

import harness
from conftest import ServerSet

BYTES = 1_200_000_000
WORKER_DEVICE = "/job:worker/replica:0/task:0/device:CPU:0"


def expected(step):
    pattern = ((np.arange(4096) % 251) + step).astype(np.uint8)
    h = hashlib.sha256()
    block = np.tile(pattern, 4096)  # 16 MiB of whole patterns
    full, rest = divmod(BYTES // 4096 * 4096, block.nbytes)
    for _ in range(full):
        h.update(memoryview(block))
    h.update(memoryview(block[:rest]))
    return h.hexdigest()


def test_a_fetch_over_1_gib_from_another_task_matches_stock_grpc_twice(log_dir, plugin_built):
    got = {}
    for protocol, env in ((harness.PROTOCOL_GRPC, None), (harness.PROTOCOL_RDMA, {"RDMA_DEVICE_STRICT": "1"})):
        s = ServerSet(protocol, log_dir, env=env)
        try:
            got[protocol] = s.run_client("big_fetch", timeout=600, bytes=BYTES)
        finally:
            s.close()
    stock, ours = got[harness.PROTOCOL_GRPC], got[harness.PROTOCOL_RDMA]
    want = [expected(0), expected(1)]
    assert stock["digests"] == want, "stock gRPC itself returned other bytes"
    assert ours["sizes"] == stock["sizes"] == [BYTES // 4096 * 4096] * 2
    assert ours["digests"] == want, "the transport returned other bytes than stock gRPC"
    c = ours["stats"]["counters"]
    # Both fetches crossed as tensors over the transport, none by gRPC.
    assert c["tensors_received"] >= 2 and c["bytes_received"] >= 2 * (BYTES // 4096 * 4096), c
    assert c["fallback_tensors"] == 0, c


# 100 MB in the suite. TensorFlow's own handling of a 1.2 GB constant
# (graph, partition, RegisterGraph, the reply's GraphDef, each copied and
# parsed several times) takes 8 minutes and 16 GB here, under stock gRPC
# and the transport alike; RDMA_DEVICE_TEST_REPLY_BYTES=1200000000 runs
# that size (docs/testing.md).
REPLY_BYTES = int(os.environ.get("RDMA_DEVICE_TEST_REPLY_BYTES", "100000000")) // 4 * 4


def test_a_large_run_graph_reply_matches_stock_grpc_twice(log_dir, plugin_built):
    """A path where TensorFlow 2.21 does put a large body in a RunGraph
    reply: RunOptions.output_partition_graphs, with a large constant in
    the worker's partition (1.2 GB with RDMA_DEVICE_TEST_REPLY_BYTES). The
    worker's reply carries its partition's GraphDef, constant and all;
    twice, so the link stays up for the next step. Every byte of the
    constant comes back as under stock gRPC."""
    got = {}
    for protocol, env in ((harness.PROTOCOL_GRPC, None), (harness.PROTOCOL_RDMA, {"RDMA_DEVICE_STRICT": "1"})):
        s = ServerSet(protocol, log_dir, env=env)
        try:
            got[protocol] = s.run_client("reply_scenarios.big_partition_graph", timeout=1200,
                                         bytes=REPLY_BYTES)
        finally:
            s.close()
    stock, ours = got[harness.PROTOCOL_GRPC], got[harness.PROTOCOL_RDMA]
    values = np.arange(REPLY_BYTES // 4, dtype=np.uint32) * 2654435761 % 1000003
    want = hashlib.sha256(values.astype(np.float32).tobytes()).hexdigest()
    del values

    def shown(result):
        return [(s["value"], s["partitions"], s["consts"]) for s in result["steps"]]

    assert [c for s in stock["steps"] for c in s["consts"]] == \
        [[WORKER_DEVICE, REPLY_BYTES, want]] * 2, "stock gRPC itself returned other bytes"
    assert shown(ours) == shown(stock), "the transport returned other partition graphs than stock gRPC"
    assert all(s["reply_bytes"] > REPLY_BYTES for s in ours["steps"])
    c = ours["stats"]["counters"]
    # Both large replies came over the transport, each parsed on the
    # data-path pool; the first step's RunGraph may precede the link.
    assert c["worker_rpc_large_replies"] == 2, c
    assert c["worker_rpc_large_reply_bytes"] > 2 * REPLY_BYTES, c
    assert c["fallback_tensors"] == 0, c
