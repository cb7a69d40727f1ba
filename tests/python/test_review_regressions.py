"""Regression tests for three findings of a review of the TensorFlow runtime
side, each checked the way a user meets it, each under a deadline.

1. A transport that fails to start AFTER ``GrpcServer::Init`` (port bound,
   master registered) used to fail server creation there, tearing down a
   server whose port was bound and whose master was registered (a dangling
   pointer in TF's LocalMaster registry). Since 80ec04a (server.cc) the
   server stays whole and moves every tensor over stock gRPC, saying why.
   The start is made to fail for real, with no code change: the task's
   RLIMIT_FSIZE is below the receive arena's size while it creates its
   server, so the arena's ftruncate(2) fails with EFBIG inside
   ``rdev_context_new`` (Node::new -> Arena::new), after the settings check
   that runs before Init passed (the settings are valid).
   (Pre-binding the shm listener's socket name does not reach that branch:
   Node::new only logs a listener that cannot listen, src/node/mod.rs.)
   Such a server in strict mode fails each step that would fall back,
   saying why (it ignored RDMA_DEVICE_STRICT=1 before: see that test).

2. Two AddPeers calls meeting over the same new peer, and two tasks
   choosing their routes to each other at once: a side that routed the
   other over gRPC while the other pushed (or waited for a push) would fail
   in strict mode, fall back, or hang. (a) Tasks created at the same
   instant step at once against every other, their route choices made slow
   by different amounts (an LD_PRELOAD resolver that only delays the
   transport's route threads). (b) Two eager clients join a worker and a ps
   that knew only themselves: the worker gets two AddPeers calls naming the
   ps, the second during the first's 7 s choice (before e2945aa the second
   gave up waiting after 5 s and went on with no route). Strict mode: every
   tensor over the transport, none over gRPC, exact values, no hang.

3. A collective receive in flight whose key the executor's use counts no
   longer name as "the latest use" (the same key used again, or forgotten
   after 2 x 65536 other keys) must still be failed by an abort (d907e34).
   TensorFlow's collectives cannot be driven into that state from Python
   (see the test's docstring), so the test drives the shim's own code: a
   small C++ program compiled from tf_plugin/collective_steps.{h,cc} and
   transport*.cc, pool.cc (the same sources the shim is built from), linked
   to the package's librdma_device.so, with two real transports in one
   process talking over shm.

Scenario functions below run inside task processes (task_main.py role
"test_review_regressions.<name>").
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STRICT = {"RDMA_DEVICE_STRICT": "1"}

# --------------------------------------------------------------------------
# 1. A transport that fails to start after GrpcServer::Init
# --------------------------------------------------------------------------

FAILED_START_STEPS = 3
FAILED_START_ELEMENTS = 1000
# Below the arena (RDMA_DEVICE_ARENA_BYTES, 64 MiB here): its ftruncate fails.
FSIZE_LIMIT = 16 << 20
ARENA = "64M"
RESULT_TIMEOUT_S = 60


def failed_start_step(spec, ready):
    """Creates this task's server (/job:worker/task:0) with RLIMIT_FSIZE
    below the arena, so the transport cannot start after Init; then runs
    TF1 steps through its own master whose tensors cross to
    /job:worker/task:1 and back."""
    _stacks_on_sigusr1()
    import resource
    import signal

    import numpy as np
    import tensorflow as tf

    import rdma_device

    tf.compat.v1.disable_eager_execution()
    # Python ignores SIGXFSZ already; say so, since the failed ftruncate raises it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], hard))
    out = {}
    try:
        server = tf.distribute.Server(tf.train.ClusterSpec(spec["cluster"]), job_name="worker",
                                      task_index=0, protocol=spec["protocol"], start=True)
        out["created"] = None
    except Exception as e:  # before 80ec04a: creation failed here
        out["created"] = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    ready()
    if out["created"] is not None:
        return out
    n = spec["elements"]
    with tf.Graph().as_default():
        with tf.device("/job:worker/task:1"):
            v = tf.Variable(np.arange(n, dtype=np.float32), name="held")
            grown = v.assign_add(tf.ones([n]))
        with tf.device("/job:worker/task:0"):
            doubled = grown * 2.0  # task:1 -> task:0
        with tf.device("/job:worker/task:1"):
            back = doubled + 1.0  # task:0 -> task:1
        config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=30000)
        values, errors = [], []
        with tf.compat.v1.Session(server.target, config=config) as sess:
            sess.run(v.initializer)
            for _ in range(spec["steps"]):
                try:
                    values.append(sess.run(back).tolist())
                except tf.errors.OpError as e:
                    errors.append(f"{type(e).__name__}: {e.message[:600]}")
    out.update(values=values, errors=errors, stats=rdma_device.stats())
    return out


def _failed_start(log_dir, env_a):
    cluster = harness.make_cluster({"worker": 2})
    peer = harness.Task(dict(role="server", cluster=cluster, job="worker", task=1,
                             protocol=harness.PROTOCOL_RDMA), log_dir)
    task = None
    try:
        peer.wait_ready()
        task = harness.Task(dict(role="test_review_regressions.failed_start_step", cluster=cluster,
                                 job="worker", task=0, protocol=harness.PROTOCOL_RDMA,
                                 fsize_limit=FSIZE_LIMIT, elements=FAILED_START_ELEMENTS,
                                 steps=FAILED_START_STEPS),
                            log_dir, dict(env_a, RDMA_DEVICE_ARENA_BYTES=ARENA))
        task.wait_ready()
        try:
            r = task.result(RESULT_TIMEOUT_S)
        except TimeoutError:
            pytest.fail(f"a step hung\n{task.dump_stacks()}\n{peer.dump_stacks()}")
        # Still serving commands after its steps: alive, not crashed.
        after = task.stats()
        peer_stats = peer.stats()
        log = task.log_tail(400)
    finally:
        if task is not None:
            task.close()
        peer.close()
    return r, after, peer_stats, log, task.proc.returncode


def test_transport_failing_after_init_leaves_the_server_whole_on_grpc(log_dir, plugin_built):
    """The transport of /job:worker/task:0 fails to start after Init (its
    arena cannot be sized): the server is still created, 3 TF1 steps whose
    tensors cross to task:1 and back give exact values, all 2 x 3 of this
    task's tensors go over stock gRPC counted with the reason "transport
    not started", the log says why (the OS error), the task answers
    commands afterwards and exits with status 0. Before 80ec04a server
    creation raised (UNAVAILABLE: ... ftruncate of a memfd: File too
    large), after Init had bound the port and registered the master."""
    r, after, peer_stats, log, rc = _failed_start(log_dir, {})
    assert r["created"] is None, r["created"]
    n = FAILED_START_ELEMENTS
    want = [[(i + k) * 2.0 + 1.0 for i in range(n)] for k in range(1, FAILED_START_STEPS + 1)]
    assert r["errors"] == [], r["errors"]
    assert r["values"] == want
    st = r["stats"]
    assert st["peers"] == {}, st["peers"]  # no route chosen: nothing started
    assert st["counters"]["fallback_tensors"] == 2 * FAILED_START_STEPS, st["counters"]
    assert st["counters"]["tensors_pushed"] == 0 and st["counters"]["tensors_received"] == 0
    assert st["fallback_reasons"] == {"transport not started": 2 * FAILED_START_STEPS}, st
    assert "the transport did not start, every tensor of this server goes over stock gRPC" in log
    assert "File too large" in log, log[-3000:]
    assert after["counters"]["fallback_tensors"] == 2 * FAILED_START_STEPS
    # Its peer found nothing listening for it and routes it over gRPC too.
    route = peer_stats["peers"].get("/job:worker/replica:0/task:0", "")
    assert route.startswith("grpc (") and "no shm listener" in route, peer_stats["peers"]
    assert rc == 0, f"exit status {rc}\n{log[-3000:]}"


def test_strict_task_whose_transport_did_not_start_fails_its_steps(log_dir, plugin_built):
    """Only the task whose transport failed is strict (its peer is not, so
    only the failed task can refuse the fallback): each step must fail with
    FailedPrecondition naming RDMA_DEVICE_STRICT. (It did not: the server
    learnt strict mode from its transport's context, which never existed,
    so 3 steps ran with 6 tensors over gRPC and no error; Transport::Start
    now asks the transport with the environment's settings, rdev_grpc_fallback.)"""
    r, _after, _peer, _log, rc = _failed_start(log_dir, STRICT)
    assert r["created"] is None, r["created"]
    assert rc == 0
    assert r["stats"]["counters"]["fallback_tensors"] == 0, (
        f"{r['stats']['counters']['fallback_tensors']} tensors went over gRPC in strict mode "
        f"with no error (values {len(r['values'])} steps ok)")
    assert len(r["errors"]) == FAILED_START_STEPS, r
    for e in r["errors"]:
        assert "RDMA_DEVICE_STRICT" in e and "transport not started" in e, e


# --------------------------------------------------------------------------
# 2. Routes chosen on both sides at once
# --------------------------------------------------------------------------

TASKS = 3
ROUNDS = 6
STEPS_PER_ROUND = 4
ELEMENTS = 4096  # float32: 16 KiB a tensor
ROUND_DEADLINE_S = 40  # a transfer waits at most 20 s for a pending route
# Per process: how long the transport's route threads take to resolve a peer's
# name (the route choice), so that the tasks' choices end at different times.
RESOLVE_MS = (0, 120, 350)


def simultaneous_rounds(spec, ready):
    """Answers "round" commands: at wall-clock time `at` (+ this process's
    offset) creates a server for task `task` of `cluster` (a new job per
    round: a new transport, all routes to choose) and at once runs `steps`
    steps of a graph that moves a tensor from every other task to this one
    and back; replies with the checks. "stats" and "end" as
    _answer_rounds."""
    _stacks_on_sigusr1()
    import numpy as np
    import tensorflow as tf

    import rdma_device

    tf.compat.v1.disable_eager_execution()
    servers = []  # TF servers cannot be stopped: keep them referenced

    def run_round(cmd):
        job, me, n = cmd["job"], cmd["task"], cmd["n"]
        peers = [j for j in range(len(cmd["cluster"][job])) if j != me]
        delay = cmd["at"] - time.time()
        if delay > 0:
            time.sleep(delay)
        t0 = time.monotonic()
        server = tf.distribute.Server(tf.train.ClusterSpec(cmd["cluster"]), job_name=job,
                                      task_index=me, protocol=cmd["protocol"], start=True)
        servers.append(server)
        created_s = time.monotonic() - t0
        # Routes still being chosen as the steps start (the race is real).
        routed = rdma_device.stats()["peers"]
        pending = [j for j in peers if f"/job:{job}/replica:0/task:{j}" not in routed]
        bad, errors = [], []
        with tf.Graph().as_default():
            feeds, fetches = [], []
            for j in peers:
                with tf.device(f"/job:{job}/task:{j}"):
                    p = tf.compat.v1.placeholder(tf.float32, [])
                    x = tf.fill([n], float(j + 1)) + p
                with tf.device(f"/job:{job}/task:{me}"):
                    y = x * 2.0 + float(me + 1)  # j -> me
                with tf.device(f"/job:{job}/task:{j}"):
                    z = y + 1.0  # me -> j
                feeds.append(p)
                fetches.append(z)
            config = tf.compat.v1.ConfigProto(
                operation_timeout_in_ms=(ROUND_DEADLINE_S - 10) * 1000)
            with tf.compat.v1.Session(server.target, config=config) as sess:
                for s in range(cmd["steps"]):
                    try:
                        got = sess.run(fetches, {p: float(s) for p in feeds})
                    except tf.errors.OpError as e:
                        errors.append(f"step {s}: {type(e).__name__}: {e.message[:600]}")
                        continue
                    for j, z in zip(peers, got):
                        want = np.full([n], ((j + 1) + s) * 2.0 + (me + 1) + 1.0, np.float32)
                        if not np.array_equal(z, want):
                            bad.append([s, j, float(z[0]), float(want[0])])
        return {"created_s": created_s, "steps_s": time.monotonic() - t0,
                "pending": len(pending), "bad": bad, "errors": errors}

    return _answer_rounds(ready, run_round)


def _stacks_on_sigusr1():
    """harness.Task.dump_stacks sends SIGUSR1: Python stacks to the log
    (task_main registers this only once a scenario has returned)."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)


def harness_say(prefix, payload):
    sys.stdout.write(f"{prefix} {json.dumps(payload)}\n")
    sys.stdout.flush()


def _answer_rounds(ready, answer):
    """Says READY, then answers this task's commands (a JSON object a line
    on stdin) until "end" or EOF, returning {}: "stats" with
    rdma_device.stats(), any other with answer(cmd)'s reply."""
    import rdma_device

    ready()
    while True:
        line = sys.stdin.readline()
        if not line:
            return {}
        cmd = json.loads(line)
        if cmd["cmd"] == "end":
            return {}
        harness_say("REPLY", rdma_device.stats() if cmd["cmd"] == "stats" else answer(cmd))


