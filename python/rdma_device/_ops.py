"""Completions of the endpoint API: futures, the callback trampolines, and
received arrays (zero-copy views of a receive slot).

Threads: receives are waited on by the receiving thread itself
(``WaitFuture``: ``rdev_wait`` with the GIL released, woken directly by
the transport's event thread). Sends complete through a callback, which
the library runs on the calling thread or on its ``rdev-callbacks``
thread. The trampolines below are module-level ctypes objects, so they
outlive every callback; an operation's state (the array being sent, the
future) sits in ``_pending`` under an integer token until its callback has
run. A callback only stores the outcome and sets an event: it never
blocks, never calls back into the library's blocking functions, and runs
no user code. It does need the GIL: a Python thread that computes without
releasing it delays the context's callback thread by up to
``sys.getswitchinterval()`` (5 ms).
"""

import ctypes
import itertools
import math
import threading
import time

import numpy as np

from rdma_device import _capi, _dtypes

_pending = {}  # token -> _Op, until its callback ran
_pending_lock = threading.Lock()
_tokens = itertools.count(1)

DLPACK_CPU = 1  # DLDeviceType kDLCPU


class Future:
    """The outcome of a send or receive, completed by a library thread.

    ``result(timeout)`` waits at most ``timeout`` seconds and raises
    :class:`DeadlineExceeded` after that; the operation itself goes on (a
    later ``result`` may still return it)."""

    def __init__(self, what):
        self._what = what
        # Held until the outcome is in: a bare lock is the cheapest
        # one-shot event (threading.Event allocates a lock per wait).
        self._gate = threading.Lock()
        self._gate.acquire()
        self._finished = False
        self._value = None
        self._error = None
        self._convert = None  # caller-side conversion of the raw value, once
        self._lock = threading.Lock()

    def done(self):
        return self._finished

    def _set(self, value=None, error=None):
        self._value, self._error = value, error
        self._finished = True
        self._gate.release()

    def _wait(self, timeout):
        if self._finished:
            return
        if not self._gate.acquire(timeout=min(timeout, threading.TIMEOUT_MAX)):
            raise _capi.DeadlineExceeded(_capi.TIMEOUT, f"{self._what}: no outcome within "
                                                        f"{timeout:.3g} s")
        self._gate.release()  # for any other waiter

    def exception(self, timeout=60.0):
        self._wait(timeout)
        return self._error

    def result(self, timeout=60.0):
        self._wait(timeout)
        with self._lock:
            if self._error is None and self._convert is not None:
                convert, self._convert = self._convert, None
                try:
                    self._value = convert(self._value)
                except BaseException as e:
                    self._value, self._error = None, e
            if self._error is not None:
                raise self._error
            return self._value


class WaitFuture(Future):
    """A receive's Future that the waiting thread completes itself: the
    receive was posted with ``rdev_recv_waitable`` and ``result`` waits in
    ``rdev_wait`` (the GIL released), which the library's event thread
    wakes directly. No Python callback runs on a library thread, so an
    arriving array costs one thread wake-up instead of a callback that
    needs the GIL and then wakes the waiter. ``on_error(error)`` runs on
    the thread that takes a failed outcome."""

    # Slices of one wait: a signal (Ctrl-C) is handled between them.
    SLICE_S = 0.5

    def __init__(self, what, handle, on_error=None):
        super().__init__(what)
        self._handle = handle
        self._on_error = on_error
        self._taking = threading.Lock()

    def done(self):
        if not self._finished:
            self._take(0.0)
        return self._finished

    def _wait(self, timeout):
        if not self._finished:
            self._take(timeout)
        if not self._finished:
            raise _capi.DeadlineExceeded(_capi.TIMEOUT, f"{self._what}: no outcome within {timeout:.3g} s")

    def _take(self, timeout):
        deadline = time.monotonic() + min(timeout, threading.TIMEOUT_MAX)
        if not self._taking.acquire(timeout=min(timeout, threading.TIMEOUT_MAX)):
            return
        try:
            lib = _capi.lib()
            buf = ctypes.c_void_p()
            while not self._finished:
                left = max(0.0, deadline - time.monotonic())
                st = lib.rdev_wait(self._handle, math.ceil(min(left, self.SLICE_S) * 1000), ctypes.byref(buf))
                if st == _capi.TIMEOUT:
                    if time.monotonic() >= deadline:
                        return
                    continue
                if st == _capi.OK:
                    self._set(_Lease(buf.value))
                else:
                    self._set(error=_capi.error(st, _capi.last_error() or self._what))
                self._free()
                if self._error is not None and self._on_error is not None:
                    self._on_error(self._error)
        finally:
            self._taking.release()

    def _free(self):
        h, self._handle = self._handle, None
        if h:
            try:
                _capi._lib.rdev_waiter_free(h)
            except Exception:
                pass

    def __del__(self):
        self._free()


