"""The suite's floor: a workload's cross-task training step with every
tensor kept on the task that produced it.

Owns the rewrite from the ``"ps"`` graph of ``workloads.build`` to its
floor graph; it must not change what any task computes. The rewrite keeps
every op of the step, on the device the placer gave it in the cross-task
graph, with the same inputs, except that an input produced on another task
is read from a copy on the consuming task: a variable there holding the
value that tensor had in one step of the cross-task graph (one copy per
tensor and consuming task, as there is one receive). Control edges between
tasks are dropped. The step is then one target per task (every op of the
step on that task), so no tensor, not even an empty control message,
crosses tasks; ``build_floor`` checks that on the partition graphs and refuses a
floor that still sends.

So the floor computes the same ops as the measured modes: the workers'
forward and backward passes on their own batches, the ps's averaging of
the workers' gradients and its update of the shared variables, the
pipeline's stages each on its own worker. What differs: the values a task
would have received are those of one earlier step, not the current one
(same shapes, dtypes and, for embedding rows, the same indices' layout),
and nothing orders a task's step after another's.

Runs on the client thread, once per workload before the timed blocks.
"""

import collections

Floor = collections.namedtuple("Floor", "session targets copies copied_bytes")

# Data types a copy cannot stand in for: a handle to state on the other
# task is not a value.
_HANDLES = ("resource", "variant")


def _task(device):
    return device.split("/device:")[0]


def _placement(tf, session, op):
    """{node name: assigned device} of the nodes one step of ``op`` runs,
    from the partition graphs of a session with every graph rewrite off
    (so the nodes keep their names)."""
    meta = tf.compat.v1.RunMetadata()
    session.run(op, options=tf.compat.v1.RunOptions(output_partition_graphs=True), run_metadata=meta)
    return {n.name: n.device for pg in meta.partition_graphs for n in pg.node
            if n.op not in ("_Send", "_Recv", "_HostSend", "_HostRecv")}


def _own_state(tf):
    """A session whose variables are its own: the tasks drop them when it
    closes (each floor holds a copy of every tensor that crosses tasks, and
    the next workload's copies have the same names)."""
    cfg = tf.compat.v1.ConfigProto()
    cfg.isolate_session_state = True
    return cfg


def _plain_config(tf):
    cfg = _own_state(tf)
    opts = cfg.graph_options.optimizer_options
    opts.opt_level = tf.compat.v1.OptimizerOptions.L0
    opts.do_common_subexpression_elimination = False
    opts.do_constant_folding = False
    opts.do_function_inlining = False
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    return cfg


def cross_task_sends(tf, session, targets):
    """The _Send nodes of one step of ``targets`` whose receiver is another
    task (the client's own fetches not counted): their input names."""
    meta = tf.compat.v1.RunMetadata()
    session.run(targets, options=tf.compat.v1.RunOptions(output_partition_graphs=True), run_metadata=meta)
    out = []
    for pg in meta.partition_graphs:
        for n in pg.node:
            if n.op in ("_Send", "_HostSend") and not n.attr["client_terminated"].b \
                    and _task(n.attr["send_device"].s.decode()) != _task(n.attr["recv_device"].s.decode()):
                out.append(n.input[0])
    return out


