import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# The in-tree package when its libraries were built in place (cmake
# --install ... --prefix python/rdma_device/lib), else the installed one.
if os.path.exists(os.path.join(REPO, "python", "rdma_device", "lib", "librdma_device_tf.so")):
    sys.path.insert(0, os.path.join(REPO, "python"))
import rdma_device  # noqa: E402

# Every task process the tests start (LocalCluster, harness.Task, the
# bench CLI) imports this same package, not whichever one the venv holds.
_pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(rdma_device.__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_pkg_parent] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _pkg_parent])

sys.path.insert(0, HERE)
# cmake/ for tf_fingerprint.py, the ELF reader that CMakeLists.txt runs on
# TensorFlow's libraries: tests import it too.
sys.path.append(os.path.join(REPO, "cmake"))

import harness  # noqa: E402


def pytest_report_header(config):
    return f"rdma_device package: {os.path.dirname(rdma_device.__file__)}"


@pytest.fixture(scope="session")
def plugin_built():
    shim = os.path.join(rdma_device.lib_dir(), "librdma_device_tf.so")
    if not os.path.exists(shim):
        pytest.fail(f"{shim} missing: pip install ./python, or build in place (python/README.md)")
    return shim


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("task-logs"))


@pytest.fixture(scope="session")
def slow_resolver(tmp_path_factory):
    """libslow_resolver.so (slow_resolver/slow_resolver.c, which says
    more), for LD_PRELOAD: each lookup of a "*.slow.test" name takes
    SLOW_RESOLVER_MS, then answers 127.0.0.1."""
    return harness.build_preload(tmp_path_factory, "slow_resolver", "the slow resolver", ["-ldl"])


class ServerSet:
    """Long-lived worker + ps servers of one protocol; clients come and go."""

    def __init__(self, protocol, log_dir, env=None):
        self.protocol = protocol
        self.env = env
        self.log_dir = log_dir
        self.cluster = harness.make_cluster({"chief": 1, "worker": 1, "ps": 1})
        self.servers = harness.start_tasks(
            [dict(role="server", cluster=self.cluster, job=job, task=0, protocol=protocol)
             for job in ("worker", "ps")], log_dir, env)

    def run_client(self, role, timeout=120, **kw):
        client = harness.Task(dict(role=role, cluster=self.cluster, job="chief", task=0,
                                   protocol=self.protocol, **kw), self.log_dir, self.env)
        try:
            client.wait_ready()
            return client.result(timeout)
        finally:
            client.close()

    def close(self):
        for t in self.servers:
            t.close()


@pytest.fixture(scope="session")
def grpc_reference(log_dir):
    """reference(role, steps) -> that scenario's result under stock "grpc"
    (computed once per session on one long-lived gRPC cluster)."""
    servers = None
    cache = {}

    def reference(role, steps):
        nonlocal servers
        if (role, steps) not in cache:
            if servers is None:
                servers = ServerSet(harness.PROTOCOL_GRPC, log_dir)
            cache[(role, steps)] = servers.run_client(role, steps=steps)
        return cache[(role, steps)]

    yield reference
    if servers is not None:
        servers.close()