def _counters(tasks):
    """Each task's transfer counters (tensors received and pushed over the
    transport, tensors over gRPC), asked of all the tasks at once."""
    for t in tasks:
        t.send("stats")
    out = []
    for t in tasks:
        c = t.expect("REPLY", 30)["counters"]
        out.append({k: c[k] for k in ("tensors_received", "tensors_pushed", "fallback_tensors")})
    return out


def _round_replies(tasks, rnd, deadline_s, everyone):
    """Each task's reply to round `rnd` (harness.replies_within)."""
    return harness.replies_within(tasks, deadline_s, everyone, f"round {rnd}")


def _end_rounds(tasks):
    """Ends every task's round commands ("end") and waits for each one's
    RESULT."""
    for t in tasks:
        t.send("end")
    for t in tasks:
        t.result(30)


def test_routes_chosen_on_both_sides_at_once_move_every_tensor(log_dir, plugin_built,
                                                              slow_resolver):
    """3 task processes, 6 rounds. Each round is a new cluster (a new job,
    new ports): every process creates its server for it at the same
    wall-clock instant (rounds 0-2) or 0/2/4 ms apart (rounds 3-5), the
    task indices rotating over the processes, whose route choices take 0,
    120 and 350 ms (names resolved slowly on the transport's route threads
    only); each then at once runs 4 TF1 steps through its own master moving
    a 16 KiB tensor from each other task to itself and back (with the feed
    and the fetch, which TF routes through the master's task: 4 cross-task
    tensors per other task per step, 8 per step). Strict mode. Every round:
    no step fails or hangs (40 s deadline, stacks dumped), every fetched
    value exact, and over the round exactly 3 x 2 x 4 x 4 = 96 tensors
    received over the transport and 96 pushed by it, 0 over gRPC; and the
    two slower processes started stepping with both of their routes still
    pending (the race was there to lose)."""
    specs, tasks = [], []
    for k in range(TASKS):
        env = dict(STRICT, LD_PRELOAD=slow_resolver, GRPC_DNS_RESOLVER="native",
                   SLOW_RESOLVER_MS=str(RESOLVE_MS[k]), SLOW_RESOLVER_THREAD="rdev-route",
                   RDMA_DEVICE_ARENA_BYTES="64M")
        tasks.append(harness.Task(dict(role="test_review_regressions.simultaneous_rounds",
                                       cluster={}, job="none", task=k,
                                       protocol=harness.PROTOCOL_RDMA), log_dir, env,
                                  name=f"simultaneous-{k}"))
    try:
        for t in tasks:
            t.wait_ready()
        before = _counters(tasks)
        # Per step, per other task: x (j -> me), y (me -> j), and the feed of
        # j's placeholder and the fetch of z, which TF routes through the
        # master's task (me -> j, j -> me): 4 tensors.
        per_round = TASKS * (TASKS - 1) * 4 * STEPS_PER_ROUND
        for rnd in range(ROUNDS):
            ports = harness.free_ports(TASKS)
            job = f"r{rnd}"
            cluster = {job: [f"t{i}.slow.test:{p}" for i, p in enumerate(ports)]}
            at = time.time() + 0.3
            for k, t in enumerate(tasks):
                role = (k + rnd) % TASKS
                offset = 0.0 if rnd < 3 else 0.002 * role
                t.send("round", cluster=cluster, job=job, task=role, n=ELEMENTS,
                       steps=STEPS_PER_ROUND, at=at + offset, protocol=harness.PROTOCOL_RDMA)
            replies = _round_replies(tasks, rnd, ROUND_DEADLINE_S, tasks)
            for t, r in zip(tasks, replies):
                assert r["errors"] == [], (rnd, t.name, r["errors"], t.log_tail())
                assert r["bad"] == [], (rnd, t.name, r["bad"])
            # The slower choosers (120, 350 ms) started stepping with both of
            # their routes pending.
            assert sorted(r["pending"] for r in replies)[1:] == [TASKS - 1] * 2, (rnd, replies)
            after = _counters(tasks)
            got = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in after[0]}
            print(f"round {rnd}: {got}, routes pending at the first step "
                  f"{[r['pending'] for r in replies]}, step times "
                  f"{[round(r['steps_s'], 2) for r in replies]} s")
            assert got == {"tensors_received": per_round, "tensors_pushed": per_round,
                           "fallback_tensors": 0}, (rnd, got)
            before = after
        _end_rounds(tasks)
    finally:
        for t in tasks:
            t.close()


