"""MultiWorkerMirroredStrategy workers (task_main role
"mwms_scenarios.<name>"). Every worker of a cluster runs the same scenario;
spec["cluster"]["worker"] lists them, spec["task"] is this one's index.
task_main has loaded the plugin (protocol "grpc+rdma_device") before the
scenario creates the strategy, whose server then uses it."""

import json
import sys
import time

import numpy as np

from rdma_device._mwms import make_strategy, weights_digest
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
