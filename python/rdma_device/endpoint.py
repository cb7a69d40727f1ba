"""Endpoints: the one-sided tensor transport from any Python process,
without TensorFlow.

Each process makes one :class:`Endpoint` with a name and a ``host:port``
address, and tells it its peers' names and addresses. A receiver *places*
a named slot for a shape and dtype ahead of time; the peer then *pushes*
NumPy arrays into it, each push one one-sided write (a memcpy into the
receiver's shared memory on one host, an RDMA WRITE across hosts); the
receiver gets a zero-copy view of the slot::

    # process "b" (receiver)                    # process "a" (sender)
    ep = Endpoint("b", "127.0.0.1:7001")         ep = Endpoint("a", "127.0.0.1:7000")
    ep.add_peer("a", "127.0.0.1:7000")           ep.add_peer("b", "127.0.0.1:7001")
    ep.place("a", "grad", (1024,), "float32")
                                                 ep.send("b", "grad", x).result()
    with ep.recv("a", "grad") as r:
        total += r.array.sum()                   # r.array: read-only view
        t = torch.from_dlpack(r)                 # same memory, no copy

Start-up: ``add_peer`` waits (``timeout``, default 60 s) until the peer's
endpoint is up, so processes may start in any order; but a slot must be
placed before its sender's first send to it (a placement racing with that
send waits for the receive and can time out), so senders wait for a word
from the receiver (any channel) before they start.

Transports, settings and counters are the TensorFlow plugin's: shm between
processes of one host, RDMA verbs across hosts, chosen per peer by
:meth:`Endpoint.add_peer`; ``RDMA_DEVICE_*`` environment variables
(``rdma_device.config()``); ``rdma_device.stats()`` counts the tensors and
bytes pushed and received. It needs only ``librdma_device.so``.

Ordering. The k-th array sent by one endpoint to a slot is the k-th one
its receiver gets from that slot, whatever order the writes land in
(each carries a per-slot sequence number, the transport's step id). There
is no order between slots or between senders. Up to
``RDMA_DEVICE_SLOTS_PER_EDGE`` (default 2) arrays per slot can be in the
receiver's memory at once; a further send waits, in the library and not
in the caller, for the receiver to release one. A slot whose arrays do
not fit in the receive arena (``RDMA_DEVICE_ARENA_BYTES``; ``place``
returns False) still works, through the transport's chunked path
(``Received.in_place`` is then False). An array whose dtype or shape is
not the slot's fails its receive with :class:`InvalidArgument`.

Completion and deadlines. :meth:`Endpoint.send` never blocks on the
network: it returns a :class:`Future` that completes once the bytes are in
the receiver's memory (the array may then be reused), or with the error.
The array must not be modified before that. Every wait has a deadline:
``Future.result(timeout)`` and ``Endpoint.recv(timeout=)`` (default 60 s)
raise :class:`DeadlineExceeded` when it passes. A receive that timed out
is not lost: the next ``recv`` on that slot goes on waiting for the same
array. ``place`` waits at most ``timeout`` for the sender to take the
placement.

Peer failure. When a peer's process dies or its connection breaks, its
pending and later receives and sends fail with :class:`PeerLost` (or
:class:`Aborted`; a send that starts after the loss first tries the peer
again for a short grace, 1.5 s, in case it restarted, and then fails with
:class:`DeadlineExceeded`), within the transport's detection time: at
once when the socket closes on one host; the verbs ACK timeout across hosts (see
``RDMA_DEVICE_VERBS_ACK_TIMEOUT``). A slot whose receive failed this way
has lost its place in the sequence: place it again with a new name (or
make new endpoints) to talk to a restarted peer. Closing an endpoint fails
its pending operations with :class:`Aborted`. Close only once the peers
are done with it: a receiver that still has to claim arrays an endpoint
wrote before it closed (or exited) can fail those receives with
:class:`NotViable` (its transport takes the vanished listener for a peer
that does not run the transport), so end with an application-level
"done" from the receivers.

Errors are :class:`RdevError` subclasses carrying the library's status
(``status``, ``status_name``) and message. Names of endpoints and slots
are non-empty strings without NUL or ``;``.
"""

import atexit
import math
import threading
import weakref
import zlib

import numpy as np

from rdma_device import _capi, _dtypes, _ops, _ready
from rdma_device._capi import (Aborted, ConfigError, DeadlineExceeded, InvalidArgument, NotViable,
                               PeerLost, ProtocolError, RdevError, ResourceExhausted)
from rdma_device._loader import config, reset_stats, stats
from rdma_device._ops import Future, Received