# Two eager clients connecting to the same worker and ps, which know only
# themselves until then: each client's context creation on the worker
# builds a worker cache naming the ps (and that client), so the worker gets
# two AddPeers calls naming the same new peer, the second while the first's
# choice is still running; the ps likewise for the worker. The worker's
# choice of the ps's route takes 7 s; the second client connects 0.5 s
# after the first. Before e2945aa the first call chose on its own thread
# (its client's connect took the whole 7 s) and the second waited at most
# kAddPeersWaitMs (5 s) for that choice, then went on with no route ("task
# not in any cluster spec seen here": gRPC on the worker's side while the ps
# pushed to it; in strict mode the copy failed).
# Not at the same instant: two eager clients creating their contexts on a
# task at the same moment crash that task in TensorFlow itself (SIGSEGV in
# the eager service's GetOrCreateKernelAndDevice), under stock "grpc" too.
# The clients do not name each other: two eager clients that do wait for
# each other in connect_to_cluster (each lists the other's devices before
# it serves), under stock gRPC too.
JOIN_ROUNDS = 3
JOIN_COPIES = 3
JOIN_ELEMENTS = 16384  # float32: 64 KiB a tensor
WORKER_RESOLVE_MS = 7000  # the old 5 s wait ends first; under the 20 s route wait
CLIENT_STAGGER_S = 0.5
JOIN_DEADLINE_S = 45


