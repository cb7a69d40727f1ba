"""MultiWorkerMirroredStrategy workers (task_main role
"mwms_scenarios.<name>"). Every worker of a cluster runs the same scenario;
spec["cluster"]["worker"] lists them, spec["task"] is this one's index.
task_main has loaded the plugin (protocol "grpc+rdma_device") before the
scenario creates the strategy, whose server then uses it."""

import json
import sys
import time

import numpy as np

from rdma_device.bench.mwms import make_strategy, weights_digest
from scenarios import _stats


def _strategy(spec):
    return make_strategy(spec["cluster"]["worker"], spec["task"], spec["protocol"])


def _reset(spec):
    if spec["protocol"] != "grpc":
        import rdma_device

        rdma_device.reset_stats()


def keras_fit(spec, ready):
    """tf_keras `model.fit`; the dataset is sharded by element, so each
    worker trains on its own batches and the all-reduce decides the weights."""
    import tensorflow as tf
    import tf_keras as keras

    strategy = _strategy(spec)
    ready()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 32)).astype(np.float32)
    y = (x @ rng.standard_normal((32, 1)).astype(np.float32)).astype(np.float32)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32).with_options(options)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.layers.Dense(64, activation="relu", input_shape=(32,)),
            keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model_bytes = sum(w.size * 4 for w in model.get_weights())
    _reset(spec)
    history = model.fit(data, epochs=spec.get("epochs", 2), steps_per_epoch=spec.get("steps", 10),
                        verbose=0)
    return {"loss": [float(v) for v in history.history["loss"]],
            "weights": weights_digest(model.get_weights()), "model_bytes": int(model_bytes),
            "stats": _stats(spec)}


def _mlp(strategy, tf, width):
    rng = np.random.default_rng(0)
    with strategy.scope():
        w1 = tf.Variable(rng.standard_normal((width, width)).astype(np.float32) * 0.05)
        w2 = tf.Variable(rng.standard_normal((width, 1)).astype(np.float32) * 0.05)
    # Each worker its own batch: the all-reduced gradients differ from
    # any single worker's, so wrong or missing bytes change the weights.
    data = np.random.default_rng(10 + int(strategy.cluster_resolver.task_id))
    x = data.standard_normal((32, width)).astype(np.float32)
    y = data.standard_normal((32, 1)).astype(np.float32)

    @tf.function
    def step():
        def fn():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y) ** 2)
            grads = tape.gradient(loss, [w1, w2])
            grads = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.MEAN, grads)
            w1.assign_sub(0.05 * grads[0])
            w2.assign_sub(0.05 * grads[1])
            return loss
        return strategy.run(fn)

    return [w1, w2], step


def custom_loop(spec, ready):
    """A custom training loop: gradients all-reduced explicitly, `steps`
    steps; the counters are reset after the variables' initial broadcast,
    so they hold exactly the steps' all-reduces."""
    import tensorflow as tf

    strategy = _strategy(spec)
    ready()
    weights, step = _mlp(strategy, tf, spec.get("width", 128))
    _reset(spec)
    losses = [float(step()) for _ in range(2)]
    early = _stats(spec)
    losses += [float(step()) for _ in range(spec.get("steps", 20) - 2)]
    return {"loss": losses, "weights": weights_digest([w.numpy() for w in weights]),
            "grad_bytes": int(sum(int(np.prod(w.shape)) * 4 for w in weights)),
            "stats": _stats(spec), "stats_after_2_steps": early}


def until_killed(spec, ready):
    """Trains, printing STEP n, until a step fails (the test SIGKILLs a
    worker); reports the error and when it reached the user."""
    import tensorflow as tf

    strategy = _strategy(spec)
    ready()
    _, step = _mlp(strategy, tf, 64)
    n = 0
    try:
        while True:
            float(step())
            n += 1
            sys.stdout.write(f"STEP {json.dumps(n)}\n")
            sys.stdout.flush()
    except Exception as e:  # what the training loop sees
        return {"steps": n, "type": type(e).__name__, "at": time.time(), "message": str(e)[-1500:]}


