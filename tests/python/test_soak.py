"""A short soak (the bench's `soak` command) on a real 3-task cluster: random
shapes and dtypes, a checksum per hop, worker:1 killed with SIGKILL and
restarted halfway. Nothing may be lost or corrupted, and the tensors must
have gone over the transport (not a gRPC fallback)."""

import json
import os
import subprocess
import sys

import rdma_device

STEPS = 300


def test_soak_random_tensors_with_worker_restart(plugin_built):
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(rdma_device.__file__))
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "rdma_device.bench", "soak", "--steps", str(STEPS), "--json",
                        "--step-timeout-ms", "30000"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(r, indent=1))
    assert r["steps"] == STEPS
    assert r["tensors"] == STEPS * r["lanes"]
    assert r["lost"] == 0, r["errors"]
    assert r["corrupt"] == 0
    assert r["restarted_at_step"] == STEPS // 2
    # The step that met the dead worker failed and was retried; at most a
    # few attempts fail around the restart.
    assert 1 <= r["failed_attempts"] <= 3, r["errors"]
    # Every tensor moved 3 times between tasks, over the transport: counters
    # of ps and worker:0 cover the whole run, worker:1's its second life.
    assert r["tensors_pushed"] >= r["hops"]
    assert r["fallback_tensors"] == 0
    assert r["arena_bytes_in_use_end"] > 0