def server_rounds(spec, ready):
    """Answers "serve" (creates a server for `cluster`/`job`/`task`, kept
    for the process's life); "stats" and "end" as _answer_rounds."""
    _stacks_on_sigusr1()
    import tensorflow as tf

    servers = []

    def serve(cmd):
        servers.append(tf.distribute.Server(tf.train.ClusterSpec(cmd["cluster"]),
                                            job_name=cmd["job"], task_index=cmd["task"],
                                            protocol=cmd["protocol"], start=True))
        return {}

    return _answer_rounds(ready, serve)


def eager_client_rounds(spec, ready):
    """Answers "connect": at wall-clock `at`, connects this process's eager
    context to `cluster` as task 0 of `job` (a new job per round), then per
    copy makes a tensor on the ps, computes from it on the worker (ps ->
    worker), from that on the ps again (worker -> ps) and reads the result
    (ps -> here); replies with the checks. "stats" and "end" as
    _answer_rounds."""
    _stacks_on_sigusr1()
    import numpy as np
    import tensorflow as tf

    def connect(cmd):
        delay = cmd["at"] - time.time()
        if delay > 0:
            time.sleep(delay)
        t0 = time.monotonic()
        tf.config.experimental_connect_to_cluster(
            tf.train.ClusterSpec(cmd["cluster"]), job_name=cmd["job"], task_index=0,
            protocol=cmd["protocol"])
        connected_s = time.monotonic() - t0
        ps, worker, n, k = cmd["ps"], cmd["worker"], cmd["n"], cmd["client"]
        bad, errors = [], []
        for s in range(cmd["copies"]):
            v = float(100 * k + s)
            try:
                with tf.device(ps):
                    a = tf.range(n, dtype=tf.float32) + v
                with tf.device(worker):
                    b = a * 2.0 + 1.0  # ps -> worker
                with tf.device(ps):
                    c = b + 3.0  # worker -> ps
                got = c.numpy()  # ps -> here
            except Exception as e:  # noqa: BLE001 (the test reports it)
                errors.append(f"copy {s}: {type(e).__name__}: {str(e)[:600]}")
                continue
            want = (np.arange(n, dtype=np.float32) + v) * 2.0 + 1.0 + 3.0
            if not np.array_equal(got, want):
                bad.append([s, float(got[0]), float(want[0])])
        return {"connected_s": connected_s, "s": time.monotonic() - t0, "bad": bad,
                "errors": errors}

    return _answer_rounds(ready, connect)


