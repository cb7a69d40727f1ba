"""Server teardown while per-step worker RPCs arrive over the transport.

The transport serves RunGraph and CleanupGraph by calling into the
server's worker through a raw pointer (worker_rpc.cc). What TensorFlow
2.21 does to a server whose owner changes or resets it:

- A started server is never destroyed: ~GrpcServer calls
  TF_CHECK_OK(Stop()), and Stop() of a started server returns
  Unimplemented ("Clean shutdown is not currently implemented"), so the
  process aborts before anything is freed. Hence the owners leak it: the
  eager context when its server is replaced or the context goes
  (EagerContext::~EagerContext, SetMasterContextState,
  StoreCollectiveOpsServer: "Unable to destroy server_ object, so
  releasing instead"), and tf.distribute.Server.__del__ (TF_ServerStop
  only; "we leak instead of calling TF_DeleteServer").
- A changed server definition runs GrpcServer::UpdateServerDef on the
  running server; a changed cluster through connect_to_cluster asks for a
  new server for the task (set_server_def), which cannot bind the port
  the running one holds: "UnknownError: Could not start gRPC server", the
  context unchanged.
- A server never started is destroyed: TF_DeleteServer (c_api.h: such a
  server "will not serve any requests until TF_ServerStart"), and the
  eager context on an error between creating its server and starting it
  (context_distributed_manager.cc: "We start the server after all other
  initialization, because the GrpcServer cannot be destroyed after it is
  started").

So serving over the transport starts in Start(), not Init (server.cc):
the one kind of server TF frees never serves a call. Before, a stale
master's CleanupGraph ran on a server TF_DeleteServer was deleting
(SIGSEGV in Worker::CleanupGraphAsync).
"""

import signal
import subprocess
import time

import pytest

import harness

STRICT = {"RDMA_DEVICE_STRICT": "1"}
CRASH_MARKS = ("Segmentation fault", "Fatal Python error", "Check failed", "Aborted (core")


def _task_env(protocol):
    # Python's stacks in the log if a task crashes.
    return dict(STRICT if protocol != harness.PROTOCOL_GRPC else {}, PYTHONFAULTHANDLER="1")


def _assert_alive(tasks, within=2.0):
    """No task exited (a crash may come a moment after the last call)."""
    deadline = time.monotonic() + within
    for t in tasks:
        try:
            rc = t.proc.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # still running: what we want
            rc = None
        assert rc is None, f"{t.name} exited with {rc}\n{t.log_tail(80)}"
        log = t.log_tail(100000)
        assert not any(m in log for m in CRASH_MARKS), f"{t.name} crashed\n{t.log_tail(80)}"


def test_eager_task_changes_and_resets_its_server_while_run_graph_arrives(log_dir, plugin_built):
    """Worker 0 is an eager task (experimental_connect_to_cluster at its
    address in the cluster); worker 1's TF1 master steps on it without a
    pause: x (4096 float32) goes to worker 0, y = 2 x + 1 comes back,
    checked exactly. Meanwhile, for 8 s, worker 0 changes its server in
    every way TF allows an eager task at a fixed address (connect again,
    a ps added and removed by update_server_def, a changed cluster by
    connect_to_cluster), then resets its context and connects again.

    Asserted: each change of definition succeeds, each new server for the
    task fails with TF's own error (its port is held by the running
    server, which TF never frees); every step under the changes returns
    the exact values, none fails, none takes over 10 s; 20 steps after
    them too; every RunGraph and CleanupGraph went over the transport (two
    per step, none over gRPC) and every tensor too; no task crashed.

    Not compared with stock gRPC: there the same run crashes (SIGSEGV in
    WorkerCacheWrapper::ReleaseWorker when the session closes) or hangs,
    because GrpcServer::UpdateServerDef deletes the default worker cache
    (SessionMgr::ResetDefaultWorkerCache) that a worker session created
    without a cluster (a master without ClusterSpec propagation) wraps by
    raw pointer, and stock's RecvTensor on worker 0 goes through it. Over
    the transport no tensor goes through a worker session's cache."""
    protocol = harness.PROTOCOL_RDMA
    jobs = harness.make_cluster({"worker": 2, "ps": 1})
    env = _task_env(protocol)
    tasks = [
        harness.Task(dict(role="server", cluster=jobs, job="ps", task=0, protocol=protocol),
                     log_dir, env),
        harness.Task(dict(role="teardown_scenarios.eager_server_resets", cluster=jobs,
                          job="worker", task=0, protocol=protocol, seconds=8), log_dir, env),
        harness.Task(dict(role="teardown_scenarios.tf1_steps_on_eager_task", cluster=jobs,
                          job="worker", task=1, protocol=protocol, after=20), log_dir, env),
    ]
    _, eager, master = tasks
    try:
        # Both wait for each other: the eager connect asks worker 1 for
        # its devices, the master's session asks worker 0.
        for t in tasks:
            t.wait_ready()
        master.expect("STEPPING", 120)
        t0 = time.monotonic()
        eager.send("go")
        try:
            changes = eager.result(60)
            master.send("stop")
            steps = master.result(60)
        except (TimeoutError, RuntimeError) as e:
            pytest.fail(f"{e}\n" + "\n".join(t.dump_stacks() for t in tasks))
        took = time.monotonic() - t0
        _assert_alive(tasks)
    finally:
        for t in reversed(tasks):
            t.close()

    assert changes["probe"] == 21.0
    outcomes = changes["outcomes"]
    kinds = {}
    for o in outcomes:
        kinds.setdefault(o["kind"], []).append(o)
        assert o["seconds"] < 10, o
    for kind in ("same", "grow", "shrink", "new"):
        assert len(kinds.get(kind, [])) >= 10, {k: len(v) for k, v in kinds.items()}
    refused = "UnknownError: Could not start gRPC server"
    for kind in ("same", "grow", "shrink"):
        assert all(o["outcome"] == "ok" for o in kinds[kind]), kinds[kind]
    for kind in ("new", "reset"):
        assert all(o["outcome"] == refused for o in kinds[kind]), kinds[kind]
    assert len(kinds["reset"]) == 1

    during, after = steps["during"], steps["after"]
    assert during["ok"] > 0 and during["wrong"] == 0 and during["failed"] == 0, during
    assert during["slowest"] < 10, during
    assert after["ok"] == 20 and after["wrong"] == 0 and after["failed"] == 0, after
    c = steps["stats"]["counters"]
    n = during["ok"] + after["ok"]
    assert c["worker_rpcs_over_transport"] == 2 * n and c["worker_rpcs_over_grpc"] == 0, c
    assert c["tensors_pushed"] == n and c["tensors_received"] == n, c
    assert c["fallback_tensors"] == 0, c
    print(f"{len(outcomes)} server changes in {took:.1f} s under {during['ok']} steps "
          f"(slowest {during['slowest'] * 1e3:.1f} ms); {c['worker_rpcs_over_transport']} worker "
          f"RPCs over the transport")


