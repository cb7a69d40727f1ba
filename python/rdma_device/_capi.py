"""ctypes declarations of the C ABI (include/rdma_device.h) that the
endpoint API and the doctor's pair test use (their one home), and the
mapping of ``rdev_status`` to Python exceptions.

Only librdma_device.so is loaded here: nothing of TensorFlow. Every
function gets its ``argtypes``/``restype`` once, so a wrong call fails in
ctypes instead of corrupting memory.
"""

import ctypes
import threading

from rdma_device import _loader

# rdev_status (values never change).
OK = 0
INVALID_ARGUMENT = 1
NOT_VIABLE = 2
PEER_LOST = 3
ABORTED = 4
PROTOCOL = 5
RESOURCE_EXHAUSTED = 6
IO = 7
CONFIG = 8
TIMEOUT = 9
INTERNAL = 10
PANIC = 11

# rdev_transport.
TRANSPORT_NAMES = {0: None, 1: "shm", 2: "verbs"}


class RdevError(Exception):
    """An error of the transport: ``status`` is the ``rdev_status`` value,
    ``status_name`` its name (``RDEV_PEER_LOST``...), ``message`` the
    library's explanation (it names the peer and what was awaited)."""

    status = INTERNAL

    def __init__(self, status, message):
        self.status = status
        self.status_name = status_str(status)
        self.message = message
        super().__init__(f"{self.status_name}: {message}")


class InvalidArgument(RdevError, ValueError):
    pass


class NotViable(RdevError):
    """No transport of ours reaches the peer (the message says why)."""


class PeerLost(RdevError, ConnectionError):
    """The peer's process or connection went away."""


class Aborted(RdevError):
    """The operation was aborted (the endpoint closed, the peer aborted)."""


class ProtocolError(RdevError):
    pass


class ResourceExhausted(RdevError):
    pass


class ConfigError(RdevError):
    """A bad ``RDMA_DEVICE_*`` setting (the message names it)."""


class DeadlineExceeded(RdevError, TimeoutError):
    """A wait passed its deadline (``RDEV_TIMEOUT``)."""


_BY_STATUS = {INVALID_ARGUMENT: InvalidArgument, NOT_VIABLE: NotViable, PEER_LOST: PeerLost,
              ABORTED: Aborted, PROTOCOL: ProtocolError, RESOURCE_EXHAUSTED: ResourceExhausted,
              CONFIG: ConfigError, TIMEOUT: DeadlineExceeded}


def error(status, message):
    """The exception for ``status`` (a subclass of RdevError)."""
    return _BY_STATUS.get(status, RdevError)(status, message)


class TensorMeta(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("ndims", ctypes.c_uint32), ("dims", ctypes.POINTER(ctypes.c_int64))]


class BufferDesc(ctypes.Structure):
    """``rdev_buffer_desc``: a received buffer, described in one call."""
    _fields_ = [("data", ctypes.c_void_p), ("len", ctypes.c_size_t),
                ("dims", ctypes.POINTER(ctypes.c_int64)), ("dtype", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("ndims", ctypes.c_uint32), ("in_place", ctypes.c_bool)]


# Completion callbacks. They run on the calling thread or on the library's
# `rdev-callbacks` thread; the objects below live as long as the module, so
# a callback can never outlive its trampoline.
# `msg` is a (pointer, length) pair, not NUL-terminated: c_void_p.
SEND_DONE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                             ctypes.c_size_t)
RECV_DONE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_void_p)

