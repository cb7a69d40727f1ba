"""Client scenarios whose RunGraph replies are large (task_main role
"reply_scenarios.<name>")."""

import hashlib

import numpy as np

from scenarios import CHIEF, WORKER, _start_chief_server, _stats


def pattern(n):
    """n float32 values, deterministic, every byte pattern distinct enough
    that a shifted or truncated copy hashes differently."""
    return (np.arange(n, dtype=np.uint32) * 2654435761 % 1000003).astype(np.float32)


def big_partition_graph(spec, ready):
    """A constant of spec["bytes"] bytes lives on the worker; each step
    asks for the partition graphs (RunOptions.output_partition_graphs), so
    the worker's RunGraph reply carries its partition's GraphDef, constant
    and all, to the master. Two steps: the link must stay up for the
    second. A first step without the option brings the link up, so that
    both large replies travel over the protocol under test. Returns, per
    step, the fetched value and a digest of the constant's bytes as the
    reply brought them back."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    server = _start_chief_server(spec, tf)
    ready()
    values = pattern(spec["bytes"] // 4)
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(CHIEF):
            scale = tf.compat.v1.placeholder(tf.float32, [], name="scale")
        with tf.device(WORKER):
            # Multiplied by a fed scalar so that no constant folding can
            # take the constant out of the worker's partition.
            big = tf.constant(values, name="big")
            total = tf.reduce_sum(big * scale)
    del values
    steps = []
    opts = tf.compat.v1.RunOptions(output_partition_graphs=True)
    with tf.compat.v1.Session(server.target, graph=graph) as sess:
        sess.run(total, {scale: 0.0})
        for s in range(2):
            md = tf.compat.v1.RunMetadata()
            out = sess.run(total, {scale: float(s + 1)}, options=opts, run_metadata=md)
            consts = []
            for g in md.partition_graphs:
                for node in g.node:
                    if node.op == "Const" and node.name.endswith("big"):
                        t = node.attr["value"].tensor
                        # The consumer touches every byte it received.
                        consts.append([node.device, len(t.tensor_content),
                                       hashlib.sha256(t.tensor_content).hexdigest()])
            steps.append({"value": float(out), "partitions": len(md.partition_graphs),
                          "reply_bytes": md.ByteSize(), "consts": consts})
            del md
    return {"steps": steps, "stats": _stats(spec)}