__all__ = ["Aborted", "ConfigError", "DeadlineExceeded", "Endpoint", "Future", "InvalidArgument",
           "NotViable", "PeerLost", "ProtocolError", "RdevError", "Received", "ResourceExhausted",
           "config", "reset_stats", "stats", "supported_dtypes"]

DEFAULT_TIMEOUT = 60.0
# Step ids: (31-bit hash of the edge key) << 32 | per-slot sequence number.
# Steps are per context in the library (end of step, aborts), so each slot
# gets a range of its own; the top bit stays clear (u64::MAX is reserved).
_SEQ_BITS = 32


_open = weakref.WeakSet()  # endpoints to close before the interpreter goes


@atexit.register
def _close_all():
    # Library threads must not call into a finalizing interpreter.
    for ep in list(_open):
        try:
            ep.close(timeout=2.0)
        except Exception:
            pass


def supported_dtypes():
    """The NumPy dtypes an endpoint carries."""
    return _dtypes.supported()


def _name(what, s):
    if not isinstance(s, str) or not s or "\0" in s or ";" in s:
        raise ValueError(f"rdma_device: {what} must be a non-empty string without NUL or ';', "
                         f"not {s!r}")
    return s


def _edge(sender, receiver, slot):
    key = f"endpoint;{sender};{receiver};{slot}"
    return key.encode("utf-8"), (zlib.crc32(key.encode("utf-8")) & 0x7FFFFFFF) << _SEQ_BITS


def _ms(timeout):
    if timeout is None or not timeout > 0:
        raise ValueError(f"rdma_device: timeout must be > 0 seconds, not {timeout!r}")
    return max(1, int(min(timeout, 1e9) * 1000))


class _Slot:
    """One direction of one named slot with one peer."""

    def __init__(self, key, base):
        self.key, self.base = key, base
        self.peer = b""  # the peer's name, encoded
        self.seq = 0  # next sequence number to send or to post a receive for
        self.lock = threading.Lock()
        self.expect = None  # receiver: (dtype, shape) it was placed for
        self.meta = None  # sender: the last send's (code, shape, TensorMeta, dtype, pointer to the meta)
        self.waiting = None  # receiver: a receive that outlived its caller's deadline

    def step(self):
        if self.seq >= 1 << _SEQ_BITS:
            raise ResourceExhausted(_capi.RESOURCE_EXHAUSTED, "slot sequence numbers exhausted")
        return self.base | self.seq


