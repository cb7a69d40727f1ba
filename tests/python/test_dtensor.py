"""DTensor multi-client over the transport.

Two client processes (DTENSOR_JOBS, one CPU device each) form one mesh
with a "batch" dimension of 2; a tf.function sums a batch-sharded DTensor
over the batch axis, which DTensor turns into an all-reduce across the two
clients. DTensor builds its servers' ServerDef with TensorFlow's platform
protocol ("grpc" in the PyPI build); ``rdma_device.use_with_dtensor()``
points it at "grpc+rdma_device". Under stock gRPC (the reference) and over
the transport, strict mode: the same values bit for bit, and over the
transport every collective chunk went by it (exact counts), none by gRPC.
"""

import json
import subprocess
import sys

import pytest

import harness

# The reduced tensor: [COLS] float32 per call; CALLS calls.
COLS = 64 * 1024
CALLS = 3

_CLIENT = r"""
import hashlib, json, os, sys
cid, jobs, protocol = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(DTENSOR_CLIENT_ID=str(cid), DTENSOR_NUM_CLIENTS="2", DTENSOR_JOB_NAME="worker",
                  DTENSOR_JOBS=jobs)
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
import rdma_device
if protocol != "grpc":
    rdma_device.use_with_dtensor()
dtensor.initialize_accelerator_system("CPU")
mesh = dtensor.create_distributed_mesh([("batch", 2)], device_type="CPU")
layout = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)
rows, cols = 8, int(sys.argv[4])

@tf.function
def colsum(t):
    return tf.reduce_sum(t, axis=0)

# This client's shard of the batch: its own rows, from a fixed seed.
local = np.random.default_rng(cid).standard_normal((rows, cols)).astype(np.float32)
with tf.device(mesh.local_devices()[0]):
    shard = tf.constant(local)
base = dtensor.pack([shard], layout)
out = []
for i in range(int(sys.argv[5])):
    r = colsum(base * float(i + 1))
    out.append(hashlib.sha256(dtensor.unpack(r)[0].numpy().tobytes()).hexdigest())
st = rdma_device.stats() if protocol != "grpc" else None
print("RESULT " + json.dumps(dict(out=out, counters=(st or {}).get("counters"))), flush=True)
os._exit(0)
"""


def _run(protocol):
    ports = harness.free_ports(2)
    jobs = ",".join(f"localhost:{p}" for p in ports)
    env = harness.task_env({"RDMA_DEVICE_STRICT": "1"} if protocol != "grpc" else None)
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, str(c), jobs, protocol, str(COLS), str(CALLS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for c in range(2)]
    results = []
    try:
        for c, p in enumerate(procs):
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, f"client {c} exited {p.returncode}\n{err[-3000:]}"
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            assert line, out[-2000:] + err[-3000:]
            results.append(json.loads(line[-1][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def test_dtensor_multi_client_all_reduce_over_the_transport(plugin_built):
    want = _run(harness.PROTOCOL_GRPC)
    assert want[0]["out"] == want[1]["out"], want
    got = _run(harness.PROTOCOL_RDMA)
    assert [r["out"] for r in got] == [r["out"] for r in want], (got, want)
    for r in got:
        c = r["counters"]
        # Each call all-reduces COLS floats between two clients: each sends
        # the other one chunk (a half) per phase of the ring, two phases.
        assert c["collective_sent_tensors"] == 2 * CALLS, c
        assert c["collective_tensors"] == 2 * CALLS, c
        assert c["collective_bytes"] == CALLS * 4 * COLS, c
        assert c["collective_fallback_tensors"] == 0 and c["fallback_tensors"] == 0, c
