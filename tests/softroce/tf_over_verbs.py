"""TF1 training over verbs, inside the Soft-RoCE VM (tf_over_verbs.sh).

Runs tests/python's tf1_train scenario (chief client, worker, ps: float32,
float16, int64, bool, string and dead tensors across tasks) twice on one
host address that belongs to rxe0: under stock "grpc" (the reference) and
under "grpc+rdma_device" with RDMA_DEVICE_TRANSPORTS=verbs and
RDMA_DEVICE_STRICT=1 (any fallback to gRPC is an error). Checks that every
fetched value is bit-identical and that the counters show verbs carried the
tensors, then prints one line starting with "tf-over-verbs:".

    python tf_over_verbs.py ADDR STEPS LOG_DIR
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import harness  # noqa: E402
from rdma_device._cluster import free_ports  # noqa: E402

# Under TCG one `import tensorflow` takes minutes, three at once longer.
START_TIMEOUT = 900
CLIENT_TIMEOUT = 900


def cluster_on(addr):
    ports = iter(free_ports(3))
    return {job: [f"{addr}:{next(ports)}"] for job in ("chief", "worker", "ps")}


def run(protocol, addr, steps, log_dir, env):
    cluster = cluster_on(addr)
    t0 = time.monotonic()
    servers = [harness.Task(dict(role="server", cluster=cluster, job=job, task=0, protocol=protocol),
                            log_dir, env) for job in ("worker", "ps")]
    client = harness.Task(dict(role="tf1_train", cluster=cluster, job="chief", task=0,
                               protocol=protocol, steps=steps), log_dir, env)
    try:
        for t in servers + [client]:
            t.wait_ready(START_TIMEOUT)
        started = time.monotonic() - t0
        result = client.result(CLIENT_TIMEOUT)
        ran = time.monotonic() - t0 - started
        server_stats = [t.stats() for t in servers] if protocol != "grpc" else []
        return result, server_stats, started, ran
    except BaseException:
        for t in servers + [client]:
            print(f"--- {t.name} log tail ---\n{t.log_tail(80)}", flush=True)
        raise
    finally:
        for t in [client] + servers:
            t.kill()
            t.close()


def main():
    addr, steps, log_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.makedirs(log_dir, exist_ok=True)
    verbs = {"RDMA_DEVICE_TRANSPORTS": "verbs", "RDMA_DEVICE_STRICT": "1"}
    want, _, g_start, g_run = run(harness.PROTOCOL_GRPC, addr, steps, log_dir, {})
    print(f"tf-over-verbs-progress: grpc reference done (start {g_start:.0f} s, run {g_run:.0f} s)", flush=True)
    got, servers, r_start, r_run = run(harness.PROTOCOL_RDMA, addr, steps, log_dir, verbs)
    print(f"tf-over-verbs-progress: rdma_device done (start {r_start:.0f} s, run {r_run:.0f} s)", flush=True)

    everyone = [got["stats"]] + servers
    counters = [s["counters"] for s in everyone]
    total = {k: sum(c.get(k, 0) for c in counters)
             for k in ("tensors_pushed", "tensors_received", "fallback_tensors")}
    transports = sorted({t for s in everyone for t in s.get("peers", {}).values()})
    identical = (got["digest"] == want["digest"] and got["losses"] == want["losses"]
                 and got["seen"] == want["seen"] > 0)
    ok = (identical and transports == ["verbs"] and total["tensors_pushed"] > 0
          and total["tensors_received"] > 0 and total["fallback_tensors"] == 0)
    print("tf-over-verbs: " + ("ok" if ok else "FAILED")
          + f" steps={steps} bit-identical={'yes' if identical else 'NO'}"
          f" digest={got['digest'][:16]} items={got['items']}"
          f" peers={'+'.join(transports) or 'none'} tensors_pushed={total['tensors_pushed']}"
          f" tensors_received={total['tensors_received']} fallback_tensors={total['fallback_tensors']}"
          f" strict=1 grpc_s={g_start:.0f}+{g_run:.0f} verbs_s={r_start:.0f}+{r_run:.0f}", flush=True)
    if not ok:
        print("tf-over-verbs-detail: " + json.dumps(
            {"want": {k: want[k] for k in ("digest", "losses", "seen")},
             "got": {k: got[k] for k in ("digest", "losses", "seen")},
             "stats": everyone}), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