def build_floor(tf, graph, init, op, cluster):
    """The floor of the cross-task step ``op`` of ``graph`` (built by
    ``workloads.build`` with ``init`` its initializer), on ``cluster``: a
    ``Floor`` whose session has run the initializers and whose ``targets``
    are one step. ``copies`` counts the tensors a task now reads from its
    own copy, ``copied_bytes`` their bytes."""
    # 1. Where each node of the step runs, and the values that cross tasks.
    with tf.compat.v1.Session(cluster.target(), graph=graph, config=_plain_config(tf)) as s:
        s.run(init)
        placed = _placement(tf, s, op)
        step_ops = [o for o in graph.get_operations() if o.name in placed]
        cross = {}  # (tensor name, consuming task) -> (tensor, consumer device)
        for o in step_ops:
            for t in o.inputs:
                if t.op.name not in placed:
                    raise RuntimeError(f"floor: {o.name} reads {t.name}, which the step does not run")
                here = placed[o.name]
                if _task(placed[t.op.name]) == _task(here):
                    continue
                if t.dtype.name in _HANDLES:
                    raise RuntimeError(f"floor: {o.name} on {here} uses {t.name}, a {t.dtype.name} "
                                       f"of {placed[t.op.name]}: no copy can stand in for it")
                cross.setdefault((t.name, _task(here)), (t, here))
        names = sorted({t.name for t, _ in cross.values()})
        values = dict(zip(names, s.run(names))) if names else {}
        # A tensor read only on other tasks would be dead in the floor,
        # and the graph optimizer would then prune the work that makes
        # it: it goes to a sink on its own task instead.
        local_use = {t.name for o in step_ops for t in o.inputs if _task(placed[t.op.name]) == _task(placed[o.name])}
        sinks = sorted(n for n in names if n not in local_use)

    # 2. The floor graph: the same nodes, each pinned to its device, a
    # cross-task input replaced by the consuming task's copy.
    gd = graph.as_graph_def()
    keep = {n.name: n for n in gd.node}
    inputs_of = collections.defaultdict(dict)  # task -> {tensor name: its copy's input_map key}
    for k, ((name, task), (t, dev)) in enumerate(sorted(cross.items(), key=lambda kv: kv[0])):
        key = f"floor_copy_in_{k}"
        ph = gd.node.add(name=key, op="Placeholder")
        ph.attr["dtype"].type = t.dtype.as_datatype_enum
        inputs_of[task][name] = key + ":0"
    for n in gd.node:
        if n.name not in placed:
            continue
        n.device = placed[n.name]
        task = _task(n.device)
        new = []
        for i in n.input:
            if i.startswith("^"):
                src = i[1:]
                if src in placed and _task(placed[src]) != task:
                    continue  # a control edge to another task: dropped
                new.append(i)
            else:
                new.append(inputs_of[task].get(i if ":" in i else i + ":0", i))
        del n.input[:]
        n.input.extend(new)

    g = tf.Graph()
    with g.as_default():
        input_map, assigns = {}, []
        for k, ((name, task), (t, dev)) in enumerate(sorted(cross.items(), key=lambda kv: kv[0])):
            value = values[name]
            with tf.device(dev), tf.compat.v1.name_scope(f"floor_copy/{k}"):
                feed = tf.compat.v1.placeholder(t.dtype, value.shape, name="value")
                var = tf.compat.v1.Variable(feed, trainable=False, use_resource=True, name="var",
                                            collections=[])
                input_map[f"floor_copy_in_{k}:0"] = var.read_value()
            assigns.append((var.initializer, feed, value))
        tf.graph_util.import_graph_def(gd, input_map=input_map, name="")
        by_task = collections.defaultdict(list)
        for name, dev in placed.items():
            if name in keep:
                by_task[_task(dev)].append(g.get_operation_by_name(name))
        for k, name in enumerate(sinks):
            t = g.get_tensor_by_name(name)
            dev = placed[t.op.name]
            with tf.device(dev), tf.compat.v1.name_scope(f"floor_sink/{k}"):
                # Assigning a tensor nothing else holds adopts its buffer:
                # no copy.
                h = tf.raw_ops.VarHandleOp(dtype=t.dtype, shape=tf.TensorShape(None), shared_name=f"floor_sink_{k}")
                by_task[_task(dev)].append(tf.raw_ops.AssignVariableOp(resource=h, value=t))
        targets = []
        for task, ops in sorted(by_task.items()):
            with tf.device(task):
                targets.append(tf.group(*ops, name="floor_step_" + "_".join(
                    task.replace(":", "").strip("/").split("/"))))
    sess = tf.compat.v1.Session(cluster.target(), graph=g, config=_own_state(tf))
    try:
        sess.run(g.get_operation_by_name(init.name))
        _assign_in_batches(sess, assigns)
        sends = cross_task_sends(tf, sess, targets)
        if sends:
            raise RuntimeError(f"floor: {len(sends)} tensor(s) still cross tasks, e.g. {sends[:3]}")
    except BaseException:
        sess.close()
        raise
    return Floor(sess, targets, len(cross), int(sum(values[t.name].nbytes for t, _ in cross.values())))


def _assign_in_batches(sess, assigns, batch_bytes=64 << 20):
    """Set the copies, at most ``batch_bytes`` of values per call."""
    ops, feeds, size = [], {}, 0
    for init, feed, value in assigns:
        ops.append(init)
        feeds[feed] = value
        size += value.nbytes
        if size >= batch_bytes:
            sess.run(ops, feed_dict=feeds)
            ops, feeds, size = [], {}, 0
    if ops:
        sess.run(ops, feed_dict=feeds)