def _allreduce_fn(strategy, tf, n):
    """A fresh tf.function: one all-reduce (SUM) of n float32 per worker,
    each worker's values distinct, so the sum checks every byte."""
    task = int(strategy.cluster_resolver.task_id)
    values = np.arange(n, dtype=np.float32) * (task + 1) + task

    @tf.function
    def step():
        def fn():
            return tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, tf.constant(values))
        return strategy.run(fn)

    return lambda: step().numpy()


def reconnect(spec, ready):
    """Connect, all-reduce; the server definition changes (spec["mode"]):
    "twice": every worker creates its MWMS again with the cluster plus
    spec["extra"] (jobs); "one": worker 0 alone applies that changed cluster
    (as a dynamic cluster or a second connect does on one task) and every
    worker keeps its strategy. Then all-reduce again, for `reps` calls,
    Prints RECONNECT when the first all-reduce is done: the test's
    deadline runs from there."""
    import tensorflow as tf
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    n = spec.get("n", 4096)
    strategy = _strategy(spec)
    ready()
    before = _allreduce_fn(strategy, tf, n)()
    task = spec["task"]
    changed = dict(spec["cluster"], **spec["extra"])
    _reset(spec)
    sys.stdout.write("RECONNECT\n")
    sys.stdout.flush()
    t0 = time.monotonic()
    if spec["mode"] == "twice":
        strategy = make_strategy_for(changed, task, spec["protocol"])
    elif task == len(spec["cluster"]["worker"]) - 1:
        server_def = tensorflow_server_pb2.ServerDef(
            cluster=tf.train.ClusterSpec(changed).as_cluster_def(),
            default_session_config=context.context().config, job_name="worker",
            task_index=task, protocol=spec["protocol"])
        context.context().enable_collective_ops(server_def)
    after = []
    for _ in range(spec.get("reps", 3)):
        after.append(_allreduce_fn(strategy, tf, n)())
    return {"before": before.tobytes().hex(), "after": [a.tobytes().hex() for a in after],
            "seconds": time.monotonic() - t0, "stats": _stats(spec)}



def _before_regroup(spec, ready, tf, context, task, n):
    """What `regroup` and `new_leader` share: the coordination service off;
    the workers of spec["before"] (if any) all-reduce once in an MWMS and
    say RECONNECT (counters reset); then wait for "regroup". Returns that
    first result (None for a task that joins later)."""
    context.context().configure_coordination_service(service_type="")
    before = None
    if spec["before"] is not None:
        strategy = make_strategy_for({"worker": spec["before"]}, task, spec["protocol"])
        ready()
        before = _allreduce_fn(strategy, tf, n)()
        _reset(spec)
        sys.stdout.write("RECONNECT\n")
        sys.stdout.flush()
    else:
        ready()
    for line in sys.stdin:
        if "regroup" in line:
            break
    return before


