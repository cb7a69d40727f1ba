"""A "grpc+rdma_device://" target, as a cluster resolver with
``rpc_layer="grpc+rdma_device"`` hands it out (``master()``), runs TF1
sessions: the client reaches the master as for "grpc://" and the step's
tensors cross tasks over the transport, counted, with the same values as
through the "grpc://" target of the same cluster.
"""

import numpy as np
import pytest

from rdma_device._cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(plugin_built, log_dir):
    c = LocalCluster("grpc+rdma_device", {"ps": 1, "worker": 1}, env={"RDMA_DEVICE_STRICT": "1"},
                     log_dir=log_dir, name="session-target")
    yield c
    c.close()


def test_a_resolver_handed_target_runs_steps_over_the_transport(cluster):
    import rdma_device
    import tensorflow as tf

    rdma_device.load()  # the plugin: its session factory, in this (the client's) process

    tf.compat.v1.disable_eager_execution()
    c = cluster
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(c.spec), task_type="worker", task_id=0, rpc_layer="grpc+rdma_device")
    target = resolver.master("worker", 0)
    assert target.startswith("grpc+rdma_device://"), target

    g = tf.Graph()
    with g.as_default():
        with tf.device(c.device("ps", 0)):
            w = tf.Variable(tf.random.stateless_uniform([64 * 1024], seed=[3, 4]), name="w")
        with tf.device(c.device("worker", 0)):
            y = tf.reduce_sum(w.value() * 2.0)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(c.target(), graph=g) as s:
        s.run(init)
        want = s.run(y)
    c.reset_stats()
    with tf.compat.v1.Session(target, graph=g) as s:
        got = [s.run(y) for _ in range(5)]
    assert all(np.float32(v).tobytes() == np.float32(want).tobytes() for v in got), (got, want)
    n = c.stats()["/job:worker/task:0"]["counters"]
    assert n["tensors_received"] >= 5 and n["fallback_tensors"] == 0, n


def test_an_unknown_scheme_still_fails_with_tensorflows_error():
    import rdma_device
    import tensorflow as tf

    rdma_device.load()

    tf.compat.v1.disable_eager_execution()
    with pytest.raises(tf.errors.NotFoundError):
        tf.compat.v1.Session("grpc+nothing://localhost:1")


def test_a_job_named_localhost_moves_its_tensors_over_the_transport(plugin_built, log_dir):
    """A cluster whose job is named "localhost" (the name
    ``create_local_server`` gives its job; TensorFlow also calls an eager
    context's own devices that): its other tasks are peers like any other,
    not this task under another name."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    with LocalCluster("grpc+rdma_device", {"localhost": 2}, env={"RDMA_DEVICE_STRICT": "1"}, log_dir=log_dir,
                      name="job-localhost") as c:
        g = tf.Graph()
        with g.as_default():
            with tf.device(c.device("localhost", 1)):
                w = tf.Variable(tf.random.stateless_uniform([64 * 1024], seed=[5, 6]), name="w")
            with tf.device(c.device("localhost", 0)):
                y = tf.reduce_sum(w.value())
            init = tf.compat.v1.global_variables_initializer()
        with tf.compat.v1.Session(c.target("localhost", 0), graph=g) as s:
            s.run(init)
            want = s.run(y)
            c.reset_stats()
            for _ in range(5):
                assert s.run(y) == want
        n = c.stats()["/job:localhost/task:0"]["counters"]
        assert n["tensors_received"] >= 5 and n["fallback_tensors"] == 0, n