@pytest.mark.parametrize("protocol", [harness.PROTOCOL_GRPC, harness.PROTOCOL_RDMA])
def test_a_server_never_started_is_deleted_while_a_stale_master_calls(protocol, log_dir,
                                                                      plugin_built):
    """Worker 0 is SIGKILLed under worker 1's master, which keeps stepping
    its old session (each step a 2 s deadline). Worker 0 comes back and
    40 times creates a server for its address with TF's C API
    (TF_NewServer, never started), holds it 150 ms and deletes it
    (TF_DeleteServer): what the eager context does on its errors between
    creating and starting a server. Then it starts a server for good and
    the master steps a new session.

    Asserted, under stock gRPC and over the transport alike: worker 0 never
    crashes; every stale step fails within its deadline + 3 s and none was
    run by a server never started (no "Session handle is not found"); the
    new session's 20 steps return the exact values. Over the transport,
    stale calls did reach the servers never started and were refused
    ("this task serves no calls over the transport"), and each of the new
    session's RunGraph and CleanupGraph is counted once. Before serving
    moved to Start(), worker 0 died of SIGSEGV in its first
    TF_DeleteServer (Worker::CleanupGraphAsync on the deleted session
    manager).

    Strict over the transport: a connection attempt that meets the
    listener of a server being deleted is refused as a lost peer, to be
    retried, not as a task that does not run the transport. Before, the
    refusal said "not viable" and the master routed worker 0 over stock
    gRPC for good: every step of the new session failed in strict mode."""
    jobs = harness.make_cluster({"worker": 2})
    env = _task_env(protocol)
    first = harness.Task(dict(role="server", cluster=jobs, job="worker", task=0,
                              protocol=protocol), log_dir, env)
    master = harness.Task(dict(role="teardown_scenarios.tf1_stale_master", cluster=jobs,
                               job="worker", task=1, protocol=protocol, timeout_ms=2000,
                               after=20), log_dir, env)
    again = None
    try:
        first.wait_ready()
        master.wait_ready()
        master.expect("STEPPING", 120)
        first.kill(signal.SIGKILL)
        master.expect("FAILED", 30)
        again = harness.Task(dict(role="teardown_scenarios.unstarted_servers", cluster=jobs,
                                  job="worker", task=0, protocol=protocol, rounds=40,
                                  hold_ms=150), log_dir, env)
        try:
            again.wait_ready()
            again.expect("DELETED", 60)
            master.send("stop")
            master.expect("STOPPED", 30)
            again.send("start")
            servers = again.result(60)
            master.send("resume")
            steps = master.result(60)
        except (TimeoutError, RuntimeError) as e:
            pytest.fail(f"{e}\n" + "\n".join(t.dump_stacks() for t in (master, again)))
        _assert_alive([master, again])
    finally:
        for t in (master, again, first):
            if t is not None:
                t.close()

    assert servers == {"created": 40, "failures": []}, servers
    errors = steps["errors"]
    assert steps["good_after_failed"] == 0 and errors, steps
    assert steps["slowest"] < 2 + 3, steps["slowest"]
    assert not [e for e in errors if "Session handle is not found" in e], errors
    assert steps["after"] == {"ok": 20, "wrong": 0}, steps["after"]
    refused = [e for e in errors if "this task serves no calls over the transport" in e]
    if protocol == harness.PROTOCOL_RDMA:
        assert refused, errors
        c = steps["stats"]["counters"]
        assert c["worker_rpcs_over_transport"] + c["worker_rpcs_over_grpc"] == 2 * 20, c
    else:
        assert not refused, errors
    print(f"{protocol}: {len(errors)} stale steps failed ({len(refused)} refused by a server "
          f"never started), slowest {steps['slowest']:.2f} s")
