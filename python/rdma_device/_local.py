"""``create_local_server``: TensorFlow's one-task local server, over this
transport's protocol."""

from rdma_device._loader import PROTOCOL, load


def create_local_server(config=None, start=True):
    """Like ``tf.distribute.Server.create_local_server`` (which always uses
    protocol "grpc"), with protocol "grpc+rdma_device".

    The cluster is TensorFlow's: one task of a job named "localhost" at
    "localhost:0", so the OS picks a free port (race-free) and
    ``server.target`` names the port that was bound. Loads the plugin into
    this process first (:func:`load`). ``config`` (a ``ConfigProto``) and
    ``start`` are passed to ``tf.distribute.Server``.

    A one-task job has no peer: its sessions' tensors never leave the task,
    so the transport moves nothing for it. To move tensors between tasks,
    give every task a cluster spec naming all of them
    (``tf.distribute.Server(cluster, job_name=..., task_index=...,
    protocol=rdma_device.PROTOCOL)``).
    """
    import tensorflow as tf

    load()
    return tf.distribute.Server({"localhost": ["localhost:0"]}, protocol=PROTOCOL, config=config,
                                start=start)


def use_with_dtensor():
    """Make DTensor's multi-client set-up use protocol "grpc+rdma_device".

    ``tf.experimental.dtensor.initialize_accelerator_system`` builds its
    ServerDef with the protocol TensorFlow's platform hook names
    (``tensorflow.python.platform.remote_utils.
    get_default_communication_protocol``), which is "grpc" in the PyPI
    build, and takes no argument for it. This loads the plugin (:func:`load`)
    and points that hook at this transport's protocol, for this process;
    call it in every client before ``initialize_accelerator_system``. The
    collectives DTensor runs across clients then move their chunks over the
    transport (counted in ``collective_tensors``).
    """
    from tensorflow.python.platform import remote_utils

    load()
    remote_utils.get_default_communication_protocol = lambda: PROTOCOL
