"""Issue 31: a TF1 fetch of more than 1 GiB from another task, compared
with stock gRPC, twice in a row (the link stays up for the next step).

TF's master receives a fetch on its own device, so the 1.2 GB tensor
crosses from the worker to the chief as a tensor over the transport, not
inside a RunGraph reply (TensorFlow 2.21 puts fetches in the reply only
for the master's own, in-process partition). Replies and calls of more
than 1 GiB are tested at the call channel (tests/node_rpc.rs).
"""

import hashlib

import numpy as np

import harness
from conftest import ServerSet

BYTES = 1_200_000_000


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
