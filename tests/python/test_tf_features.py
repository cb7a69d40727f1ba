"""TensorFlow features a new user reaches for, across real tasks, under
"grpc+rdma_device" (strict: no fallback allowed) next to stock "grpc".

- A TF1 ``tf.while_loop`` on worker 0 whose body reads, every iteration, a
  tensor the ps computes from the loop variable: the loop's tensors cross
  tasks inside the loop frame, each iteration its own rendezvous key. All
  of them go over the transport (exactly edges x (iterations + 1), counted
  on both ends), the fetched result is bit-identical to stock gRPC's, with
  TensorFlow's default (v2) control flow and with v1 control flow.
- Partial runs (``partial_run_setup`` / ``partial_run``) across the two
  tasks: a feed of the first call crosses to the ps, what the ps computes
  from it crosses back and waits on the worker for the feed of the second
  call, and the third call fetches a value computed during the first.
  Counted per call, bit-identical to stock gRPC.
- ``rdma_device.create_local_server()``: TensorFlow's ``create_local_server``
  with this protocol, whose TF1 sessions give stock's results; and, marked
  as a known failure, two such servers joined by a session's
  ``ClusterDef`` (TensorFlow's own way to make local servers work
  together), which aborts the master process under "grpc+rdma_device".

Every wait has a deadline: a session's ``operation_timeout_in_ms``, a
watchdog around each client call, and subprocess timeouts.
"""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import harness
from rdma_device._cluster import LocalCluster

GRPC = "grpc"
RDMA = "grpc+rdma_device"
SIZE = 1024  # float32 elements of the tensors that cross: 4 KiB
ITERATIONS = 7  # of the while loop
LOOP_STEPS = 3  # session steps of the loop graph after its first
PARTIAL_RUNS = 3  # counted partial runs (after one warm-up run)
OP_TIMEOUT_MS = 20000
CALL_DEADLINE_S = 60


def _tf():
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    return tf