class _Op:
    """What a callback needs and what must stay alive until it runs."""

    __slots__ = ("future", "keep", "owner", "on_done")

    def __init__(self, future, keep, owner, on_done=None):
        self.future, self.keep, self.owner, self.on_done = future, keep, owner, on_done


def register(op):
    """A token for ``op``, the userdata of its callback."""
    token = next(_tokens)
    with _pending_lock:
        _pending[token] = op
    return token


def unregister(token):
    """Forget ``token`` whose call failed (its callback will never run)."""
    with _pending_lock:
        return _pending.pop(token, None)


def pending_of(owner):
    """How many operations of ``owner`` still wait for their callback."""
    with _pending_lock:
        return sum(1 for op in _pending.values() if op.owner is owner)


def _message(msg, msg_len):
    return ctypes.string_at(msg, msg_len).decode("utf-8", "replace") if msg and msg_len else ""


@_capi.SEND_DONE
def _send_done(userdata, status, msg, msg_len):
    try:
        op = unregister(userdata)
        if op is None:
            return
        if status == _capi.OK:
            op.future._set(None)
        else:
            op.future._set(error=_capi.error(status, _message(msg, msg_len) or op.future._what))
        if op.on_done is not None:
            op.on_done()
    except BaseException as e:  # never let an exception unwind into the library
        _report(e)


@_capi.RECV_DONE
def _recv_done(userdata, status, msg, msg_len, buf):
    lease = _Lease(buf) if buf else None  # released when dropped, whatever happens next
    try:
        op = unregister(userdata)
        if op is None:
            return
        if status == _capi.OK and lease is not None:
            op.future._set(lease)
        else:
            text = _message(msg, msg_len) or op.future._what
            op.future._set(error=_capi.error(status if status != _capi.OK else _capi.INTERNAL, text))
        if op.on_done is not None:
            op.on_done()
    except BaseException as e:
        _report(e)


def _report(e):
    try:
        import sys

        print(f"rdma_device: error in a completion callback: {e!r}", file=sys.stderr)
    except BaseException:
        pass


