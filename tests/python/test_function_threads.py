"""Which thread waits for a tf.function's static placement.

When a function that crosses tasks is instantiated, the shim's graph pass
asks the senders to place the function's edges (passes.cc). A thread of
the user's program waits for that placement, at most 2 s: the process's
main thread, or any thread Python runs (the user's own threads, a
ParameterServerStrategy coordinator's closure threads). Such a thread calls
the function next and would wait for its first run anyway. Runtime threads
(TF's pools and executor threads, gRPC's handlers, the plugin's) go on at
once and the placement completes in the background; the function's first
run then places what is not placed yet, so values are the same either way.

The test calls one function first on the main thread and another first on
a thread of the user's: both wait, both say so at VLOG(1), and every edge
the worker receives was placed ahead (none on first use).
"""

import harness

STRICT = {"RDMA_DEVICE_STRICT": "1"}
# The pass says at VLOG(1) when it leaves the placement to the background.
VERBOSE = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "passes=1"}
WAITED = "placed before its first run"
IN_BACKGROUND = "placement goes on in the background"


def test_the_users_threads_wait_for_a_functions_placement(log_dir, plugin_built):
    cluster = harness.make_cluster({"chief": 1, "worker": 1, "ps": 1})
    servers = harness.start_tasks(
        [dict(role="server", cluster=cluster, job=job, task=0, protocol=harness.PROTOCOL_RDMA)
         for job in ("worker", "ps")], log_dir, STRICT)
    try:
        client = harness.Task(dict(role="more_scenarios.functions_on_two_threads", cluster=cluster,
                                   job="chief", task=0, protocol=harness.PROTOCOL_RDMA),
                              log_dir, dict(STRICT, **VERBOSE))
        try:
            client.wait_ready()
            got = client.result(120)
        finally:
            client.close()
        worker = servers[0].stats()["counters"]
    finally:
        for t in servers:
            t.close()
    assert (got["main"], got["other"]) == (4096 * 2.0, 4096 * 3.0), got
    with open(client.log_path) as f:
        log = f.read()
    waited = [line for line in log.splitlines() if WAITED in line]
    background = [line for line in log.splitlines() if IN_BACKGROUND in line]
    # Each function was first called, so instantiated, on a thread of the
    # user's: the main thread and a thread Python started. Both waited.
    assert len(waited) == 2 and not background, (waited, background, log[-4000:])
    # Both calls' tensors came over the transport, nothing over gRPC, and
    # the worker's edge from the ps was placed ahead for each function.
    assert worker["tensors_received"] == 2 and worker["fallback_tensors"] == 0, worker
    assert worker["edges_static"] == 2 and worker["edges_traced"] == 0, str({k: v for k, v in worker.items() if v})
