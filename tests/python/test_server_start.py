"""A transport that cannot start fails server creation cleanly: before the
server binds its port or registers its master, so the same process can
create the server again at the same address and run steps on it.

(Before, the failure came after GrpcServer::Init: the server was torn down
with its master registered for in-process sessions, a pointer left
dangling for the next server of that address.)"""

import pytest

import harness

RESULT_TIMEOUT_S = 120


def test_bad_setting_fails_creation_and_leaves_nothing_behind(log_dir, plugin_built):
    cluster = harness.make_cluster({"worker": 2})
    task = harness.Task(dict(role="start_scenarios.bad_setting_then_good", cluster=cluster,
                             job="worker", task=0, protocol=harness.PROTOCOL_RDMA,
                             bad_var="RDMA_DEVICE_SLOTS_PER_EDGE", bad_value="0"), log_dir)
    try:
        task.wait_ready()
        try:
            r = task.result(RESULT_TIMEOUT_S)
        except TimeoutError:
            pytest.fail(f"the task hung\n{task.dump_stacks()}")
    finally:
        task.close()
    assert r["first"] is not None and "RDMA_DEVICE_SLOTS_PER_EDGE" in r["first"], r
    assert r["values"] == [i * 3 for i in range(8)], r
    # The second server started its transport: its peer has a route.
    assert r["peers"].get("/job:worker/replica:0/task:1") == "shm", r
