"""Which thread waits for a tf.function's static placement.

When a function that crosses tasks is instantiated, the shim's graph pass
asks the senders to place the function's edges (passes.cc). Only the
process's main thread, the user's, waits for that placement, at most 2 s:
it would wait for the function's first run anyway. Any other thread goes
on at once and the placement completes in the background: TF's pool
threads, gRPC's handler threads (where a ParameterServerStrategy worker
instantiates what a closure sent it) and the user's own threads, none of
which may be held up by a peer that is slow to answer. The first run of
a function then places what is not placed yet, so values are the same
either way."""

import harness

STRICT = {"RDMA_DEVICE_STRICT": "1"}
# The pass says at VLOG(1) when it leaves the placement to the background.
VERBOSE = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "passes=1"}
OFF_MAIN = "instantiated off the main thread: placement goes on in the background"


def test_only_the_main_thread_waits_for_a_functions_placement(log_dir, plugin_built):
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
    off_main = [line for line in log.splitlines() if OFF_MAIN in line]
    # One function was first called on the thread of the user's own: its
    # instantiation did not wait. The main thread's did.
    assert len(off_main) == 1, (off_main, log[-4000:])
    # Both calls' tensors came over the transport, nothing over gRPC.
    assert worker["tensors_received"] == 2 and worker["fallback_tensors"] == 0, worker
