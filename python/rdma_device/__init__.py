"""rdma_device: one-sided-write tensor transport for TensorFlow.

Use protocol ``"grpc+rdma_device"`` wherever TensorFlow takes a server
protocol, after calling :func:`load` in *every* process that creates a
server (workers, PS, chief, eager client)::

    import rdma_device
    rdma_device.load()
    server = tf.distribute.Server(cluster, job_name="worker", task_index=0,
                                  protocol="grpc+rdma_device")

:func:`create_local_server` is ``tf.distribute.Server.create_local_server``
with this protocol; :func:`use_with_dtensor` makes DTensor's multi-client
set-up use it. :func:`stats` and :func:`config` report what the
transport did and which settings are in effect (``RDMA_DEVICE_*``
environment variables);
:func:`trace_enable` and :func:`trace_take` record where each transfer's
time goes (``python -m rdma_device.bench trace`` writes a Chrome trace).
"""

from rdma_device._loader import (PROTOCOL, config, lib_dir, load, reset_stats, stats, trace_enable,
                                 trace_take)
from rdma_device._local import create_local_server, use_with_dtensor

__all__ = ["PROTOCOL", "config", "create_local_server", "lib_dir", "load", "reset_stats", "stats",
           "trace_enable", "trace_take", "use_with_dtensor"]
