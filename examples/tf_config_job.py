"""One task of a job started from TF_CONFIG with rpc_layer "grpc+rdma_device".

Every process of the job runs this script with its own TF_CONFIG (what
Slurm, Kubernetes or run_local.sh set):

    TF_CONFIG='{"cluster": {"worker": ["h1:2222", "h2:2222"]},
                "task": {"type": "worker", "index": 0},
                "rpc_layer": "grpc+rdma_device"}' python tf_config_job.py mwms

mwms: MultiWorkerMirroredStrategy, every task a worker; a few steps of a
small model whose gradients are all-reduced (ring) over the transport.
pss:  ParameterServerStrategy: "ps" and "worker" tasks serve
(tf.distribute.Server with the protocol from TF_CONFIG) until killed, the
"chief" task runs a ClusterCoordinator that schedules training steps.

Each training task prints one line: RESULT {json} with the final loss and
what its transport carried (rdma_device.stats()).
"""

import json
import sys

import tensorflow as tf

import rdma_device

STEPS = 20


def resolver():
    r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if r.rpc_layer != rdma_device.PROTOCOL:
        raise SystemExit(f"TF_CONFIG's rpc_layer is {r.rpc_layer!r}, not {rdma_device.PROTOCOL!r}")
    return r


def report(loss):
    s = rdma_device.stats()
    c = s["counters"]
    print("RESULT " + json.dumps({"loss": float(loss), "peers": s["peers"],
                                  "tensors_received": c.get("tensors_received", 0),
                                  "collective_tensors": c.get("collective_tensors", 0),
                                  "fallback_tensors": c.get("fallback_tensors", 0)}), flush=True)


def mwms():
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver(),
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    with strategy.scope():
        w = tf.Variable(tf.zeros([256, 1]))
        opt = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step(seed):
        def replica():
            x = tf.random.stateless_normal([64, 256], seed=tf.stack([seed, 1]))
            y = tf.reduce_sum(x[:, :8], axis=1, keepdims=True)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
            opt.apply_gradients([(tape.gradient(loss, w), w)])
            return loss
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, strategy.run(replica), axis=None)

    loss = 0.0
    for i in range(STEPS):
        loss = step(tf.constant(i, tf.int32))
    report(loss)


def pss():
    r = resolver()
    if r.task_type in ("ps", "worker"):
        server = tf.distribute.Server(r.cluster_spec(), job_name=r.task_type, task_index=r.task_id,
                                      protocol=r.rpc_layer, start=True)
        print("SERVING", flush=True)
        server.join()
        return
    strategy = tf.distribute.experimental.ParameterServerStrategy(r)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        w = tf.Variable(tf.zeros([256, 1]))

    @tf.function
    def step(seed):
        x = tf.random.stateless_normal([64, 256], seed=tf.stack([seed, 1]))
        y = tf.reduce_sum(x[:, :8], axis=1, keepdims=True)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    results = [coordinator.schedule(step, args=(tf.constant(i, tf.int32),)) for i in range(STEPS)]
    coordinator.join()
    report(results[-1].fetch())


if __name__ == "__main__":
    rdma_device.load()  # in every process, before any server or strategy
    {"mwms": mwms, "pss": pss}[sys.argv[1]]()
