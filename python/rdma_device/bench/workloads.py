"""The evaluation suite's workloads: small TF1 graphs of our own, sized for a
2-vCPU machine with ``quick``.

Every workload builds one training step for a cluster with one ``ps`` task
and ``n`` workers: variables on the PS; each worker computes gradients on
its own synthetic batch; gradients are averaged on the PS and applied
there (in-graph synchronous SGD). Tensors cross tasks every step: variable
reads ps→worker, gradients worker→ps (IndexedSlices for embedding
lookups), and for the pipeline activations worker→worker. The suite's
floor (``floor``) is this same step with every tensor kept on the task
that produced it.

Inputs are generated on the workers (seeded ``tf.random``), so no feed
travels from the client. Graph construction runs on the client thread.
"""

import collections

Workload = collections.namedtuple("Workload", "name title batch params loss min_workers")


def _dense(tf, x, w, b, act=True):
    y = tf.matmul(x, w) + b
    return tf.nn.relu(y) if act else y


def _var(tf, name, shape, scale=0.05, seed=0):
    return tf.compat.v1.get_variable(
        name, initializer=tf.random.normal(shape, seed=seed + 1) * scale, use_resource=True)


# --- AlexNet-class CNN: two convolutions, large fully connected layers -------

def _alexnet_params(tf, q):
    fc = 1024 if q else 2048
    return {"c1": _var(tf, "c1", [5, 5, 3, 32], seed=1), "c2": _var(tf, "c2", [5, 5, 32, 64], seed=2),
            "f1": _var(tf, "f1", [8 * 8 * 64, fc], 0.01, 3), "b1": _var(tf, "b1", [fc], 0.0, 4),
            "f2": _var(tf, "f2", [fc, fc], 0.02, 5), "b2": _var(tf, "b2", [fc], 0.0, 6),
            "f3": _var(tf, "f3", [fc, 10], 0.05, 7)}


def _alexnet_loss(tf, p, batch, seed):
    x = tf.random.uniform([batch, 32, 32, 3], seed=seed)
    y = tf.random.uniform([batch], maxval=10, dtype=tf.int32, seed=seed + 1)
    h = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(x, p["c1"], 1, "SAME")), 2, 2, "SAME")
    h = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(h, p["c2"], 1, "SAME")), 2, 2, "SAME")
    h = tf.reshape(h, [batch, 8 * 8 * 64])
    h = _dense(tf, _dense(tf, h, p["f1"], p["b1"]), p["f2"], p["b2"])
    logits = tf.matmul(h, p["f3"])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


# --- ResNet-class CNN: residual blocks of 3x3 convolutions -------------------

def _resnet_params(tf, q):
    ch = 32 if q else 64
    ps = {"stem": _var(tf, "stem", [3, 3, 3, ch], seed=10), "fc": _var(tf, "fc", [ch, 10], seed=11)}
    for i in range(3 if q else 6):
        ps[f"r{i}a"] = _var(tf, f"r{i}a", [3, 3, ch, ch], 0.03, 20 + i)
        ps[f"r{i}b"] = _var(tf, f"r{i}b", [3, 3, ch, ch], 0.03, 40 + i)
    return ps


def _resnet_loss(tf, p, batch, seed):
    x = tf.random.uniform([batch, 32, 32, 3], seed=seed)
    y = tf.random.uniform([batch], maxval=10, dtype=tf.int32, seed=seed + 1)
    h = tf.nn.relu(tf.nn.conv2d(x, p["stem"], 1, "SAME"))
    i = 0
    while f"r{i}a" in p:
        r = tf.nn.relu(tf.nn.conv2d(h, p[f"r{i}a"], 1, "SAME"))
        h = tf.nn.relu(h + tf.nn.conv2d(r, p[f"r{i}b"], 1, "SAME"))
        if i == 0:
            h = tf.nn.avg_pool2d(h, 2, 2, "SAME")
        i += 1
    logits = tf.matmul(tf.reduce_mean(h, axis=[1, 2]), p["fc"])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


# --- LSTM language model (statically unrolled) -------------------------------

_VOCAB = 4000