def test_two_eager_clients_connecting_at_once_move_every_tensor(log_dir, plugin_built,
                                                                slow_resolver):
    """A worker and a ps process (each round a new server for each, knowing
    only itself) and 2 eager client processes; 3 rounds. Each round the
    clients call connect_to_cluster 0.5 s apart, each naming the worker, the
    ps and itself: two context creations on the worker, two AddPeers calls
    naming the same new peer (the ps), the second during the first's
    choice, which takes 7 s (the worker's route threads resolve the ps's
    name slowly); on the ps likewise (the worker), chosen at once. So the
    ps pushes to a worker whose route to it is still pending. Each client
    at once moves a 64 KiB tensor ps -> worker -> ps and reads it, 3
    times. Strict mode. Every round: each connect returns without waiting
    for the choice (< 5 s), no copy fails or hangs (45 s deadline), values
    exact, worker and ps each received exactly 2 x 3 tensors from the other
    over the transport (and the ps pushed the 6 results to the clients),
    none over gRPC, and each routes the other over shm.
    (Before e2945aa: the first client's connect took 7 s, the second's 5 s,
    and the second client's copies failed: no route to the ps on the
    worker.)"""
    base = dict(STRICT, LD_PRELOAD=slow_resolver, GRPC_DNS_RESOLVER="native",
                SLOW_RESOLVER_THREAD="rdev-route", RDMA_DEVICE_ARENA_BYTES="64M")

    def task(name, role, resolve_ms):
        return harness.Task(dict(role=f"test_review_regressions.{role}", cluster={}, job="none",
                                 task=0, protocol=harness.PROTOCOL_RDMA), log_dir,
                            dict(base, SLOW_RESOLVER_MS=str(resolve_ms)), name=name)

    worker = task("join-worker", "server_rounds", WORKER_RESOLVE_MS)
    ps = task("join-ps", "server_rounds", 0)
    clients = [task(f"join-client-{k}", "eager_client_rounds", 0) for k in range(2)]
    everyone = [worker, ps] + clients
    try:
        for t in everyone:
            t.wait_ready()
        for rnd in range(JOIN_ROUNDS):
            wj, pj = f"w{rnd}", f"p{rnd}"
            ports = harness.free_ports(4)
            w_addr, p_addr = f"{wj}.slow.test:{ports[0]}", f"{pj}.slow.test:{ports[1]}"
            worker.command("serve", cluster={wj: [w_addr]}, job=wj, task=0,
                           protocol=harness.PROTOCOL_RDMA)
            ps.command("serve", cluster={pj: [p_addr]}, job=pj, task=0,
                       protocol=harness.PROTOCOL_RDMA)
            before = dict(zip(("worker", "ps"), _counters([worker, ps])))
            at = time.time() + 0.3
            for k, c in enumerate(clients):
                cj = f"c{rnd}x{k}"
                c.send("connect", cluster={wj: [w_addr], pj: [p_addr],
                                           cj: [f"127.0.0.1:{ports[2 + k]}"]},
                       job=cj, client=k, worker=f"/job:{wj}/replica:0/task:0/device:CPU:0",
                       ps=f"/job:{pj}/replica:0/task:0/device:CPU:0", n=JOIN_ELEMENTS,
                       copies=JOIN_COPIES, at=at + k * CLIENT_STAGGER_S,
                       protocol=harness.PROTOCOL_RDMA)
            replies = _round_replies(clients, rnd, JOIN_DEADLINE_S, everyone)
            after = dict(zip(("worker", "ps"), _counters([worker, ps])))
            delta = {t: {k: after[t][k] - before[t][k] for k in after[t]} for t in after}
            print(f"round {rnd}: " + "; ".join(
                f"connect {r['connected_s']:.2f} s, all {r['s']:.2f} s" for r in replies)
                + f"; {delta}")
            for c, r in zip(clients, replies):
                assert r["errors"] == [], (rnd, c.name, r["errors"], worker.log_tail())
                assert r["bad"] == [], (rnd, c.name, r["bad"])
                assert r["connected_s"] < 5.0, (rnd, c.name, r)
            moved = 2 * JOIN_COPIES  # per direction, both clients
            # The ps also pushes each result to its client (the read).
            assert delta == {
                "worker": {"tensors_received": moved, "tensors_pushed": moved,
                           "fallback_tensors": 0},
                "ps": {"tensors_received": moved, "tensors_pushed": 2 * moved,
                       "fallback_tensors": 0}}, delta
            w_routes = worker.command("stats", timeout=30)["peers"]
            p_routes = ps.command("stats", timeout=30)["peers"]
            assert w_routes.get(f"/job:{pj}/replica:0/task:0") == "shm", w_routes
            assert p_routes.get(f"/job:{wj}/replica:0/task:0") == "shm", p_routes
        _end_rounds(everyone)
    finally:
        for t in everyone:
            t.close()


