"""Readiness of an endpoint: a TCP listener on its own ``host:port``.

The transport treats a peer that does not listen at first contact as one
that does not run it, for good (in TensorFlow a task's listeners are up
before its gRPC server answers, so the gRPC port is the readiness signal).
An endpoint has no gRPC server: it listens on its address itself, once its
context (and so its transport listeners) exists, and ``wait_for`` probes a
peer's address until it answers before anything contacts the peer.

The listener accepts and closes at once; it carries no data. Its thread
(``rdma_device-ready``) waits in ``accept`` with a short timeout so that
``close`` ends it within that time.
"""

import socket
import threading
import time

_ACCEPT_POLL_S = 0.2  # how soon close() ends the accept thread
_PROBE_EVERY_S = 0.02  # how often wait_for retries a peer not up yet


def split(address):
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"rdma_device: address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def bind(address):
    """A socket bound to ``address`` (port 0: a free port), not listening
    yet; the address with the port it got."""
    host, port = split(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise OSError(e.errno, f"rdma_device: cannot bind the endpoint's address {address}: "
                               f"{e.strerror} (another process uses the port?)") from None
    port = s.getsockname()[1]
    return s, (f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}")


class Listener:
    """Serves readiness probes on a bound socket until ``close``."""

    def __init__(self, sock):
        self._sock = sock
        self._closed = threading.Event()
        sock.listen(64)
        sock.settimeout(_ACCEPT_POLL_S)
        self._thread = threading.Thread(target=self._serve, name="rdma_device-ready", daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, InterruptedError):
                continue
            except OSError:
                return  # closed
            conn.close()

    def close(self):
        self._closed.set()
        self._thread.join(2 * _ACCEPT_POLL_S + 1.0)
        self._sock.close()


def wait_for(address, timeout):
    """Waits until something accepts TCP connections at ``address``; False
    when ``timeout`` seconds passed first."""
    host, port = split(address)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((host, port), timeout=min(left, 1.0)):
                return True
        except OSError:
            time.sleep(min(_PROBE_EVERY_S, max(0.0, deadline - time.monotonic())))