def _within(what, fn, seconds=CALL_DEADLINE_S):
    """fn() on a watchdog thread: its result, or AssertionError if it has
    not returned within `seconds` (a hung step)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise AssertionError(f"{what} did not return within {seconds} s (hung)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _counters(c):
    return {task: s["counters"] for task, s in c.stats().items()}


def _wait_counters(c, done, seconds=10):
    """The cluster's counters once done(counters) holds, or after `seconds`
    (the caller's asserts then say what is missing): e.g. a step's
    CleanupGraph is counted after the step has returned."""
    deadline = time.monotonic() + seconds
    while True:
        n = _counters(c)
        if done(n) or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


PS = "/job:ps/task:0"
WORKER = "/job:worker/task:0"


def _rpcs(n):
    return n[WORKER]["worker_rpcs_over_transport"] + n[WORKER]["worker_rpcs_over_grpc"]


def _session(tf, c, g):
    cfg = tf.compat.v1.ConfigProto(operation_timeout_in_ms=OP_TIMEOUT_MS)
    return tf.compat.v1.Session(c.target(), graph=g, config=cfg)


def _warm_up(c):
    """One step that moves a tensor each way between worker 0 and the ps,
    so that both directions are connected before anything is counted;
    returns once its worker RPCs are counted (none may land in a test's
    counters)."""
    tf = _tf()
    g = tf.Graph()
    with g.as_default():
        with tf.device(c.device("ps", 0)):
            w = tf.Variable(tf.zeros([SIZE]), name="w")
        with tf.device(c.device("worker", 0)):
            d = w.value() + 1.0
        with tf.device(c.device("ps", 0)):
            step = w.assign(d)
        init = tf.compat.v1.global_variables_initializer()
    with _session(tf, c, g) as s:
        _within("warm-up", lambda: (s.run(init), s.run(step)))
    if c.protocol == RDMA:
        # init and the step: a RunGraph and a CleanupGraph each to the ps.
        n = _wait_counters(c, lambda n: _rpcs(n) >= 4)
        assert _rpcs(n) == 4, n


@pytest.fixture(scope="module")
def clusters(plugin_built, log_dir):
    cs = {}
    try:
        cs[GRPC] = LocalCluster(GRPC, {"ps": 1, "worker": 1}, log_dir=log_dir, name="tf-features-grpc")
        cs[RDMA] = LocalCluster(RDMA, {"ps": 1, "worker": 1}, env={"RDMA_DEVICE_STRICT": "1"},
                                log_dir=log_dir, name="tf-features-rdma")
        for c in cs.values():
            _warm_up(c)
        yield cs
    finally:
        for c in cs.values():
            c.close()


# --- 1. while loops whose body crosses tasks ---------------------------------


def _loop_graph(tf, c):
    """w on the ps; a while loop on worker 0 whose body asks the ps for
    w * (i + 1) (i: the loop variable, sent to the ps each iteration) and
    accumulates sin() of it."""
    g = tf.Graph()
    with g.as_default():
        with tf.device(c.device("ps", 0)):
            w = tf.Variable(tf.random.stateless_uniform([SIZE], seed=[1, 2]), name="w")

        def body(i, acc):
            with tf.device(c.device("ps", 0)):
                r = w.value() * tf.cast(i + 1, tf.float32)
            with tf.device(c.device("worker", 0)):
                return i + 1, acc + tf.sin(r)

        with tf.device(c.device("worker", 0)):
            _, out = tf.while_loop(lambda i, acc: i < ITERATIONS, body,
                                   [tf.constant(0), tf.zeros([SIZE])])
        init = tf.compat.v1.global_variables_initializer()
    return g, init, out


def _task(device):
    """'/job:ps/replica:0/task:0/device:CPU:0' -> '/job:ps/task:0'."""
    parts = dict(p.split(":", 1) for p in device.strip("/").split("/") if ":" in p)
    return f"/job:{parts['job']}/task:{parts['task']}"


def _cross_task_sends(partition_graphs):
    """{receiving task: [send node names]} of the sends between tasks."""
    out = {}
    for pg in partition_graphs:
        for n in pg.node:
            if n.op not in ("_Send", "_HostSend"):
                continue
            src = _task(n.attr["send_device"].s.decode())
            dst = _task(n.attr["recv_device"].s.decode())
            if src != dst:
                out.setdefault(dst, []).append(n.name)
    return out


def _run_loop(tf, c):
    """(first step's result, later steps' results, the cross-task sends of
    the partition graphs, counters after the first step or None)."""
    g, init, out = _loop_graph(tf, c)
    if c.protocol == RDMA:
        c.reset_stats()
    with _session(tf, c, g) as s:
        _within("init", lambda: s.run(init))
        if c.protocol == RDMA:
            # Wait for init's CleanupGraph: nothing of it in the counts.
            _wait_counters(c, lambda n: _rpcs(n) >= 2)
            c.reset_stats()
        opts = tf.compat.v1.RunOptions(output_partition_graphs=True)
        meta = tf.compat.v1.RunMetadata()
        first = _within("the loop's first step", lambda: s.run(out, options=opts, run_metadata=meta))
        after_first = None
        if c.protocol == RDMA:
            after_first = _wait_counters(c, lambda n: _rpcs(n) >= 2)
        later = [_within(f"loop step {k + 2}", lambda: s.run(out)) for k in range(LOOP_STEPS)]
        return first, later, _cross_task_sends(meta.partition_graphs), after_first


@pytest.mark.parametrize("control_flow", ["v2", "v1"])
def test_while_loop_tensors_cross_tasks_every_iteration_over_the_transport(clusters, control_flow):
    """A loop on the worker reading from the ps every iteration gives stock
    gRPC's result bit for bit, and every tensor of every iteration went over
    the transport (strict mode: a fallback would fail the step)."""
    tf = _tf()
    was_v2 = tf.compat.v1.control_flow_v2_enabled()
    if control_flow == "v1":
        tf.compat.v1.disable_control_flow_v2()
    else:
        tf.compat.v1.enable_control_flow_v2()
    try:
        want_first, want_later, _, _ = _run_loop(tf, clusters[GRPC])
        c = clusters[RDMA]
        got_first, got_later, sends, n1 = _run_loop(tf, c)
        n = _wait_counters(c, lambda n: _rpcs(n) >= 2 * (1 + LOOP_STEPS))
    finally:
        (tf.compat.v1.enable_control_flow_v2 if was_v2 else tf.compat.v1.disable_control_flow_v2)()

    assert got_first.tobytes() == want_first.tobytes()
    assert [v.tobytes() for v in got_later] == [v.tobytes() for v in want_later]
    assert all(v.tobytes() == got_first.tobytes() for v in got_later)

    # The partitioned loop: worker -> ps the loop variable, the loop
    # condition and the body's control trigger; ps -> worker w * (i + 1).
    # All four edges are inside the loop frame.
    to_ps, to_worker = sends.get(PS, []), sends.get(WORKER, [])
    assert (len(to_ps), len(to_worker)) == (3, 1), sends
    assert all("while" in name for name in to_ps + to_worker), sends

    # Each edge carries one tensor per iteration plus one for the iteration
    # that exits (the condition false, the body's tensors dead): 8 each.
    per_edge = ITERATIONS + 1
    print(f"control flow {control_flow}: after step 1: "
          + "; ".join(f"{t}: " + ", ".join(f"{k}={v[k]}" for k in (
              "tensors_received", "bytes_received", "tensors_pushed", "edges_static", "edges_traced",
              "negotiation_messages", "fallback_tensors")) for t, v in n1.items()))
    for task, edges, nbytes in (
            # int32 i, live in 7 iterations (4 B) + the bool condition in 8
            # (1 B) + the empty control trigger.
            (PS, len(to_ps), 4 * ITERATIONS + per_edge),
            # w * (i + 1), live in 7 iterations.
            (WORKER, len(to_worker), 4 * SIZE * ITERATIONS)):
        got = n1[task]
        assert got["tensors_received"] == edges * per_edge, (task, got)
        assert got["bytes_received"] == nbytes, (task, got)
        assert got["fallback_tensors"] == 0 and got["inline_tensors"] == 0, (task, got)
        # Every iteration has its own rendezvous key: each is an edge of
        # its own, placed on first use (no static placement inside loops).
        assert got["edges_traced"] == edges * per_edge and got["edges_static"] == 0, (task, got)
    assert n1[PS]["tensors_pushed"] == len(to_worker) * per_edge, n1
    assert n1[WORKER]["tensors_pushed"] == len(to_ps) * per_edge, n1
    # One Announce + one Publish per placed edge, and nothing else.
    total_edges = (len(to_ps) + len(to_worker)) * per_edge
    assert n1[PS]["negotiation_messages"] + n1[WORKER]["negotiation_messages"] == 2 * total_edges, n1

    # Later steps reuse the same keys: the same tensors again, no new
    # placement, no negotiation.
    steps = 1 + LOOP_STEPS
    for task, edges in ((PS, len(to_ps)), (WORKER, len(to_worker))):
        assert n[task]["tensors_received"] == steps * edges * per_edge, (task, n[task])
        assert n[task]["edges_traced"] == edges * per_edge, (task, n[task])
        assert n[task]["negotiation_messages"] == n1[task]["negotiation_messages"], (task, n[task])
        assert n[task]["fallback_tensors"] == 0 and n[task]["peers_lost"] == 0, (task, n[task])
    # The steps' RunGraph and CleanupGraph to the ps went over the
    # transport too.
    assert n[WORKER]["worker_rpcs_over_transport"] == 2 * steps, n[WORKER]
    assert n[WORKER]["worker_rpcs_over_grpc"] == 0, n[WORKER]


# --- 2. partial runs across two tasks ----------------------------------------


def _partial_graph(tf, c):
    g = tf.Graph()
    with g.as_default():
        with tf.device(c.device("ps", 0)):
            w = tf.Variable(tf.random.stateless_uniform([SIZE], seed=[7, 8]), name="w")
        with tf.device(c.device("worker", 0)):
            x = tf.compat.v1.placeholder(tf.float32, [SIZE], name="x")  # fed in call 1
            k = tf.compat.v1.placeholder(tf.float32, [], name="k")  # fed in call 2
        with tf.device(c.device("ps", 0)):
            p = w.value() * x  # x crosses to the ps in call 1; p to the worker
            a = tf.reduce_sum(p)  # crosses in call 1, fetched in call 1
            q = tf.tanh(p * k)  # k crosses to the ps in call 2; q back in call 2
        with tf.device(c.device("worker", 0)):
            z = tf.reduce_sum(q) + tf.reduce_sum(p * k)  # p waits here for k
            m = tf.reduce_max(p)  # computed in call 1, fetched in call 3
        init = tf.compat.v1.global_variables_initializer()
    return g, init, (x, k), (a, z, m)


def _partial_runs(tf, c, runs, on_call=None):
    """`runs` partial runs of three calls each; returns their fetched
    values. on_call(run, call) runs after each call (counter checks)."""
    g, init, (x, k), (a, z, m) = _partial_graph(tf, c)
    out = []
    with _session(tf, c, g) as s:
        _within("init", lambda: s.run(init))
        for r in range(runs):
            xv = np.linspace(-1.0, 1.0 + r, SIZE, dtype=np.float32)
            h = _within("partial_run_setup", lambda: s.partial_run_setup([a, z, m], [x, k]))
            got = [_within("call 1", lambda: s.partial_run(h, a, feed_dict={x: xv}))]
            if on_call:
                on_call(r, 1)
            got.append(_within("call 2", lambda: s.partial_run(h, z, feed_dict={k: 0.5 + r})))
            if on_call:
                on_call(r, 2)
            got.append(_within("call 3", lambda: s.partial_run(h, m)))
            if on_call:
                on_call(r, 3)
            out.append([np.float32(v).tobytes() for v in got])
    return out


def test_partial_runs_across_tasks_over_the_transport(clusters):
    """Feeds of one call, fetches of a later one, tensors crossing between
    the calls: the same values as stock gRPC, bit for bit, and each call's
    tensors counted over the transport when that call ran."""
    tf = _tf()
    want = _partial_runs(tf, clusters[GRPC], 1 + PARTIAL_RUNS)

    c = clusters[RDMA]
    seen = []
    # Per run: ps receives x (call 1) and k (call 2); the worker receives a
    # and p (call 1) and q (call 2); nothing crosses in call 3.
    want_ps = {1: 1, 2: 2, 3: 2}
    want_worker = {1: 2, 2: 3, 3: 3}

    def check(r, call):
        if r == 0:
            if call == 3:
                # The warm-up run (it registered the graph): count from
                # here, once its CleanupGraph (and init's) are in.
                n = _wait_counters(c, lambda n: _rpcs(n) >= 2 + 4)
                # Its 5 cross-task edges (x, k; a, p, q) were placed once
                # each, one Announce and one Publish apiece.
                placed = sum(n[t]["edges_static"] + n[t]["edges_traced"] for t in (PS, WORKER))
                talk = sum(n[t]["negotiation_messages"] for t in (PS, WORKER))
                seen.append(("warm-up", {t: {k: n[t][k] for k in ("edges_static", "edges_traced")}
                                         for t in (PS, WORKER)}))
                assert (placed, talk) == (5, 10), n
                c.reset_stats()
            return
        runs_before = r - 1
        ps = runs_before * 2 + want_ps[call]
        worker = runs_before * 3 + want_worker[call]
        # p is pushed while call 1 runs; call 1 returns once a arrived.
        n = _wait_counters(c, lambda n: n[WORKER]["tensors_received"] >= worker)
        seen.append((r, call, n[PS]["tensors_received"], n[WORKER]["tensors_received"]))
        assert n[PS]["tensors_received"] == ps, (r, call, n[PS])
        assert n[WORKER]["tensors_received"] == worker, (r, call, n[WORKER])
        assert n[PS]["fallback_tensors"] == 0 and n[WORKER]["fallback_tensors"] == 0, n

    c.reset_stats()
    got = _partial_runs(tf, c, 1 + PARTIAL_RUNS, on_call=check)
    assert got == want
    print("(run, call, ps tensors_received, worker tensors_received):", seen)

    # Each run: 3 calls, each a RunGraph to the ps, and its CleanupGraph.
    n = _wait_counters(c, lambda n: _rpcs(n) >= 4 * PARTIAL_RUNS)
    assert n[WORKER]["worker_rpcs_over_transport"] == 4 * PARTIAL_RUNS, n[WORKER]
    assert n[WORKER]["worker_rpcs_over_grpc"] == 0, n[WORKER]
    assert n[PS]["bytes_received"] == PARTIAL_RUNS * (4 * SIZE + 4), n[PS]  # x, k
    assert n[WORKER]["bytes_received"] == PARTIAL_RUNS * (4 + 2 * 4 * SIZE), n[WORKER]  # a, p, q
    assert n[PS]["tensors_pushed"] == n[WORKER]["tensors_received"], n
    assert n[WORKER]["tensors_pushed"] == n[PS]["tensors_received"], n
    # The graph's 5 edges were placed in the warm-up run; these runs only
    # reuse them.
    for task in (PS, WORKER):
        assert n[task]["edges_static"] + n[task]["edges_traced"] == 0, (task, n[task])
        assert n[task]["negotiation_messages"] == 0, (task, n[task])
        assert n[task]["fallback_tensors"] == 0 and n[task]["peers_lost"] == 0, (task, n[task])


# --- 3. rdma_device.create_local_server --------------------------------------

_LOCAL_SERVER_MAIN = r"""
import json, os, sys
import numpy as np
import rdma_device
before = rdma_device.stats()["counters"]["arena_bytes_total"]
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
ours = rdma_device.create_local_server()
stock = tf.distribute.Server.create_local_server()

def steps(target):
    g = tf.Graph()
    with g.as_default():
        w = tf.Variable(tf.random.stateless_uniform([1024], seed=[3, 4]), name="w")
        y = tf.reduce_sum(tf.sin(w.value()) * 2.0)
        step = w.assign_add(tf.cos(w.value()) * 0.01)
        init = tf.compat.v1.global_variables_initializer()
    cfg = tf.compat.v1.ConfigProto(operation_timeout_in_ms=20000)
    out = []
    with tf.compat.v1.Session(target, graph=g, config=cfg) as s:
        s.run(init)
        for _ in range(3):
            s.run(step)
            out.append(np.float32(s.run(y)).tobytes().hex())
    return out

print("RESULT " + json.dumps(dict(
    protocol=ours.server_def.protocol, job=dict(ours.server_def.cluster.job[0].tasks),
    target=ours.target, stock_target=stock.target, arena_before=before,
    ours=steps(ours.target), stock=steps(stock.target), stats=rdma_device.stats())), flush=True)
os._exit(0)
"""


def _run_script(script, args, seconds, env=None):
    """A Python subprocess with the test's package; (returncode, stdout,
    stderr). Killed, and the test failed, if it has not ended in time."""
    p = subprocess.Popen([sys.executable, "-c", script] + list(args), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=harness.task_env(env))
    try:
        out, err = p.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"subprocess did not end within {seconds} s:\n{err[-3000:]}")
    return p.returncode, out, err


def _result(out, err):
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"no RESULT line; stderr:\n{err[-3000:]}")


def test_create_local_server_runs_tf1_sessions_like_tensorflows(plugin_built):
    """rdma_device.create_local_server() is TensorFlow's local server (one
    task of job "localhost", a port the OS picked) with protocol
    "grpc+rdma_device": its transport is up, and a TF1 session on its target
    trains and fetches what one on tf.distribute.Server.create_local_server()
    does, bit for bit. A one-task job has no peer: nothing crosses tasks,
    so the transport moves nothing and nothing falls back."""
    rc, out, err = _run_script(_LOCAL_SERVER_MAIN, [], 120, env={"RDMA_DEVICE_STRICT": "1"})
    assert rc == 0, err[-3000:]
    r = _result(out, err)
    assert r["protocol"] == RDMA, r
    assert r["job"] == {"0": "localhost:0"}, r
    port = int(r["target"].rsplit(":", 1)[1])
    assert r["target"] == f"grpc://localhost:{port}" and port > 0, r
    assert r["target"] != r["stock_target"], r
    assert len(r["ours"]) == 3 and r["ours"] == r["stock"], r
    n = r["stats"]["counters"]
    # The transport started with the server: its receive arena is mapped.
    assert r["arena_before"] == 0 and n["arena_bytes_total"] > 0, n
    for k in ("tensors_pushed", "tensors_received", "fallback_tensors", "worker_rpcs_over_transport",
              "worker_rpcs_over_grpc", "peers_lost"):
        assert n[k] == 0, (k, n)
    assert r["stats"]["peers"] == {} and r["stats"]["fallback_reasons"] == {}, r["stats"]


# Two local servers made to work together by a session's ClusterDef
# (TensorFlow's session_clusterspec_prop_test pattern): each was booted as
# /job:localhost/task:0; the session calls them /job:worker/task:0 and 1.
_SECOND_SERVER_MAIN = r"""
import json, os, sys
import rdma_device, tensorflow as tf
if sys.argv[1] == "grpc":
    server = tf.distribute.Server.create_local_server()
