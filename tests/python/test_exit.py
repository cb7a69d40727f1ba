"""A process that ends while its tensors are in flight ends cleanly.

Two servers in one process (worker and ps), a TF1 session, and two Python
threads each inside one endless step: a while loop on the worker whose
every iteration takes a 1 MiB tensor from the ps. The main thread then
returns, so the interpreter exits the ordinary way (atexit, finalization,
the libraries' static destructors) while the loops move tensors. The
transport's threads and the plugin's pools live for the process and are
never joined: nothing of theirs may crash, hang or abort the exit. Each
run must exit with status 0 within its deadline, under stock gRPC (the
reference) and over the transport, whose counters show the tensors went
over it.

The steps never end, so no thread comes back into Python while it
finalizes: a daemon thread that does is ended by the interpreter with
pthread_exit, whose unwinding through TensorFlow's Python bindings
aborts the process ("FATAL: exception not rethrown"), under stock gRPC
too (measured with two CPU hogs beside it: 1 run in 10 of each protocol,
with steps of one iteration each).
"""

import json
import subprocess
import sys

import pytest

import harness

RUNS = 2

_MAIN = r"""
import json, sys, threading, time
import rdma_device, tensorflow as tf
protocol = sys.argv[1]
if protocol != "grpc":
    rdma_device.load()
tf.compat.v1.disable_eager_execution()
ports = rdma_device._cluster.free_ports(2)
spec = tf.train.ClusterSpec({"worker": [f"localhost:{ports[0]}"], "ps": [f"localhost:{ports[1]}"]})
servers = [tf.distribute.Server(spec, job_name=j, task_index=0, protocol=protocol) for j in ("worker", "ps")]
g = tf.Graph()
with g.as_default():
    with tf.device("/job:ps/task:0"):
        v = tf.Variable(tf.fill([1 << 18], 1.0))
    with tf.device("/job:worker/task:0"):
        def body(i, acc):
            with tf.device("/job:ps/task:0"):
                x = v * 2.0  # ps -> worker, every iteration
            return i + 1, acc + tf.reduce_sum(x)
        endless = tf.compat.v1.while_loop(lambda i, acc: i >= 0, body, [tf.constant(0), tf.constant(0.0)])
    init = tf.compat.v1.global_variables_initializer()
sess = tf.compat.v1.Session(servers[0].target, graph=g)
sess.run(init)
for i in range(2):
    threading.Thread(target=lambda: sess.run(endless), daemon=True).start()
time.sleep(1.5)
stats = rdma_device.stats() if protocol != "grpc" else None
print("RESULT " + json.dumps(dict(stats=stats)), flush=True)
# The interpreter exits here, with both threads inside their step.
"""


@pytest.mark.parametrize("protocol", [harness.PROTOCOL_GRPC, harness.PROTOCOL_RDMA])
def test_exit_with_tensors_in_flight_is_clean(protocol, plugin_built):
    import rdma_device._cluster  # noqa: F401  (the script uses its free_ports)

    for run in range(RUNS):
        p = subprocess.run([sys.executable, "-c", "import rdma_device._cluster\n" + _MAIN, protocol],
                           capture_output=True, text=True, timeout=120, env=harness.task_env())
        assert p.returncode == 0, f"run {run}: exit status {p.returncode}\n{p.stderr[-3000:]}"
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        assert line, p.stdout[-2000:] + p.stderr[-2000:]
        r = json.loads(line[-1][len("RESULT "):])
        for bad in ("panicked", "Check failed", "terminate called", "Segmentation fault"):
            assert bad not in p.stderr, f"run {run}: {bad!r} in stderr\n{p.stderr[-3000:]}"
        if protocol != "grpc":
            c = r["stats"]["counters"]
            # Each iteration moved v * 2 (1 MiB) from the ps to the worker
            # over the transport; none fell back.
            assert c["tensors_received"] >= 10 and c["fallback_tensors"] == 0, c
            assert c["bytes_received"] >= 10 * (1 << 20), c
