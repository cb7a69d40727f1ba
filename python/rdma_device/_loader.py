"""Finds and loads the two native libraries of the package.

``lib/librdma_device_tf.so``  the TensorFlow shim (tf.load_library): its
                               static registrar adds the "grpc+rdma_device"
                               ServerFactory.
``lib/librdma_device.so``      the transport (C ABI, include/rdma_device.h);
                               the shim finds it through rpath $ORIGIN and
                               stats()/config() read it through ctypes.
"""

import ctypes
import json
import os
import threading

PROTOCOL = "grpc+rdma_device"

_SHIM = "librdma_device_tf.so"
_CORE = "librdma_device.so"

_lock = threading.Lock()
_loaded_shim = None  # path of the shim once loaded in this process
_core = None  # ctypes.CDLL of librdma_device.so


def lib_dir():
    """Directory holding the package's native libraries."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")


def _path(name, directory=None):
    path = os.path.join(directory or lib_dir(), name)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"rdma_device: {path} not found; build the native libraries "
            "(pip install the rdma_device package, or cmake --install the "
            "build into rdma_device/lib)")
    return path


def load(directory=None):
    """Loads the TensorFlow plugin into this process (idempotent).

    Must run before any server with protocol "grpc+rdma_device" is created
    in this process. Returns the path of the loaded shim. Raises
    RuntimeError when the shim was built for another TensorFlow version.
    """
    global _loaded_shim
    with _lock:
        if _loaded_shim is not None:
            return _loaded_shim
        import tensorflow as tf  # deferred: stats()/config() need no TF

        shim = _path(_SHIM, directory)
        _check_built_for(_running_build(tf), os.path.dirname(shim))
        _load_tf_libraries(tf)
        tf.load_library(shim)
        error = ctypes.CDLL(shim).rdma_device_tf_load_error
        error.restype = ctypes.c_char_p
        message = error()
        if message:
            raise RuntimeError(message.decode("utf-8", "replace"))
        _loaded_shim = shim
        return shim


def _load_tf_libraries(tf):
    """Makes TensorFlow's two shared libraries, from this environment's
    ``tf.sysconfig.get_lib()``, resolvable by soname before the shim loads:
    its rpath names only relative directories, and a library already
    loaded is found by soname whatever the path."""
    for name in ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2"):
        path = os.path.join(tf.sysconfig.get_lib(), name)
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _abi_flags(joined):
    """tf.sysconfig's compile flags that describe the build (the ABI and
    alignment defines, the standard), not where its headers are."""
    return sorted(f for f in joined.split("|") if f and not f.startswith("-I"))


def _running_build(tf):
    """What identifies the running TensorFlow build, as build_info.json
    records it for the one the shim was compiled against."""
    return {"tensorflow": tf.__version__, "git_version": tf.version.GIT_VERSION,
            "compiler_version": tf.version.COMPILER_VERSION,
            "compile_flags": "|".join(tf.sysconfig.get_compile_flags())}


def _check_built_for(running, directory):
    """Refuses, before dlopen, a shim built against another TensorFlow (its
    C++ symbols would not resolve, or worse, resolve to other layouts): the
    version, git version, compiler and compile flags must match. That does
    not tell every build apart (``tensorflow`` and ``tensorflow-cpu`` 2.21.0
    share all four): the shim itself then compares the loaded TensorFlow
    libraries' segments with those it was built against, and registers
    nothing on a difference (server.cc; the load error says so).
    ``running``: what ``_running_build`` returns."""
    info_path = os.path.join(directory, "build_info.json")
    try:
        with open(info_path) as f:
            built = json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"rdma_device: {info_path} is missing or unreadable ({e}); "
                           "reinstall the rdma_device package") from None
    differ = []
    for key, what in (("tensorflow", "version"), ("git_version", "git version"),
                      ("compiler_version", "compiler")):
        if built.get(key) != running.get(key):
            differ.append(f"{what} {built.get(key)!r} when built, {running.get(key)!r} now")
    if _abi_flags(built.get("compile_flags", "")) != _abi_flags(running.get("compile_flags", "")):
        differ.append(f"compile flags {_abi_flags(built.get('compile_flags', ''))} when built, "
                      f"{_abi_flags(running.get('compile_flags', ''))} now")
    if differ:
        raise RuntimeError(
            f"rdma_device: the plugin was built against another TensorFlow than this process "
            f"runs ({'; '.join(differ)}); rebuild it in this environment "
            "(pip install --no-build-isolation ./python)")


def _core_lib():
    global _core
    with _lock:
        if _core is None:
            directory = os.path.dirname(_loaded_shim) if _loaded_shim else None
            _core = ctypes.CDLL(_path(_CORE, directory))
        return _core


_RDEV_OK = 0
_RDEV_RESOURCE_EXHAUSTED = 6


def _json_call(name):
    """Calls rdev_<x>_json(char *buf, size_t cap, size_t *out_len)."""
    lib = _core_lib()
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    fn.restype = ctypes.c_int
    cap = 1 << 14
    while True:
        buf = ctypes.create_string_buffer(cap)
        out_len = ctypes.c_size_t(0)
        rc = fn(buf, cap, ctypes.byref(out_len))
        if rc == _RDEV_RESOURCE_EXHAUSTED and out_len.value + 1 > cap:
            cap = out_len.value + 1  # the JSON grew: retry with its size
            continue
        if rc != _RDEV_OK:
            raise RuntimeError(f"rdma_device: {name} failed ({_status_str(rc)}): {_last_error()}")
        return json.loads(buf.raw[: out_len.value].decode("utf-8"))


def _status_str(status):
    fn = _core_lib().rdev_status_str
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_char_p
    return fn(status).decode("utf-8", "replace")


def _last_error():
    fn = _core_lib().rdev_last_error
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_size_t
    buf = ctypes.create_string_buffer(4096)
    fn(buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def stats():
    """Process-wide transport counters.

    ``{"counters": {...}, "peers": {task: transport}, "fallback_reasons":
    {reason: count}}``. Counters include tensors_pushed, tensors_received,
    fallback_tensors (tensors that went over stock gRPC) and their bytes.
    """
    return _json_call("rdev_stats_json")


def reset_stats():
    """Zeroes the process-wide counters (to measure one phase)."""
    fn = _core_lib().rdev_stats_reset
    fn.argtypes = []
    fn.restype = None
    fn()


def config():
    """Effective settings (RDMA_DEVICE_* variables) with defaults and help."""
    return _json_call("rdev_config_json")


def trace_enable(on=True):
    """Start (or, with ``on=False``, stop) recording every transfer's
    timeline in this process: the transport's spans (send, write, arrive,
    deliver, release, ...) and the shim's (tf:Send, tf:RecvFromRemote,
    RunGraph, CleanupGraph). ``RDMA_DEVICE_TRACE=1`` starts it with the
    server. Spans also reach TensorFlow's profiler while it records."""
    fn = _core_lib().rdev_trace_enable
    fn.argtypes = [ctypes.c_bool]
    fn.restype = None
    fn(bool(on))


def trace_take(process="rdma_device"):
    """The spans recorded since the last call, removed from the buffer, as a
    list of Chrome trace events (``traceEvents`` entries, timestamps in µs
    of CLOCK_REALTIME, so several processes' lists merge into one trace),
    this process named ``process``."""
    lib = _core_lib()
    fn = lib.rdev_trace_take_json
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
                   ctypes.POINTER(ctypes.c_size_t)]
    fn.restype = ctypes.c_int
    free = lib.rdev_string_free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    name = process.encode("utf-8")
    out, out_len = ctypes.c_void_p(), ctypes.c_size_t(0)
    rc = fn(name, len(name), ctypes.byref(out), ctypes.byref(out_len))
    if rc != _RDEV_OK:
        raise RuntimeError(f"rdma_device: trace_take failed ({_status_str(rc)}): {_last_error()}")
    try:
        return json.loads(ctypes.string_at(out, out_len.value).decode("utf-8"))
    finally:
        free(out)