_c = ctypes
_SIGNATURES = {
    "rdev_context_new": (_c.c_int, [_c.c_char_p, _c.c_size_t, _c.c_char_p, _c.c_size_t,
                                    _c.POINTER(_c.c_void_p)]),
    "rdev_context_free": (None, [_c.c_void_p]),
    "rdev_context_add_peer": (_c.c_int, [_c.c_void_p, _c.c_char_p, _c.c_size_t, _c.c_char_p,
                                         _c.c_size_t, _c.POINTER(_c.c_int)]),
    "rdev_connect_peer": (_c.c_int, [_c.c_void_p, _c.c_char_p, _c.c_size_t]),
    "rdev_send": (_c.c_int, [_c.c_void_p, _c.c_char_p, _c.c_size_t, _c.c_char_p, _c.c_size_t,
                             _c.c_uint64, _c.POINTER(TensorMeta), _c.c_void_p, _c.c_size_t,
                             SEND_DONE, _c.c_void_p]),
    "rdev_recv": (_c.c_int, [_c.c_void_p, _c.c_char_p, _c.c_size_t, _c.c_char_p, _c.c_size_t,
                             _c.c_uint64, RECV_DONE, _c.c_void_p]),
    "rdev_recv_waitable": (_c.c_int, [_c.c_void_p, _c.c_char_p, _c.c_size_t, _c.c_char_p, _c.c_size_t,
                                      _c.c_uint64, _c.POINTER(_c.c_void_p)]),
    "rdev_wait": (_c.c_int, [_c.c_void_p, _c.c_uint64, _c.POINTER(_c.c_void_p)]),
    "rdev_waiter_free": (None, [_c.c_void_p]),
    "rdev_place_edge": (_c.c_int, [_c.c_void_p, _c.c_char_p, _c.c_size_t, _c.c_char_p, _c.c_size_t,
                                   _c.c_uint64, _c.c_uint64, _c.POINTER(_c.c_bool)]),
    "rdev_request_placement": (_c.c_int, [_c.c_void_p, _c.c_char_p, _c.c_size_t, _c.c_char_p,
                                          _c.c_size_t, _c.c_char_p, _c.c_size_t, _c.c_uint64,
                                          _c.c_uint64, _c.POINTER(_c.c_bool)]),
    "rdev_step_done": (_c.c_int, [_c.c_void_p, _c.c_uint64]),
    "rdev_abort_step": (_c.c_int, [_c.c_void_p, _c.c_uint64, _c.c_uint32, _c.c_char_p,
                                   _c.c_size_t, _c.c_bool]),
    "rdev_abort_all": (_c.c_int, [_c.c_void_p, _c.c_char_p, _c.c_size_t]),
    "rdev_abort_peer": (_c.c_int, [_c.c_void_p, _c.c_char_p, _c.c_size_t]),
    "rdev_buffer_data": (_c.c_void_p, [_c.c_void_p]),
    "rdev_buffer_len": (_c.c_size_t, [_c.c_void_p]),
    "rdev_buffer_dtype": (_c.c_uint32, [_c.c_void_p]),
    "rdev_buffer_flags": (_c.c_uint32, [_c.c_void_p]),
    "rdev_buffer_ndims": (_c.c_uint32, [_c.c_void_p]),
    "rdev_buffer_dims": (_c.POINTER(_c.c_int64), [_c.c_void_p]),
    "rdev_buffer_in_place": (_c.c_bool, [_c.c_void_p]),
    "rdev_buffer_release": (None, [_c.c_void_p]),
    "rdev_buffer_describe": (_c.c_bool, [_c.c_void_p, _c.POINTER(BufferDesc)]),
    "rdev_status_str": (_c.c_char_p, [_c.c_int]),
    "rdev_last_error": (_c.c_size_t, [_c.c_char_p, _c.c_size_t]),
}

_lock = threading.Lock()
_lib = None


def lib():
    """librdma_device.so with the signatures above (loaded once)."""
    global _lib
    with _lock:
        if _lib is None:
            core = _loader._core_lib()
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(core, name)
                fn.restype, fn.argtypes = restype, argtypes
            _lib = core
        return _lib


def status_str(status):
    name = lib().rdev_status_str(status)
    return name.decode("utf-8", "replace") if name else f"RDEV_STATUS_{status}"


def last_error():
    buf = ctypes.create_string_buffer(4096)
    lib().rdev_last_error(buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def check_status(status, what):
    """Raises the error of a synchronous call that returned ``status``."""
    if status != OK:
        raise error(status, f"{what}: {last_error()}")
