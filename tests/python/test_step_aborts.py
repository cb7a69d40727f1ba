"""TensorFlow's normal end of a step is never told to peers as a step
abort; a step that fails is, once by each task whose part of it failed, and
its peers fail it promptly.

A real 3-task cluster (chief client, worker, ps) over the transport, in
strict mode, fresh for each test; every task's counters are read after
each phase of the client's scenario (abort_scenarios.py):
- TF1: STEPS normal steps whose tensors cross every task, each cleaned up
  on every task (`steps_ended`): no step abort told or heard anywhere
  (`aborts_propagated`, `aborts_received`), from the tasks' start on; one
  step whose assertion fails on the ps: a TF error naming it within
  seconds, and each task told its peers once; STEPS normal steps again;
- eager: tf.function calls across tasks and op-by-op copies (the eager
  context's own step), cleaned up on the worker and the ps; a call whose
  op on the worker fails (the worker tells its peers once) and an op-by-op
  failure (nothing: the eager context's step lives on); a call cancelled
  while the worker waits on the ps (each tells the other and the client
  once); good calls again.

TF aborts a step's rendezvous at its cleanup only when one is still alive
then (a push's completion racing the end of the step): a few steps in a
hundred here, which is why STEPS is large.
"""

import time

import harness
from conftest import ServerSet

STRICT = {"RDMA_DEVICE_STRICT": "1"}
STEPS = 100
CALLS = 10
# A failed step's error reaches the client within this many seconds.
FAIL_WITHIN_S = 5.0
SETTLE_S = 10.0
TASKS = ("chief", "worker", "ps")
NAMES = ("aborts_propagated", "aborts_received")


def _delta(a, b, name):
    return {t: b[t][name] - a[t][name] for t in TASKS}


def _each(n):
    return {t: n for t in TASKS}


def _run(servers, role, settled, **kw):
    """Runs a pausing scenario of abort_scenarios.py; returns {phase:
    (pause payload, every task's counters)}. At a pause the counters are
    read until `settled[phase](counters before, counters now)` holds (TF's
    cleanups, and peers' messages, land after a step returned), or for
    SETTLE_S."""
    client = harness.Task(dict(role=role, cluster=servers.cluster, job="chief", task=0,
                               protocol=servers.protocol, **kw),
                          servers.log_dir, servers.env)
    tasks = dict(zip(TASKS, [client, *servers.servers]))  # servers: worker, ps
    out = {}
    before = None
    try:
        client.wait_ready()
        while "after" not in out:
            paused = client.expect("PAUSED", 120)
            done = settled.get(paused["phase"])
            deadline = time.monotonic() + SETTLE_S
            while True:
                now = {t: task.stats()["counters"] for t, task in tasks.items()}
                if before is None or done is None or done(before, now) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            out[paused["phase"]] = (paused, now)
            before = now
            client.proc.stdin.write("go\n")
            client.proc.stdin.flush()
        result = client.result(120)
        assert "error" not in result, (result, client.log_tail())
    finally:
        client.close()
    for phase, (_, c) in out.items():
        print(phase, {t: {k: c[t][k] for k in ("steps_ended", "tensors_received") + NAMES}
                      for t in TASKS})
    return out


def _grew(name, need):
    """settled(): each task's `name` grew by need[task] (default 0)."""
    return lambda a, b: all(b[t][name] - a[t][name] >= need.get(t, 0) for t in TASKS)


def _both(*fs):
    return lambda a, b: all(f(a, b) for f in fs)


def test_tf1_cleanups_are_not_aborts_and_a_failed_step_is_told_once(log_dir, plugin_built):
    servers = ServerSet(harness.PROTOCOL_RDMA, log_dir, env=STRICT)
    try:
        got = _run(servers, "abort_scenarios.tf1_steps_then_a_failure", {
            "normal": _grew("steps_ended", _each(STEPS)),
            "failed": _both(_grew("steps_ended", _each(1)), _grew("aborts_received", _each(2))),
            "after": _grew("steps_ended", _each(STEPS)),
        }, steps=STEPS)
    finally:
        servers.close()
    warm, normal, failed, after = (got[p][1] for p in ("warm", "normal", "failed", "after"))
    # The normal steps: each cleaned up on every task, tensors across
    # every task over the transport, and no abort since the tasks started.
    for t in TASKS:
        assert _delta(warm, normal, "steps_ended")[t] >= STEPS, (t, warm[t], normal[t])
        assert _delta(warm, normal, "tensors_received")[t] >= STEPS, (t, warm[t], normal[t])
    for name in NAMES:
        assert {t: normal[t][name] for t in TASKS} == _each(0), (name, normal)
    # The failed step: the ps's TF error, naming the failed assertion,
    # promptly (test_a_failure_on_the_ps_keeps_its_class_across_three_tasks
    # repeats it); the ps, whose assertion failed, told its peers once, and
    # so did the worker and the chief, whose parts waited on it.
    error = got["failed"][0]["error"]
    assert error is not None and error["type"] == "InvalidArgumentError", error
    assert "s must be positive" in error["message"], error
    assert got["failed"][0]["took"] < FAIL_WITHIN_S, got["failed"][0]
    assert _delta(normal, failed, "aborts_propagated") == _each(1), failed
    assert _delta(normal, failed, "aborts_received") == _each(2), failed
    # Normal steps again: nothing.
    for t in TASKS:
        assert _delta(failed, after, "tensors_received")[t] >= STEPS, (t, failed[t], after[t])
        assert after[t]["fallback_tensors"] == 0, (t, after[t])
    for name in NAMES:
        assert _delta(failed, after, name) == _each(0), (name, failed, after)