# --------------------------------------------------------------------------
# 3. An abort fails a collective receive whose key was reused or forgotten
# --------------------------------------------------------------------------

ABORT_BOUND_MS = 2000

# One executor's collective bookkeeping on a receiver (A), kept exactly as
# collective_rma.cc keeps it (Steps::Next before the receive, RecvDone first
# thing in its callback), over two real transports in this process (A and B,
# shm), then collectives' abort path (AbortTransfers, as StartAbort calls it).
_ABORT_MAIN = r"""
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>

#include "collective_steps.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/protobuf/cluster.pb.h"
#include "transport.h"

using namespace rdma_device;
using Clock = std::chrono::steady_clock;

struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  absl::Status status;
  float first = -1;
  void Set(const absl::Status& s, const tf::Tensor& t) {
    std::lock_guard<std::mutex> l(mu);
    done = true;
    status = s;
    if (s.ok() && t.NumElements() > 0) first = t.flat<float>()(0);
    cv.notify_all();
  }
  bool Wait(int ms) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, std::chrono::milliseconds(ms), [&] { return done; });
  }
};

static void Fail(const std::string& why) {
  std::printf("RESULT {\"error\": \"%s\"}\n", why.c_str());
  std::fflush(stdout);
  _exit(1);
}

int main(int argc, char** argv) {
  if (argc != 5) Fail("usage: mode portA portB bound_ms");
  const std::string mode = argv[1];
  const std::string addr_a = std::string("127.0.0.1:") + argv[2];
  const std::string addr_b = std::string("127.0.0.1:") + argv[3];
  const int bound_ms = std::atoi(argv[4]);
  const std::string A = "/job:worker/replica:0/task:0", B = "/job:worker/replica:0/task:1";
  tf::ClusterDef cluster;
  auto* job = cluster.add_job();
  job->set_name("worker");
  (*job->mutable_tasks())[0] = addr_a;
  (*job->mutable_tasks())[1] = addr_b;
  auto a = std::make_shared<Transport>();
  auto b = std::make_shared<Transport>();
  a->AddPeers(cluster);
  b->AddPeers(cluster);
  absl::Status s = a->Start(A, addr_a);
  if (!s.ok()) Fail(std::string(s.message()));
  s = b->Start(B, addr_b);
  if (!s.ok()) Fail(std::string(s.message()));
  const auto routed_by = Clock::now() + std::chrono::seconds(10);
  while (!(a->Serves(B) && b->Serves(A))) {
    if (Clock::now() > routed_by) Fail("routes not chosen within 10 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  auto steps = std::make_shared<Steps>(/*exec_step=*/42, /*generation=*/0);
  // A ring all-reduce chunk's buffer key: "group:instance:frame:iter" then
  // "pass:section:rank".
  const std::string key = "3:17:0:0:0:1:1";
  const std::string wire = WireKey(B + "/device:CPU:0", A + "/device:CPU:0", Split(key).edge,
                                   1024 * sizeof(float));
  auto post = [&](const std::string& k, uint64_t* step, std::shared_ptr<Outcome> out) {
    bool new_peer = false;
    absl::Status st = steps->Next(k, Split(k).instance, /*recv=*/true, B, step, &new_peer);
    if (!st.ok()) Fail("Next: " + std::string(st.message()));
    const uint64_t mine = *step;
    st = a->Recv(B, wire, mine,
                 [steps, mine, out](const absl::Status& s, const tf::Tensor& t, bool) {
                   steps->RecvDone(mine);
                   out->Set(s, t);
                 });
    if (!st.ok()) Fail("Recv: " + std::string(st.message()));
  };

  uint64_t s0 = 0;
  auto waiting = std::make_shared<Outcome>();
  post(key, &s0, waiting);  // in flight: its chunk never comes
  long later = 0;
  if (mode == "reused") {
    // The key's next use: posted, and its chunk arrives from B.
    uint64_t s1 = 0;
    auto second = std::make_shared<Outcome>();
    post(key, &s1, second);
    tf::Tensor t(tf::DT_FLOAT, tf::TensorShape({1024}));
    for (int i = 0; i < 1024; ++i) t.flat<float>()(i) = 7.0f + i;
    bool refused = false;
    s = b->Send(A, wire, s1, t, false, [](const absl::Status&) {}, &refused);
    if (!s.ok()) Fail("Send: " + std::string(s.message()));
    if (!second->Wait(10000)) Fail("the second use's chunk did not arrive within 10 s");
    if (!second->status.ok() || second->first != 7.0f) Fail("the second use's chunk is wrong");
    later = 1;
  } else if (mode == "forgotten") {
    // Receives of other keys, each ended, until the use counts forget `key`.
    for (size_t i = 0; i < 2 * Counts::kKeep + 8; ++i) {
      uint64_t st = 0;
      bool np = false;
      const std::string k = "3:" + std::to_string(1000 + i) + ":0:0:0:1:1";
      if (!steps->Next(k, Split(k).instance, true, B, &st, &np).ok()) Fail("Next");
      steps->RecvDone(st);
      ++later;
    }
  } else {
    Fail("unknown mode");
  }
  if (waiting->Wait(200)) Fail("the waiting receive ended before the abort");

  const auto t0 = Clock::now();
  bool first = false;
  AbortTransfers(a, steps, absl::UnavailableError("aborted by the test"), &first);
  const bool ended = waiting->Wait(bound_ms);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  std::string msg = ended ? std::string(waiting->status.message()) : "";
  for (char& c : msg) if (c == '"' || c == '\\' || c == '\n') c = ' ';
  std::printf("RESULT {\"mode\": \"%s\", \"later_uses\": %ld, \"first\": %s, \"ended\": %s, "
              "\"ok\": %s, \"ms\": %.1f, \"message\": \"%s\"}\n",
              mode.c_str(), later, first ? "true" : "false", ended ? "true" : "false",
              ended && waiting->status.ok() ? "true" : "false", ms, msg.c_str());
  std::fflush(stdout);
  _exit(0);  // the receive may still be posted (on the code before the fix)
}
"""