else:
    server = rdma_device.create_local_server()
print("READY " + server.target, flush=True)
sys.stdin.read()
os._exit(0)
"""

_CLUSTER_DEF_MASTER_MAIN = r"""
import json, os, sys
import numpy as np
import rdma_device, tensorflow as tf
tf.compat.v1.disable_eager_execution()
protocol, other = sys.argv[1], sys.argv[2]
if protocol == "grpc":
    server = tf.distribute.Server.create_local_server()
else:
    server = rdma_device.create_local_server()
cluster = tf.train.ClusterSpec({"worker": [server.target[len("grpc://"):], other]})
g = tf.Graph()
with g.as_default():
    with tf.device("/job:worker/task:1"):
        v = tf.Variable(tf.fill([1024], 0.5), name="v")
    with tf.device("/job:worker/task:0"):
        y = v.value() * 3.0
    with tf.device("/job:worker/task:1"):
        z = tf.reduce_sum(y)
    init = tf.compat.v1.global_variables_initializer()
cfg = tf.compat.v1.ConfigProto(cluster_def=cluster.as_cluster_def(), operation_timeout_in_ms=20000)
with tf.compat.v1.Session(server.target, graph=g, config=cfg) as s:
    s.run(init)
    s.run(z)
    if protocol != "grpc":
        rdma_device.reset_stats()
    got = [float(s.run(z)) for _ in range(3)]
