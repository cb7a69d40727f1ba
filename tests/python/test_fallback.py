"""What users see when the transport cannot carry a tensor: a counted,
explained fallback to stock gRPC, or (strict mode) a clear error; and
bad settings refused up front."""

import json
import os
import subprocess
import sys

import pytest

import harness
import rdma_device
from conftest import ServerSet

STEPS = 20
NO_TRANSPORT = {"RDMA_DEVICE_TRANSPORTS": ""}


_FRESH_STATS = r"""
import json
import rdma_device
print(json.dumps(rdma_device.stats()))
"""


def test_python_api_reports_config_and_stats(plugin_built):
    cfg = rdma_device.config()
    assert cfg["RDMA_DEVICE_STRICT"]["default"] == "0"
    assert cfg["RDMA_DEVICE_STRICT"]["help"]
    # A fresh process that moved nothing: every tensor counter is exactly 0.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(rdma_device.__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _FRESH_STATS], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    counters = json.loads(p.stdout.strip().splitlines()[-1])["counters"]
    for name in ("tensors_pushed", "tensors_received", "fallback_tensors", "inline_tensors"):
        assert counters[name] == 0, counters


def test_no_transport_falls_back_to_grpc_and_says_why(log_dir, plugin_built, grpc_reference):
    servers = ServerSet(harness.PROTOCOL_RDMA, log_dir, env=NO_TRANSPORT)
    try:
        got = servers.run_client("tf1_train", steps=STEPS)
        worker_stats = servers.servers[0].stats()
    finally:
        servers.close()
    assert got["digest"] == grpc_reference("tf1_train", STEPS)["digest"]
    for stats in (got["stats"], worker_stats):
        assert stats["counters"]["fallback_tensors"] > 0, stats
        assert stats["counters"]["tensors_pushed"] == 0, stats
        assert any("RDMA_DEVICE_TRANSPORTS" in reason for reason in stats["fallback_reasons"]), stats
        assert all(route.startswith("grpc") for route in stats["peers"].values()), stats


def test_strict_mode_turns_fallback_into_an_error(log_dir, plugin_built):
    env = dict(NO_TRANSPORT, RDMA_DEVICE_STRICT="1")
    servers = ServerSet(harness.PROTOCOL_RDMA, log_dir, env=env)
    try:
        with pytest.raises(RuntimeError) as failure:
            servers.run_client("tf1_train", steps=STEPS)
    finally:
        servers.close()
    message = str(failure.value)
    assert "FailedPrecondition" in message, message
    assert "RDMA_DEVICE_STRICT" in message, message


def test_bad_setting_refuses_to_start_the_server(log_dir, plugin_built):
    cluster = harness.make_cluster({"worker": 1})
    spec = dict(role="server", cluster=cluster, job="worker", task=0,
                protocol=harness.PROTOCOL_RDMA)
    with pytest.raises(RuntimeError) as failure:
        harness.start_tasks([spec], log_dir, env={"RDMA_DEVICE_SLOTS_PER_EDGE": "lots"})
    assert "RDMA_DEVICE_SLOTS_PER_EDGE" in str(failure.value), failure.value