class Endpoint:
    """This process's transport endpoint (see the module docs).

    ``address``: ``"host:port"`` where peers reach it; the endpoint listens
    on it (TCP, readiness only: see :meth:`add_peer`), and the port also
    names its shared-memory socket. None or port 0: 127.0.0.1 or the host
    given, on a free port (``address`` then says which)."""

    def __init__(self, name, address=None):
        self.name = _name("endpoint name", name)
        sock, address = _ready.bind(address or "127.0.0.1:0")
        self.address = address
        self._lib = _capi.lib()
        out = _capi.ctypes.c_void_p()
        n, a = self.name.encode(), address.encode()
        try:
            _capi.check_status(self._lib.rdev_context_new(n, len(n), a, len(a), _capi.ctypes.byref(out)),
                        f"endpoint {name} at {address}")
        except BaseException:
            sock.close()
            raise
        self._ctx = out.value
        # Listening says "this endpoint's transport is up" (see _ready).
        self._ready = _ready.Listener(sock)
        self._state = threading.Condition(threading.Lock())
        self._active = 0  # calls into the context in progress
        self._closed = False
        self._peers = {}
        self._tx = {}  # (peer, slot) -> _Slot
        self._rx = {}  # (peer, slot) -> _Slot
        self._bases = {}  # receiver step range -> (peer, slot)
        _open.add(self)

    # -- the context's lifetime ------------------------------------------

    def _enter(self):
        with self._state:
            if self._closed:
                raise Aborted(_capi.ABORTED, f"endpoint {self.name} is closed")
            self._active += 1
        return self._ctx

    def _exit(self):
        with self._state:
            self._active -= 1
            if self._closed:
                self._state.notify_all()

    def close(self, timeout=10.0):
        """Fail pending operations (Aborted), close connections, free the
        context. Received arrays stay readable until released."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            ctx = self._ctx
        msg = f"endpoint {self.name} closed".encode()
        self._lib.rdev_abort_all(ctx, msg, len(msg))
        with self._state:  # every call into ctx is non-blocking or bounded
            self._state.wait_for(lambda: self._active == 0, timeout)
            busy = self._active
        if busy:  # never free a context a thread is still inside
            raise DeadlineExceeded(_capi.TIMEOUT, f"endpoint {self.name}: {busy} calls still "
                                                  f"running after {timeout} s; not freed")
        self._lib.rdev_context_free(ctx)
        # Callbacks of the failed operations may still run on the library's
        # thread; their state stays registered until they have.
        _ops.wait_idle(self, timeout)
        self._ready.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- peers -------------------------------------------------------------

    def add_peer(self, name, address, timeout=60.0):
        """Tell the endpoint where peer ``name`` is, and wait (at most
        ``timeout`` s; 0: not at all) until the peer's endpoint is up;
        returns the transport that will carry arrays to and from it ("shm"
        or "verbs"). Raises NotViable, with the reason, when none does,
        and DeadlineExceeded when the peer did not come up in time.

        Contacting a peer whose endpoint does not exist yet (sending to
        it, placing a slot it sends) makes the transport treat it as one
        that does not run the transport, for good: the wait here is what
        prevents that."""
        _name("peer name", name)
        if timeout and not _ready.wait_for(address, timeout):
            raise DeadlineExceeded(_capi.TIMEOUT, f"peer {name} at {address} did not come up "
                                                  f"within {timeout} s")
        n, a = name.encode(), address.encode()
        kind = _capi.ctypes.c_int(0)
        ctx = self._enter()
        try:
            _capi.check_status(self._lib.rdev_context_add_peer(ctx, n, len(n), a, len(a),
                                                        _capi.ctypes.byref(kind)),
                        f"peer {name} at {address}")
            transport = _capi.TRANSPORT_NAMES.get(kind.value)
            if transport is None:
                raise NotViable(_capi.NOT_VIABLE, f"no transport reaches {name} at {address}: "
                                                  f"{_capi.last_error()}")
        finally:
            self._exit()
        self._peers[name] = (address, transport)
        return transport

    @staticmethod
    def stats():
        """The transport's counters (process-wide, as ``rdma_device.stats()``)."""
        return stats()

    def peers(self):
        """{name: (address, transport)} of the peers added."""
        return dict(self._peers)

    def _peer(self, name):
        if name not in self._peers:
            raise ValueError(f"rdma_device: {name!r} is not a peer of {self.name} (add_peer first)")
        return name.encode()

    # -- receiving -----------------------------------------------------------

    def place(self, peer, slot, shape, dtype, timeout=30.0):
        """Place slot ``slot`` for arrays of ``shape`` and ``dtype`` that
        ``peer`` will send, and wait (at most ``timeout`` s) until the
        sender has taken the placement: its first send is then already a
        one-sided write. Returns False when the receive arena had no room
        (the slot then uses the slower chunked path; not an error).
        Placing an existing slot again changes its shape and dtype."""
        dtype = _dtypes.native(dtype)
        _dtypes.code_of(dtype)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape) or len(shape) > 64:
            raise ValueError(f"rdma_device: bad shape {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        p = self._peer(peer)
        key, base = _edge(peer, self.name, _name("slot name", slot))
        other = self._bases.get(base)
        if other is not None and other != (peer, slot):
            raise ValueError(f"rdma_device: slot {peer}/{slot} shares its step range with "
                             f"{other[0]}/{other[1]}: choose another name")
        s = self._rx.get((peer, slot))
        if s is None:
            s = self._rx[(peer, slot)] = _Slot(key, base)
            s.peer = p
            self._bases[base] = (peer, slot)
        s.expect = (dtype, shape)
        placed = _capi.ctypes.c_bool(False)
        ctx = self._enter()
        try:
            _capi.check_status(self._lib.rdev_request_placement(
                ctx, p, len(p), self.name.encode(), len(self.name.encode()), key, len(key),
                nbytes, _ms(timeout), _capi.ctypes.byref(placed)), f"placing {peer}/{slot}")
        finally:
            self._exit()
        return placed.value

    def recv_async(self, peer, slot):
        """Post the next receive of ``slot`` from ``peer``; the Future's
        result is a :class:`Received`. Receives of one slot complete in the
        order they were posted."""
        s = self._rx_slot(peer, slot)
        with s.lock:
            return self._post(peer, slot, s)

    def recv(self, peer, slot, timeout=DEFAULT_TIMEOUT):
        """The next array of ``slot`` from ``peer``, waiting at most
        ``timeout`` s (DeadlineExceeded; the receive stays posted and the
        next call goes on waiting for the same array)."""
        s = self._rx_slot(peer, slot)
        _ms(timeout)
        if not s.lock.acquire(timeout=timeout):
            raise DeadlineExceeded(_capi.TIMEOUT, f"{peer}/{slot}: another thread is receiving")
        try:
            fut = s.waiting if s.waiting is not None else self._post(peer, slot, s)
            s.waiting = fut
            fut._wait(timeout)  # raises DeadlineExceeded, leaving it posted
            s.waiting = None
        finally:
            s.lock.release()
        return fut.result(0)

    def _rx_slot(self, peer, slot):
        s = self._rx.get((peer, slot))
        if s is None:
            raise ValueError(f"rdma_device: slot {peer}/{slot} is not placed (place it first)")
        return s

    def _post(self, peer, slot, s):
        """Post the receive of ``s``'s next array (``s.lock`` held)."""
        p = s.peer
        seq, step = s.seq, s.step()
        handle = _capi.ctypes.c_void_p()
        ctx = self._enter()
        try:
            # Waited on by the receiving thread (rdev_wait), not completed
            # by a callback: see _ops.WaitFuture.
            _capi.check_status(self._lib.rdev_recv_waitable(ctx, p, len(p), s.key, len(s.key), step,
                                                     _capi.ctypes.byref(handle)),
                        f"receive {peer}/{slot}")
        finally:
            self._exit()
        fut = _ops.WaitFuture(f"receive {peer}/{slot} #{seq}", handle.value,
                              lambda e: self._recv_failed(step))
        expect = s.expect
        fut._convert = lambda lease: Received(peer, slot, seq, lease, expect)
        s.seq += 1
        return fut

    def _recv_failed(self, step):
        # A failed receive ends its step, so that a late write of it is
        # dropped instead of holding a slot.
        with self._state:
            if self._closed:
                return
            self._active += 1
        try:
            self._lib.rdev_step_done(self._ctx, step)
        finally:
            self._exit()

    # -- sending -------------------------------------------------------------

    def send(self, peer, slot, array):
        """Push ``array`` into the slot ``peer`` placed as ``slot``; returns
        a :class:`Future` (None once the bytes are in the peer's memory).
        Never blocks on the network. A non-contiguous or non-native-order
        array is first copied; otherwise the array's own memory is written
        from, so it must not change until the Future is done."""
        s = self._tx.get((peer, slot))
        m = s.meta if s is not None else None
        # The common case first: an ndarray of the slot's last dtype (the
        # same dtype object, so native order) and shape, contiguous. Its
        # meta and arguments are the last send's.
        if (m is not None and type(array) is np.ndarray and array.dtype is m[3] and array.shape == m[1]
                and array.flags.c_contiguous):
            arr = array
        else:
            arr, s, m = self._send_slot(peer, slot, array, s)
        data = arr.__array_interface__["data"][0] if arr.nbytes else None
        with s.lock:  # one sequence number per successful rdev_send
            fut = Future(f"send {peer}/{slot} #{s.seq}")
            token = _ops.register(_ops._Op(fut, arr, self))
            ctx = self._enter()
            try:
                st = self._lib.rdev_send(ctx, s.peer, len(s.peer), s.key, len(s.key), s.step(),
                                         m[4], data, arr.nbytes, _ops._send_done, token)
                if st != _capi.OK:
                    _ops.unregister(token)
                    _capi.check_status(st, f"send {peer}/{slot}")
            finally:
                self._exit()
            s.seq += 1
        return fut

    def _send_slot(self, peer, slot, array, s):
        """send()'s slow path: ``array`` as a contiguous native-order
        array, the slot (made on first use) and its meta for this dtype and
        shape, (code, shape, TensorMeta, dtype, pointer to the TensorMeta)."""
        arr = np.asarray(array)
        dtype = _dtypes.native(arr.dtype)
        code = _dtypes.code_of(dtype)
        if arr.dtype != dtype or not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr, dtype=dtype)
        if s is None:
            self._peer(peer)
            s = self._tx.setdefault((peer, slot), _Slot(*_edge(self.name, peer,
                                                               _name("slot name", slot))))
            s.peer = peer.encode()
        m = s.meta
        if m is None or m[0] != code or m[1] != arr.shape:
            # The library copies the meta during rdev_send: one per shape
            # serves every send of it (the dims array lives in the meta's
            # `_dims`).
            dims = (_capi.ctypes.c_int64 * max(1, arr.ndim))(*arr.shape)
            meta = _capi.TensorMeta(code, 0, arr.ndim, dims)
            meta._dims = dims
            m = s.meta = (code, arr.shape, meta, arr.dtype, _capi.ctypes.byref(meta))
        elif m[3] is not arr.dtype:
            # An equal dtype in another object: the same meta, and the next
            # send of this one takes the fast path.
            m = s.meta = (*m[:3], arr.dtype, m[4])
        return arr, s, m

    def __repr__(self):
        return f"<Endpoint {self.name} at {self.address}{' (closed)' if self._closed else ''}>"