stats = rdma_device.stats() if protocol != "grpc" else None
print("RESULT " + json.dumps(dict(z=got, stats=stats)), flush=True)
os._exit(0)
"""


def _two_local_servers(protocol):
    other = subprocess.Popen([sys.executable, "-c", _SECOND_SERVER_MAIN, protocol], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=harness.task_env())
    try:
        line = _within("the second local server's start", other.stdout.readline, 120)
        assert line.startswith("READY grpc://"), line
        return _run_script(_CLUSTER_DEF_MASTER_MAIN, [protocol, line.split("grpc://", 1)[1].strip()], 120)
    finally:
        other.stdin.close()
        try:
            other.wait(timeout=10)
        except subprocess.TimeoutExpired:
            other.kill()
            other.wait()


def test_two_local_servers_joined_by_a_session_cluster_def(plugin_built):
    """Two create_local_server() servers, one session whose ClusterDef names
    both (ClusterSpec propagation): the same values as under stock gRPC.
    Each server knows itself as /job:localhost/task:0 while the session
    calls them /job:worker/task:N, so the transport's handshake refuses the
    peer under its new name and the tensors go by stock gRPC, counted with
    that reason; the master's own worker is called in-process. (This
    aborted the master process: the worker cache's in-process worker was
    taken for a peer and called over the transport with TensorFlow's
    in-memory RunGraph response, whose get_proto() CHECK-fails.)"""
    rc, out, err = _two_local_servers(GRPC)
    assert rc == 0, err[-3000:]
    want = _result(out, err)["z"]
    assert want == [3.0 * 0.5 * 1024] * 3, want

    rc, out, err = _two_local_servers(RDMA)
    assert rc == 0, err[-3000:]
    r = _result(out, err)
    assert r["z"] == want, r
    n = r["stats"]["counters"]
    # The master's task receives two tensors from worker 1 per step (v for
    # y, and z for the fetch), by gRPC pull, each counted as a fallback
    # with the handshake's reason; nothing over the transport.
    assert n["tensors_received"] == 0 and n["tensors_pushed"] == 0, r["stats"]
    assert n["fallback_tensors"] == 6, r["stats"]
    reasons = r["stats"]["fallback_reasons"]
    assert sum(reasons.values()) == 6 and all("not /job:worker/replica:0/task:1" in k for k in reasons), reasons