def test_eager_cleanups_are_not_aborts_and_a_failed_call_is_told_once(log_dir, plugin_built):
    servers = ServerSet(harness.PROTOCOL_RDMA, log_dir, env=STRICT)
    # The chief makes the calls: the worker and the ps clean up theirs.
    calls = {"worker": CALLS, "ps": CALLS}
    try:
        got = _run(servers, "abort_scenarios.eager_calls_then_a_failure", {
            "normal": _grew("steps_ended", calls),
            "failed": _grew("aborts_received", {"chief": 1, "ps": 1}),
            "cancelled": _grew("aborts_received", {"chief": 2, "worker": 1, "ps": 1}),
            "after": _grew("steps_ended", calls),
        }, calls=CALLS)
    finally:
        servers.close()
    warm, normal, failed, cancelled, after = (
        got[p][1] for p in ("warm", "normal", "failed", "cancelled", "after"))
    # Each good call moved the ps's tensor to the worker, and each copy
    # the ps's tensor to the worker and back: no abort since the start.
    for t in ("worker", "ps"):
        assert _delta(warm, normal, "steps_ended")[t] >= CALLS, (t, warm[t], normal[t])
        assert _delta(warm, normal, "tensors_received")[t] >= CALLS, (t, warm[t], normal[t])
    assert _delta(warm, normal, "tensors_received")["worker"] >= 2 * CALLS, (warm, normal)
    for name in NAMES:
        assert {t: normal[t][name] for t in TASKS} == _each(0), (name, normal)
    # The failed call's step failed on the worker, which told the ps and
    # the chief (the ps had sent its part; the chief waits on the call's
    # reply); the op-by-op failure ends nothing.
    payload = got["failed"][0]
    assert payload["errors"] == ["InvalidArgumentError"] * 2, payload
    assert payload["took"] < FAIL_WITHIN_S, payload
    assert _delta(normal, failed, "aborts_propagated") == {"chief": 0, "worker": 1, "ps": 0}, failed
    assert _delta(normal, failed, "aborts_received") == {"chief": 1, "worker": 0, "ps": 1}, failed
    # The cancelled call: the worker's receive and the ps's dequeue were
    # cancelled, each told the other and the chief once.
    assert got["cancelled"][0]["error"] == "CancelledError", got["cancelled"][0]
    assert _delta(failed, cancelled, "aborts_propagated") == {"chief": 0, "worker": 1, "ps": 1}, cancelled
    assert _delta(failed, cancelled, "aborts_received") == {"chief": 2, "worker": 1, "ps": 1}, cancelled
    # Good calls again: nothing.
    assert got["after"][0]["value"] == 4096 * 1.5 * 2.0, got["after"][0]
    assert _delta(cancelled, after, "tensors_received")["worker"] >= 2 * CALLS, (cancelled, after)
    for name in NAMES:
        assert _delta(cancelled, after, name) == _each(0), (name, cancelled, after)
    for t in TASKS:
        assert after[t]["fallback_tensors"] == 0, (t, after[t])


FAILURES = 40


def test_a_failure_on_the_ps_keeps_its_class_across_three_tasks(log_dir, plugin_built):
    """The ps's assertion fails while the worker waits on the ps's tensor,
    FAILURES times in a row, under stock gRPC and over the transport
    (strict). Stock's client always gets the ps's InvalidArgumentError: the
    worker's RecvTensor from the ps fails with the ps's own code. Over the
    transport the ps's abort carries its code to the worker, whose receive
    fails with it. Before it did, the worker's receive failed ABORTED (the
    derived mark lost in its RunGraph reply's body), and the client got
    AbortedError in 18 of 40 steps. A good step after the failures matches
    stock's."""
    got = {}
    for protocol, env in ((harness.PROTOCOL_GRPC, None), (harness.PROTOCOL_RDMA, STRICT)):
        servers = ServerSet(protocol, log_dir, env=env)
        try:
            got[protocol] = servers.run_client("abort_scenarios.tf1_failing_steps", timeout=300,
                                               failures=FAILURES)
        finally:
            servers.close()
    stock, ours = got[harness.PROTOCOL_GRPC], got[harness.PROTOCOL_RDMA]
    want = [["InvalidArgumentError", True]] * FAILURES
    assert stock["errors"] == want, "stock gRPC itself reported another class"
    classes = {}
    for e in ours["errors"]:
        classes[str(e)] = classes.get(str(e), 0) + 1
    assert ours["errors"] == want, classes
    assert ours["values"] == stock["values"]
    c = ours["stats"]["counters"]
    assert c["aborts_received"] >= FAILURES and c["fallback_tensors"] == 0, c
