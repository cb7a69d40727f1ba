"""Keeps TensorFlow's C++ start-up lines off the terminal.

``TF_CPP_MIN_LOG_LEVEL=2`` silences TensorFlow's own INFO and WARNING
lines, but some are written before it applies (absl's "All log messages
before absl::InitializeLog()", cudart_stub, cpu_feature_guard) and a few
are ERRORs. :func:`filter_stderr` puts a filter between this process's file
descriptor 2 and the terminal: lines in the C++ log format
(``I0000 00:00:1700000000.1 123 file.cc:31] ...``, or the older
``2024-01-01 12:00:00.1: I file.cc:31] ...``) and absl's preamble are
dropped, everything else (Python tracebacks, our own messages) passes.
Child processes that inherit stderr go through the same filter.
``RDMA_DEVICE_VERBOSE=1`` (what ``--verbose`` sets) keeps everything.
"""

import atexit
import os
import re
import sys
import threading

_TF_LINE = re.compile(rb"^(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [^\]\s]+:\d+\] |"
                      rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] [^\]\s]+:\d+\] |"
                      rb"WARNING: All log messages before absl::InitializeLog\(\) is called)")
_installed = False


def verbose():
    return os.environ.get("RDMA_DEVICE_VERBOSE", "") not in ("", "0")


def set_verbose(on):
    """``--verbose``: this process and its children keep TensorFlow's lines."""
    if on:
        os.environ["RDMA_DEVICE_VERBOSE"] = "1"


def quiet_env():
    """The log level for TensorFlow in this process and its children
    (``setdefault``: a level the user set wins)."""
    if not verbose():
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def is_tf_log_line(line):
    return bool(_TF_LINE.match(line if isinstance(line, bytes) else line.encode()))


def filter_stderr():
    """Installs the filter once (no-op when verbose). Call it before
    TensorFlow is imported."""
    global _installed
    quiet_env()
    if _installed or verbose():
        return
    _installed = True
    sys.stderr.flush()
    term = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)

    def pump():
        with os.fdopen(r, "rb", buffering=0) as src:
            pending = b""
            while True:
                try:
                    chunk = src.read(65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not is_tf_log_line(line):
                        _write_all(term, line + b"\n")
            if pending and not is_tf_log_line(pending):
                _write_all(term, pending)

    t = threading.Thread(target=pump, name="rdma_device-stderr", daemon=True)
    t.start()

    def restore():
        # Lines written so far reach the terminal; children still holding
        # the pipe cannot keep this process from exiting (bounded join).
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(term, 2)
        t.join(timeout=2)

    atexit.register(restore)


def _write_all(fd, data):
    while data:
        try:
            n = os.write(fd, data)
        except OSError:
            return
        data = data[n:]
