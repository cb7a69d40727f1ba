"""The suite's floor (``rdma_device.bench.floor``) on two workloads of the
suite: the pipeline (stages on different workers, activations worker to
worker) and wide & deep (gradients, some IndexedSlices, averaged on the
ps). What the floor's headroom column relies on: a floor step runs every
op the cross-task step runs, each on the same task (so the pipeline keeps
its stages apart and the ps still averages the workers' gradients), and no
tensor crosses tasks in it, where the cross-task step moves dozens.
"""

import pytest

from rdma_device._cluster import LocalCluster

SKIP = {"Const", "NoOp", "_Send", "_Recv", "_HostSend", "_HostRecv"}


@pytest.fixture(scope="module")
def cluster(plugin_built, log_dir):
    c = LocalCluster("grpc+rdma_device", {"ps": 1, "worker": 2}, env={"RDMA_DEVICE_STRICT": "1"},
                     log_dir=log_dir, name="floor")
    yield c
    c.close()


def _ran(tf, sess, fetch):
    """{task: {(op name, op type)}} of one traced step: what each task ran."""
    meta = tf.compat.v1.RunMetadata()
    sess.run(fetch, options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
             run_metadata=meta)
    out = {}
    for d in meta.step_stats.dev_stats:
        task = d.device.split("/device:")[0]
        for ns in d.node_stats:
            # timeline_label: "name = Type(inputs)"
            kind = ns.timeline_label.split(" = ", 1)[-1].split("(", 1)[0]
            out.setdefault(task, set()).add((ns.node_name, kind))
    return out


def _moved(cluster):
    return sum(st["counters"].get("tensors_received", 0) + st["counters"].get("fallback_tensors", 0)
               for st in cluster.stats().values())


@pytest.mark.parametrize("name", ["pipeline", "wide_deep"])
def test_the_floor_runs_the_cross_task_step_with_nothing_crossing_tasks(cluster, name):
    import tensorflow as tf

    from rdma_device.bench import floor, suite, workloads

    tf.compat.v1.disable_eager_execution()
    g, init, op, _ = workloads.build(tf, name, cluster, 2, True)
    with tf.compat.v1.Session(cluster.target(), graph=g) as s:
        s.run(init)
        sizes = suite.cross_task_tensors(tf, s, op)
        s.run(op)
        crossed = _ran(tf, s, op)
        before = _moved(cluster)
        for _ in range(3):
            s.run(op)
        moved = _moved(cluster) - before
    # The cross-task step moves every tensor the partition graphs send.
    assert moved >= 3 * len(sizes) > 0, (moved, len(sizes))

    g2, init2, op2, _ = workloads.build(tf, name, cluster, 2, True)
    fl = floor.build_floor(tf, g2, init2, op2, cluster)
    try:
        fl.session.run(fl.targets)
        ran = _ran(tf, fl.session, fl.targets)
        before = _moved(cluster)
        for _ in range(3):
            fl.session.run(fl.targets)
        assert _moved(cluster) == before, "a floor step moved tensors between tasks"
    finally:
        fl.session.close()
    # Each task holds its own copy of each tensor it would receive: as many
    # tensors and bytes as the cross-task step sends.
    assert (fl.copies, fl.copied_bytes) == (len(sizes), sum(sizes))
    # Every op the cross-task step ran on a task (its constants aside,
    # which the graph optimizer may fold or share under other names) the
    # floor ran on that same task.
    for task, ops in crossed.items():
        want = {(n, k) for n, k in ops if k not in SKIP}
        missing = want - ran.get(task, set())
        assert not missing, (task, sorted(missing)[:10])
    # Work on every task: both pipeline stages' matmuls (one per worker),
    # the ps's update.
    for task in crossed:
        assert any(k == "MatMul" for _, k in ran[task]) or task.startswith("/job:ps"), (task, ran[task])
    assert any(k.startswith("ResourceApply") or k.startswith("ResourceScatter") for _, k in ran["/job:ps/replica:0/task:0"])