def _lstm_params(tf, q):
    e, h = (128, 256) if q else (256, 512)
    return {"emb": _var(tf, "emb", [_VOCAB, e], seed=50), "w": _var(tf, "w", [e + h, 4 * h], 0.03, 51),
            "b": _var(tf, "b", [4 * h], 0.0, 52), "out": _var(tf, "out", [h, _VOCAB], 0.03, 53)}


def _lstm_loss(tf, p, batch, seed, steps=12):
    ids = tf.random.uniform([batch, steps + 1], maxval=_VOCAB, dtype=tf.int32, seed=seed)
    x = tf.nn.embedding_lookup(p["emb"], ids[:, :-1])
    hdim = p["out"].shape[0]
    h = c = tf.zeros([batch, hdim])
    outs = []
    for t in range(steps):
        z = tf.matmul(tf.concat([x[:, t], h], 1), p["w"]) + p["b"]
        i, f, g, o = tf.split(z, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.sigmoid(o) * tf.tanh(c)
        outs.append(h)
    logits = tf.matmul(tf.concat(outs, 0), p["out"])
    labels = tf.reshape(tf.transpose(ids[:, 1:]), [-1])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


# --- Transformer encoder (BERT-like, masked-token loss) -----------------------

def _bert_params(tf, q):
    d, layers = (128, 2) if q else (256, 4)
    ps = {"emb": _var(tf, "emb", [_VOCAB, d], seed=60), "pos": _var(tf, "pos", [64, d], 0.02, 61)}
    for i in range(layers):
        for n, shape in (("qkv", [d, 3 * d]), ("o", [d, d]), ("f1", [d, 4 * d]), ("f2", [4 * d, d])):
            ps[f"l{i}{n}"] = _var(tf, f"l{i}{n}", shape, 0.03, 70 + 4 * i + len(n))
    return ps


def _norm(tf, x):
    m, v = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - m) * tf.math.rsqrt(v + 1e-6)


def _bert_loss(tf, p, batch, seed, seq=32, heads=4):
    ids = tf.random.uniform([batch, seq], maxval=_VOCAB, dtype=tf.int32, seed=seed)
    d = p["emb"].shape[1]
    x = tf.nn.embedding_lookup(p["emb"], ids) + p["pos"][:seq]
    i = 0
    while f"l{i}qkv" in p:
        qkv = tf.reshape(tf.matmul(tf.reshape(x, [-1, d]), p[f"l{i}qkv"]), [batch, seq, 3, heads, d // heads])
        q, k, v = (tf.transpose(qkv[:, :, j], [0, 2, 1, 3]) for j in range(3))
        att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / float((d // heads) ** 0.5))
        a = tf.reshape(tf.transpose(tf.matmul(att, v), [0, 2, 1, 3]), [-1, d])
        x = _norm(tf, x + tf.reshape(tf.matmul(a, p[f"l{i}o"]), [batch, seq, d]))
        f = tf.matmul(tf.nn.gelu(tf.matmul(tf.reshape(x, [-1, d]), p[f"l{i}f1"])), p[f"l{i}f2"])
        x = _norm(tf, x + tf.reshape(f, [batch, seq, d]))
        i += 1
    logits = tf.matmul(tf.reshape(x, [-1, d]), p["emb"], transpose_b=True)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.reshape(ids, [-1]), logits=logits))


# --- Wide & deep: sparse embedding lookups, IndexedSlices gradients ----------

def _wd_params(tf, q):
    rows = 50_000 if q else 500_000
    ps = {"wide": _var(tf, "wide", [rows, 1], 0.01, 80), "w1": _var(tf, "w1", [4 * 32, 256], 0.05, 81),
          "w2": _var(tf, "w2", [256, 1], 0.05, 82)}
    for f in range(4):
        ps[f"e{f}"] = _var(tf, f"e{f}", [rows, 32], 0.05, 90 + f)
    return ps


def _wd_loss(tf, p, batch, seed):
    rows = p["wide"].shape[0]
    ids = tf.random.uniform([batch, 4], maxval=rows, dtype=tf.int32, seed=seed)
    cross = tf.random.uniform([batch, 8], maxval=rows, dtype=tf.int32, seed=seed + 1)
    wide = tf.reduce_sum(tf.nn.embedding_lookup(p["wide"], cross), axis=[1, 2])
    deep = tf.concat([tf.nn.embedding_lookup(p[f"e{f}"], ids[:, f]) for f in range(4)], 1)
    deep = tf.matmul(tf.nn.relu(tf.matmul(deep, p["w1"])), p["w2"])[:, 0]
    y = tf.cast(tf.random.uniform([batch], maxval=2, dtype=tf.int32, seed=seed + 2), tf.float32)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=wide + deep))