class _Lease:
    """Owns one ``rdev_buffer``: released (its slot back to the sender) when
    the last reference, from a Received or from any view of it, goes."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __del__(self):
        # Cheaper than weakref.finalize on the receive path. At interpreter
        # exit the library may be gone: the process's end frees the slot.
        try:
            _capi._lib.rdev_buffer_release(self.ptr)
        except Exception:
            pass


class Received:
    """A received array: a zero-copy view of the receive slot the sender
    wrote into, valid until :meth:`release` (or the end of a ``with``
    block) and for as long as a view taken from it is alive.

    ``array`` is a read-only NumPy view; ``__dlpack__`` exports the same
    memory (``numpy.from_dlpack``, ``torch.from_dlpack``). The slot goes
    back to the sender once it is released and no view remains: a view
    kept for long keeps the slot, and the sender waits for a free one once
    every slot of the edge is held."""

    def __init__(self, peer, slot, seq, lease, expect):
        d = _capi.BufferDesc()
        if not _capi.lib().rdev_buffer_describe(lease.ptr, ctypes.byref(d)):
            raise _capi.error(_capi.INTERNAL, f"{peer}/{slot} #{seq}: the buffer was released")
        if d.flags:
            raise _capi.error(_capi.PROTOCOL, f"{peer}/{slot} #{seq}: a tensor with flags "
                                              f"{d.flags:#x} (a dead or serialized TensorFlow "
                                              "tensor) is not an array")
        dtype = _dtypes.from_code(d.dtype)
        ndims = d.ndims
        if dtype is None or ndims > 64:
            raise _capi.error(_capi.PROTOCOL, f"{peer}/{slot} #{seq}: dtype code "
                                              f"{d.dtype} with {ndims} dims "
                                              "is not an array this API sends")
        shape = tuple(d.dims[:ndims]) if ndims else ()
        length = d.len
        want = dtype.itemsize
        for dim in shape:
            if dim < 0:
                raise _capi.error(_capi.PROTOCOL, f"{peer}/{slot} #{seq}: negative dim in {shape}")
            want *= dim
        if want != length:
            raise _capi.error(_capi.PROTOCOL, f"{peer}/{slot} #{seq}: {length} bytes for a "
                                              f"{dtype}{list(shape)} array of {want} bytes")
        if expect is not None and (dtype, shape) != expect:
            raise _capi.error(_capi.INVALID_ARGUMENT,
                              f"{peer}/{slot} #{seq}: the slot was placed for {expect[0]}"
                              f"{list(expect[1])}, the peer sent {dtype}{list(shape)}")
        self.peer, self.slot, self.seq = peer, slot, seq
        self.dtype, self.shape, self.nbytes = dtype, shape, length
        self.in_place = bool(d.in_place)
        if length == 0:
            alias = np.empty(shape, dtype)  # no bytes: nothing to lend
        else:
            raw = (ctypes.c_char * length).from_address(d.data)
            raw._lease = lease  # every view's base chain ends here
            alias = np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape)
        self._alias = alias  # writable: only for legacy DLPack consumers (see __dlpack__)
        self._array = alias.view()
        self._array.flags.writeable = False

    def _live(self):
        if self._alias is None:
            raise ValueError(f"{self.peer}/{self.slot} #{self.seq} was released")
        return self._alias

    @property
    def array(self):
        """Read-only NumPy view of the slot."""
        self._live()
        return self._array

    def numpy(self):
        return self.array

    def __array__(self, dtype=None, copy=None):
        if copy:
            return np.array(self.array, dtype=dtype, copy=True)
        return self.array if dtype is None else self.array.astype(dtype, copy=False)

    def __dlpack_device__(self):
        return (DLPACK_CPU, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """DLPack export of the slot, no copy. A consumer that speaks DLPack
        1.0 (``max_version``) gets it flagged read-only; an older one,
        which has no such flag, gets a writable alias: writing to it changes
        this process's received bytes only, never the sender's."""
        alias = self._live()
        if max_version is not None and tuple(max_version) >= (1, 0):
            return self._array.__dlpack__(stream=stream, max_version=max_version,
                                          dl_device=dl_device, copy=copy)
        return alias.__dlpack__(stream=stream)

    def release(self):
        """Give the slot back to the sender (once no view of it remains).
        Idempotent; ``array`` raises after it."""
        self._alias = self._array = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __repr__(self):
        state = "released" if self._alias is None else ("in place" if self.in_place else "copied")
        return f"<Received {self.peer}/{self.slot} #{self.seq} {self.dtype}{list(self.shape)} {state}>"


def wait_idle(owner, timeout):
    """Waits up to ``timeout`` s until no operation of ``owner`` waits for
    its callback; returns how many still do."""
    deadline = time.monotonic() + timeout
    while True:
        n = pending_of(owner)
        if n == 0 or time.monotonic() >= deadline:
            return n
        time.sleep(0.005)