def regroup(spec, ready):
    """The group changes under a kept server. spec["before"]: the workers
    of a first MWMS (None: this task joins later), spec["after"]: those of
    the MWMS every task creates on the "regroup" command (this task keeps
    its index). One all-reduce before (then RECONNECT; the counters are
    reset), `reps` after. The coordination service is off (its task list
    is fixed when it starts, stock TF alike: a task that joins later is
    refused by it)."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    n = spec.get("n", 4096)
    task = spec["task"]
    before = _before_regroup(spec, ready, tf, context, task, n)
    t0 = time.monotonic()
    strategy = make_strategy_for({"worker": spec["after"]}, task, spec["protocol"])
    after = [_allreduce_fn(strategy, tf, n)() for _ in range(spec.get("reps", 3))]
    return {"before": None if before is None else before.tobytes().hex(),
            "after": [a.tobytes().hex() for a in after],
            "seconds": time.monotonic() - t0, "stats": _stats(spec)}



def new_leader(spec, ready):
    """The group leader changes under a kept server. Workers of
    spec["before"] all-reduce once in an MWMS (leader: worker 0), then
    RECONNECT (the counters are reset). On "regroup" every task (a chief
    joins: spec["job"] "chief") enables collective ops for the cluster
    spec["after"], whose group leader is the chief, and runs `reps`
    all-reduces of a new group of all of them: the collective op MWMS runs
    (all_reduce_v2, ring). MWMS itself cannot be created again with
    another leader in a process (configure_collective_ops: "Collective ops
    are already configured", stock TF alike). The coordination service is
    off, as in `regroup`."""
    import tensorflow as tf
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context
    from tensorflow.python.ops import collective_ops

    n = spec.get("n", 4096)
    job, task, rank = spec["job"], spec["task"], spec["rank"]
    before = _before_regroup(spec, ready, tf, context, task, n)
    t0 = time.monotonic()
    config = context.context().config
    config.experimental.collective_group_leader = "/job:chief/replica:0/task:0"
    context.context().enable_collective_ops(tensorflow_server_pb2.ServerDef(
        cluster=tf.train.ClusterSpec(spec["after"]).as_cluster_def(),
        default_session_config=config, job_name=job, task_index=task,
        protocol=spec["protocol"]))
    size = sum(len(tasks) for tasks in spec["after"].values())
    values = np.arange(n, dtype=np.float32) * (rank + 1) + rank
    after = []
    with tf.device(f"/job:{job}/replica:0/task:{task}/device:CPU:0"):
        for i in range(spec.get("reps", 3)):
            after.append(collective_ops.all_reduce_v2(
                tf.constant(values), group_size=size, group_key=1000, instance_key=1000 + i,
                communication_hint="ring").numpy())
    return {"before": None if before is None else before.tobytes().hex(),
            "after": [a.tobytes().hex() for a in after],
            "seconds": time.monotonic() - t0, "stats": _stats(spec)}


def make_strategy_for(cluster, index, protocol):
    """An MWMS over `cluster` (jobs -> addresses, "worker" among them)."""
    import os

    import tensorflow as tf

    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": cluster, "task": {"type": "worker", "index": index}, "rpc_layer": protocol})
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=tf.distribute.cluster_resolver.TFConfigClusterResolver(),
        communication_options=options)


def abort_messages(spec, ready):
    """`calls` all-reduces (each a new instance: keys the executor
    remembers), then worker 0 aborts collectives (abort_collective_ops)
    while every worker runs one more all-reduce. Reports the abort control
    messages this task sent (trace spans "Abort"), how the last
    all-reduce failed, and how long after its start."""
    import rdma_device
    import tensorflow as tf
    from tensorflow.python.eager import context

    strategy = _strategy(spec)
    ready()
    calls = [_allreduce_fn(strategy, tf, 1024) for _ in range(spec.get("calls", 20))]
    for fn in calls:
        fn()
    last = _allreduce_fn(strategy, tf, 1024)
    rdma_device.trace_take()  # drop what was recorded so far
    rdma_device.trace_enable(True)
    t0 = time.monotonic()
    if spec["task"] == 0:
        time.sleep(1.0)  # the others are inside `last` by now
        context.context().abort_collective_ops(14, "aborted by the test")  # UNAVAILABLE
    try:
        last()
        error = None
    except Exception as e:  # what the training loop sees
        error = type(e).__name__
    took = time.monotonic() - t0
    time.sleep(1.0)  # messages the peers' aborts caused
    events = rdma_device.trace_take()
    aborts = sum(1 for e in events if e.get("ph") == "X" and e.get("name") == "Abort")
    return {"aborts_sent": aborts, "error": error, "seconds": took}


def nccl_abort(spec, ready):
    """One all-reduce in an MWMS (then REDUCED); on the "abort" command,
    this task aborts its collectives (abort_collective_ops, UNAVAILABLE,
    spec["message"]) and runs one more all-reduce, which must fail. Run
    under the fake NCCL communicator (fake_nccl/, LD_PRELOAD), whose log
    tells the test which communicator TF's abort reached."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    strategy = _strategy(spec)
    ready()
    n = spec.get("n", 256)
    first = _allreduce_fn(strategy, tf, n)()
    sys.stdout.write("REDUCED\n")
    sys.stdout.flush()
    for line in sys.stdin:  # the test waits for every task's REDUCED first
        if "abort" in line:
            break
    context.context().abort_collective_ops(14, spec["message"])  # UNAVAILABLE
    try:
        _allreduce_fn(strategy, tf, n)()
        after = None
    except Exception as e:  # what the training loop sees
        after = f"{type(e).__name__}: {e}"
    return {"sum": first.tobytes().hex(), "after_abort": after}
