"""The NCCL communicator TensorFlow creates reaches the collective executor
manager over the transport, as under stock gRPC.

A CPU-only TensorFlow creates none (MaybeCreateNcclCommunicator returns
null), so every task here runs under an LD_PRELOAD (fake_nccl/fake_nccl.cc)
whose MaybeCreateNcclCommunicator returns a fake communicator that logs
what is done to it. Two MultiWorkerMirroredStrategy workers all-reduce
once, then each aborts its collectives (abort_collective_ops, UNAVAILABLE,
a message naming it). TF's BaseCollectiveExecutor::StartAbort passes the
abort on to `GetNcclCommunicator()` of its manager when that holds one: the
fake's log must show its StartAbort with the task's message, on the
communicator the server created (over the transport: created by the
shim), never used after it was destroyed, destroyed at most once; the same
under "grpc" and "grpc+rdma_device". A manager given null instead (the
shim once did: a CUDA build's NcclReducer then dereferenced it) makes
TF's StartAbort skip the communicator, and the log shows no abort."""

import collections

import pytest

import harness

DEADLINE = 120  # seconds for a cluster's first all-reduce, start included
STRICT = {"RDMA_DEVICE_STRICT": "1"}
UNAVAILABLE = 14

# Who calls MaybeCreateNcclCommunicator for the server's collective manager.
SERVER_CREATOR = {harness.PROTOCOL_GRPC: "libtensorflow_cc.so.2",
                  harness.PROTOCOL_RDMA: "librdma_device_tf.so"}


@pytest.fixture(scope="module")
def fake_nccl(tmp_path_factory):
    return harness.build_preload_cxx(tmp_path_factory, "fake_nccl", "the fake NCCL communicator")


def message(task):
    return f"fake-nccl test: task {task} aborts its collectives"


def run_cluster(protocol, fake_nccl, log_dir, tmp_path):
    """Two workers all-reduce, then each aborts; (results, fake logs)."""
    cluster = {"worker": harness.make_cluster({"worker": 2})["worker"]}
    logs = [str(tmp_path / f"fake_nccl.{protocol}.{i}.log") for i in range(2)]
    extra = STRICT if protocol == harness.PROTOCOL_RDMA else {}
    tasks = [harness.Task(dict(role="mwms_scenarios.nccl_abort", cluster=cluster, job="worker",
                               task=i, message=message(i), protocol=protocol), log_dir,
                          dict(extra, LD_PRELOAD=fake_nccl, FAKE_NCCL_LOG=logs[i]))
             for i in range(2)]
    try:
        for t in tasks:
            t.wait_ready()
        try:
            for t in tasks:
                t.expect("REDUCED", DEADLINE)
            for t in tasks:
                t.send("abort")
            results = [t.result(60) for t in tasks]
        except TimeoutError:
            pytest.fail(f"{protocol}: the all-reduce or the abort hung\n" +
                        "\n".join(t.dump_stacks() for t in tasks))
    finally:
        for t in tasks:
            t.close()
    return results, [read_log(p) for p in logs]


def read_log(path):
    """[(event, communicator number, rest of the line)] in order."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        event, number, *rest = line.split(" ", 2)
        out.append((event, int(number), rest[0] if rest else ""))
    return out


def by_communicator(log):
    """{number: [event, ...]}, each communicator's events in order (the
    library that created it left out)."""
    out = collections.defaultdict(list)
    for event, number, rest in log:
        out[number].append(event if event != "start_abort" else f"start_abort {rest}")
    return dict(out)


def check_log(protocol, task, log):
    """What TF did with the communicators of one task; returns the number
    of the one the abort reached."""
    where = f"{protocol}, task {task}: fake communicator log {log}"
    aborts = [(number, rest) for event, number, rest in log if event == "start_abort"]
    assert aborts, (f"{where}: the abort reached no NCCL communicator (the server's "
                    "collective manager holds none)")
    assert len(aborts) == 1, where
    number, rest = aborts[0]
    code, _, text = rest.partition(" ")
    assert int(code) == UNAVAILABLE and message(task) in text, where
    # The communicator the server's collective manager was built with.
    creators = {n: rest for event, n, rest in log if event == "created"}
    assert creators.get(number) == SERVER_CREATOR[protocol], where
    # Each one destroyed at most once, and never used after.
    for n, events in by_communicator(log).items():
        if "destroyed" in events:
            assert events.count("destroyed") == 1 and events[-1] == "destroyed", \
                f"{where}: communicator {n} used after it was destroyed, or destroyed twice"
    # The group leader's param resolver asked that same communicator for
    # the group's communicator key (a CPU group needs none; TF asks the
    # resolver's communicator for one whenever it has one).
    keys = {n for event, n, _ in log if event == "key"}
    assert keys == ({number} if task == 0 else set()), \
        f"{where}: the leader's param resolver asked communicators {keys} for a key"
    return number


def test_the_server_collective_manager_holds_tfs_nccl_communicator(fake_nccl, log_dir, tmp_path,
                                                                    plugin_built):
    import numpy as np

    want = sum(np.arange(256, dtype=np.float32) * (i + 1) + i for i in range(2)).tobytes().hex()
    seen = {}
    for protocol in (harness.PROTOCOL_GRPC, harness.PROTOCOL_RDMA):
        results, logs = run_cluster(protocol, fake_nccl, log_dir, tmp_path)
        for task, (r, log) in enumerate(zip(results, logs)):
            print(f"{protocol}, task {task}: {log}")
            assert r["sum"] == want, (protocol, task)
            # The user's next collective fails with the abort's message.
            assert r["after_abort"] is not None and r["after_abort"].startswith(
                "UnavailableError") and message(task) in r["after_abort"], (protocol, task, r)
            check_log(protocol, task, log)
        seen[protocol] = [by_communicator(log) for log in logs]
    # The same communicators, the same calls on each, as under stock gRPC.
    assert seen[harness.PROTOCOL_RDMA] == seen[harness.PROTOCOL_GRPC], seen
