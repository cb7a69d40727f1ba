"""MultiWorkerMirroredStrategy clusters on one host, for benchmarks, the
evaluation suite and tests.

Each worker is a subprocess that sets ``TF_CONFIG`` (with ``rpc_layer`` =
the protocol), loads the plugin when the protocol needs it, creates a
``MultiWorkerMirroredStrategy`` with ring all-reduce (the CPU collective
implementation) and then answers JSON commands on stdin, one JSON reply
line each. MWMS is SPMD: every worker of a cluster must run the same
command at the same time, so :class:`MwmsCluster` writes a command to all
workers before reading any reply.

Commands: ``allreduce`` (``size`` bytes of float32, ``reps`` timed
all-reduces; replies with per-call milliseconds), ``train`` (a small
data-parallel MLP, ``steps`` steps in a ``tf.function``; replies with step
milliseconds and a digest of the final weights), ``stats``, ``reset``.
"""

import hashlib
import json
import os
import subprocess
import sys
import time

from rdma_device import _quiet
from rdma_device._cluster import free_ports, stop_tasks


def make_strategy(workers, index, protocol):
    """The MWMS of worker ``index`` of ``workers`` (a list of host:port),
    ring all-reduce, over ``protocol``. Load the plugin first."""
    import tensorflow as tf

    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": list(workers)},
        "task": {"type": "worker", "index": index},
        "rpc_layer": protocol})
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert resolver.rpc_layer == protocol, resolver.rpc_layer
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver, communication_options=options)


def weights_digest(arrays):
    """sha256 over the bytes (and dtypes, shapes) of a list of arrays."""
    import numpy as np

    h = hashlib.sha256()
    for a in arrays:
        a = np.asarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


class _Worker:
    def __init__(self, workers, index, protocol):
        import tensorflow as tf

        self.tf = tf
        self.protocol = protocol
        if protocol != "grpc":
            import rdma_device

            rdma_device.load()
        self.strategy = make_strategy(workers, index, protocol)
        self._allreduce = {}
        self._train = {}

    def allreduce(self, size, reps):
        tf, strategy = self.tf, self.strategy
        if size not in self._allreduce:
            with strategy.scope():
                x = tf.Variable(tf.random.stateless_uniform([size // 4], seed=[size, 1]),
                                synchronization=tf.VariableSynchronization.ON_WRITE)

            @tf.function
            def step():
                def fn():
                    y = tf.distribute.get_replica_context().all_reduce(
                        tf.distribute.ReduceOp.SUM, x.read_value())
                    return y[-1]  # a scalar that depends on the whole result
                return strategy.run(fn)

            step()  # trace, instantiate, place the chunks' edges
            self._allreduce[size] = step
        step = self._allreduce[size]
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            float(step())
            times.append((time.perf_counter() - t) * 1e3)
        return {"ms": times}

    def train(self, steps, width=256, batch=64):
        """``steps`` more steps of the model of this width (created, traced
        and its initial values broadcast on first use); the weights' digest
        after them."""
        if width not in self._train:
            self._train[width] = self._make_model(width, batch)
        weights, step = self._train[width]
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            float(step())
            times.append((time.perf_counter() - t) * 1e3)
        return {"ms": times, "weights": weights_digest([w.numpy() for w in weights])}

    def _make_model(self, width, batch):
        tf, strategy = self.tf, self.strategy
        import numpy as np

        rng = np.random.default_rng(0)
        with strategy.scope():
            w1 = tf.Variable(rng.standard_normal((width, width)).astype(np.float32) * 0.05)
            w2 = tf.Variable(rng.standard_normal((width, 1)).astype(np.float32) * 0.05)
        # Each worker its own batch (data parallelism).
        data = np.random.default_rng(10 + int(strategy.cluster_resolver.task_id))
        x = data.standard_normal((batch, width)).astype(np.float32)
        y = data.standard_normal((batch, 1)).astype(np.float32)

        @tf.function
        def step():
            def fn():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y) ** 2)
                g1, g2 = tape.gradient(loss, [w1, w2])
                ctx = tf.distribute.get_replica_context()
                g1, g2 = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, [g1, g2])
                w1.assign_sub(0.01 * g1)
                w2.assign_sub(0.01 * g2)
                return loss
            return strategy.run(fn)

        return [w1, w2], step

    def stats(self):
        if self.protocol == "grpc":
            return {}
        import rdma_device

        return rdma_device.stats()

    def reset(self):
        if self.protocol != "grpc":
            import rdma_device

            rdma_device.reset_stats()
        return {}


def worker_main(argv):
    workers, index, protocol = json.loads(argv[1])
    w = _Worker(workers, index, protocol)
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        try:
            out = getattr(w, name)(**cmd)
        except Exception as e:  # noqa: BLE001 - the controller reports it
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # TF servers cannot be shut down cleanly


class MwmsCluster:
    """``n`` MWMS workers under ``protocol``, as processes on loopback."""

    def __init__(self, protocol, n, env=None, timeout=180, log_dir=None, name=None):
        self.protocol = protocol
        self.workers = [f"localhost:{p}" for p in free_ports(n)]
        e = dict(os.environ)
        if not _quiet.verbose():
            e.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        e["CUDA_VISIBLE_DEVICES"] = "-1"
        e.update(env or {})
        self._logs = []
        self.procs = {}
        for i in range(n):
            err = None
            if log_dir:
                err = open(os.path.join(log_dir, f"{name or protocol}-mwms{n}-{i}.log"), "a")
                self._logs.append(err)
            self.procs[("worker", i)] = subprocess.Popen(
                [sys.executable, "-m", "rdma_device.bench.mwms", json.dumps([self.workers, i, protocol])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=e)
        # MWMS blocks in its constructor until every worker is up: READY
        # comes from all of them at about the same time.
        deadline = time.time() + timeout
        for key, p in self.procs.items():
            line = p.stdout.readline()
            if line.strip() != "READY" or time.time() > deadline:
                self.close()
                raise RuntimeError(f"MWMS worker {key} ({protocol}) did not start (exit {p.poll()})")

    def command(self, cmd, **kw):
        """Runs ``cmd`` on every worker at once; their replies, by index."""
        line = json.dumps(dict(cmd=cmd, **kw)) + "\n"
        for p in self.procs.values():
            p.stdin.write(line)
            p.stdin.flush()
        out = []
        for key, p in self.procs.items():
            reply = p.stdout.readline()
            if not reply:
                raise RuntimeError(f"MWMS worker {key} ({self.protocol}) exited (rc {p.poll()})")
            r = json.loads(reply)
            if isinstance(r, dict) and "error" in r:
                raise RuntimeError(f"MWMS worker {key} ({self.protocol}): {r['error']}")
            out.append(r)
        return out

    def stats(self):
        return self.command("stats")

    def reset_stats(self):
        self.command("reset")

    def close(self):
        stop_tasks(self.procs.values(), self._logs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    worker_main(sys.argv)