# The shim's sources the program needs (Steps, AbortTransfers, Transport, pools).
_SHIM_SOURCES = ["collective_steps.cc", "pool.cc", "transport.cc", "transport_routes.cc",
                 "transport_calls.cc", "transport_status.cc"]


def _tf_dir():
    import importlib.util

    spec = importlib.util.find_spec("tensorflow")
    return list(spec.submodule_search_locations)[0]


@pytest.fixture(scope="module")
def abort_program(request, plugin_built):
    """Builds the program (cached in pytest's cache, keyed by every source
    and header it compiles, the flags and the libraries' identity)."""
    import rdma_device

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.fail("no C++ compiler (g++) to build the collective abort program")
    lib_dir = rdma_device.lib_dir()
    with open(os.path.join(lib_dir, "build_info.json")) as f:
        build = json.load(f)
    tf_dir = _tf_dir()
    # The shim's own flags (NDEBUG is mandatory: CMakeLists.txt).
    flags = [f for f in build["compile_flags"].split("|") if not f.startswith("-I")]
    flags = [f if not f.startswith("--std") else "-std=c++17" for f in flags]
    flags += ["-O1", "-w", "-DNDEBUG", "-fPIC", "-I" + os.path.join(REPO, "tf_plugin"),
              "-I" + os.path.join(REPO, "include"), "-isystem", os.path.join(tf_dir, "include")]
    rdev = os.path.realpath(os.path.join(lib_dir, "librdma_device.so"))
    h = hashlib.sha256()
    h.update(_ABORT_MAIN.encode())
    h.update(" ".join([cxx] + flags + [rdev, str(os.path.getmtime(rdev)), tf_dir]).encode())
    plugin = os.path.join(REPO, "tf_plugin")
    for name in sorted(os.listdir(plugin)) + ["../include/rdma_device.h"]:
        if name.endswith((".h", ".cc")) and (name in _SHIM_SOURCES or name.endswith(".h")):
            with open(os.path.join(plugin, name), "rb") as f:
                h.update(name.encode() + f.read())
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    if cache is not None:
        out_dir = str(cache.mkdir("review_regressions_abort"))
    else:
        out_dir = str(request.getfixturevalue("tmp_path_factory").mktemp("abort_program"))
    exe = os.path.join(out_dir, f"abort_{h.hexdigest()[:16]}")
    if os.path.exists(exe):
        return exe
    work = os.path.join(out_dir, f"work_{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    main = os.path.join(work, "main.cc")
    with open(main, "w") as f:
        f.write(_ABORT_MAIN)
    sources = [main] + [os.path.join(plugin, s) for s in _SHIM_SOURCES]
    procs = []
    for src in sources:
        obj = os.path.join(work, os.path.basename(src) + ".o")
        procs.append((src, obj, subprocess.Popen([cxx] + flags + ["-c", src, "-o", obj],
                                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                 text=True)))
    for src, _obj, p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"compiling {src} failed:\n{out[-4000:]}"
    link = [cxx, "-o", exe + ".tmp"] + [o for _s, o, _p in procs] + [
        "-L" + tf_dir, "-l:libtensorflow_framework.so.2", "-l:libtensorflow_cc.so.2",
        "-L" + os.path.dirname(rdev), "-lrdma_device",
        "-Wl,-rpath," + tf_dir + ":" + os.path.dirname(rdev), "-Wl,--no-undefined"]
    r = subprocess.run(link, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"linking failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
    os.replace(exe + ".tmp", exe)
    shutil.rmtree(work, ignore_errors=True)
    return exe


@pytest.mark.parametrize("mode", ["reused", "forgotten"])
def test_abort_fails_a_collective_receive_no_longer_the_latest_use_of_its_key(mode,
                                                                            abort_program):
    """A collective receive of chunk key K is in flight (its sender never
    sends it). Then "reused": K's next use is received (its chunk arrives),
    so K's latest use has ended; or "forgotten": 131080 receives of other
    keys end, so the executor's use counts forget K (2 x 65536). Then the
    executor aborts (AbortTransfers, as StartAbort does): the waiting
    receive must fail, with the abort's status, within 2 s. Before d907e34
    the abort failed only the latest use of each key still remembered
    (Steps::Abort over Counts::ForEach): in both cases the waiting receive
    was not among them and waited on (checked by building this program
    against d907e34^'s collective_steps.h: not ended after 5 s, both modes).

    Why not through TensorFlow: "forgotten" needs 131072 collective
    receive keys in one executor while one receive waits (an eager MWMS
    all-reduce of 2 workers uses 2 receive keys per call: 65536 calls);
    "reused" needs two receives of the same full buffer key (group,
    instance, frame, iteration, pass, chunk, rank) in flight in one
    executor with the later one completed first, which TF's collectives
    never issue (instance keys name one launch). The abort path, the
    bookkeeping and the transport are the shim's real code."""
    ports = harness.free_ports(2)
    env = harness.task_env({"TF_CPP_MIN_LOG_LEVEL": "2"})
    r = subprocess.run([abort_program, mode, str(ports[0]), str(ports[1]), str(ABORT_BOUND_MS)],
                       capture_output=True, text=True, timeout=60, env=env)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"rc={r.returncode}\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    print(res)
    assert "error" not in res, res
    assert res["first"] is True, res
    assert res["later_uses"] == (1 if mode == "reused" else 2 * 65536 + 8), res
    assert res["ended"] is True, (
        f"the waiting receive was not failed within {ABORT_BOUND_MS} ms: {res}")
    assert res["ok"] is False and "aborted by the test" in res["message"], res
    assert res["ms"] < ABORT_BOUND_MS, res