WORKLOADS = {
    "alexnet": Workload("alexnet", "AlexNet-class CNN", 16, _alexnet_params, _alexnet_loss, 1),
    "resnet": Workload("resnet", "ResNet-class CNN", 8, _resnet_params, _resnet_loss, 1),
    "lstm": Workload("lstm", "LSTM language model", 16, _lstm_params, _lstm_loss, 1),
    "transformer": Workload("transformer", "Transformer encoder", 8, _bert_params, _bert_loss, 1),
    "wide_deep": Workload("wide_deep", "wide & deep (sparse)", 256, _wd_params, _wd_loss, 1),
    "pipeline": Workload("pipeline", "model-parallel pipeline", 64, None, None, 2),
}


def _average(tf, grads):
    """Mean of the towers' gradients (dense or IndexedSlices)."""
    if isinstance(grads[0], tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([g.values for g in grads], 0) / len(grads),
                                tf.concat([g.indices for g in grads], 0), grads[0].dense_shape)
    return tf.add_n(grads) / len(grads)


def _data_parallel(tf, wl, cluster, n, quick):
    opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)
    ps = cluster.device("ps", 0)
    with tf.device(ps), tf.compat.v1.variable_scope("model"):
        shared = wl.params(tf, quick)
    names = sorted(shared)
    losses, tower_grads = [], []
    for i in range(n):
        with tf.device(cluster.device("worker", i)):
            loss = wl.loss(tf, shared, wl.batch, seed=100 + i)
            tower_grads.append(tf.gradients(loss, [shared[k] for k in names]))
        losses.append(loss)
    with tf.device(ps):
        avg = [_average(tf, [g[j] for g in tower_grads]) for j in range(len(names))]
        apply = opt.apply_gradients(list(zip(avg, [shared[k] for k in names])))
    return tf.group(apply), tf.add_n(losses) / n


def _pipeline(tf, cluster, n, quick, batch, micro=4):
    """n stages, stage s on worker s (its variables on the PS);
    micro-batches flow through the stages."""
    width, layers = (768, 2) if quick else (1536, 3)
    stage_dev = [cluster.device("worker", s) for s in range(n)]
    var_dev = cluster.device("ps", 0)
    params = []
    for s in range(n):
        with tf.device(var_dev), tf.compat.v1.variable_scope(f"stage{s}"):
            params.append([_var(tf, f"w{k}", [width, width], 0.03, 200 + 10 * s + k) for k in range(layers)])
    losses = []
    mb = batch // micro
    for m in range(micro):
        with tf.device(stage_dev[0]):
            h = tf.random.uniform([mb, width], seed=300 + m)
        for s in range(n):
            with tf.device(stage_dev[s]):
                for w in params[s]:
                    h = tf.nn.relu(tf.matmul(h, w))
        with tf.device(stage_dev[-1]):
            losses.append(tf.reduce_mean(tf.square(h - 0.5)))
    flat = [w for ws in params for w in ws]
    with tf.device(stage_dev[-1]):
        loss = tf.add_n(losses) / micro
    grads = tf.compat.v1.gradients(loss, flat, colocate_gradients_with_ops=True)
    opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)
    applies = []
    for s in range(n):
        k = len(params[s])
        pairs = list(zip(grads[s * k:(s + 1) * k], params[s]))
        with tf.device(var_dev):
            applies.append(opt.apply_gradients(pairs))
    return tf.group(*applies), loss


def build(tf, name, cluster, n, quick):
    """A fresh graph with one training step of workload ``name`` on ``n``
    workers. Returns (graph, init_op, train_op, loss)."""
    wl = WORKLOADS[name]
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(1)
        if name == "pipeline":
            op, loss = _pipeline(tf, cluster, n, quick, wl.batch)
        else:
            op, loss = _data_parallel(tf, wl, cluster, n, quick)
        init = tf.compat.v1.global_variables_initializer()
    return g, init, op, loss


def samples_per_step(name, n):
    wl = WORKLOADS[name]
    return wl.batch if name == "pipeline" else wl.batch * n
