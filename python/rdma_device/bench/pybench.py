"""``python -m rdma_device.bench py``: the endpoint API between two
processes against the stock ways to move arrays between Python processes,
interleaved in one run.

Two spawned processes, a producer and a consumer, hold every transport at
once and run the same schedule, so blocks of each baseline alternate (the
order rotates every repetition):

``rdma_device``          Endpoint.send into a slot the consumer placed;
                          the consumer receives a zero-copy view, touches
                          it, releases it.
``shared_memory+pipe``    multiprocessing.shared_memory, its best shot: two
                          preallocated blocks (the same pipelining depth as
                          the transport's two slots per edge), the producer
                          copies the array in (the one copy any transport
                          needs), a pipe carries "block i is full" and "block
                          i is free", the consumer touches the block in
                          place.
``gloo``                  torch.distributed send/recv over gloo (TCP on
                          loopback) into a preallocated tensor, when torch
                          is importable (else skipped, with the reason).
``tensorpipe_rpc``        PyTorch RPC (torch.distributed.rpc over
                          TensorPipe, its own choice of transport: shm and
                          cma on one host): the producer calls a function
                          of the consumer with the tensor as argument,
                          all of a block's calls in flight at once; the
                          function touches the tensor (with --rpc, when
                          torch is importable: while it is up, its
                          threads poll and take CPU from every other
                          baseline, so it is not in the default set).

Stream: the producer sends ``n`` arrays of one size back to back; the
consumer touches every byte of each (a uint64 sum) and answers one small
message at the end; GB/s = n * size / block time, median over repetitions.
Ping-pong: one small array there and back, latency = half the round trip.
CPU: both processes' CPU time (every thread, the transport's included) per
GB moved, next to wall time. The memcpy line is one thread's np.copyto of
the same size into shared memory in the producer, in blocks interleaved
with the others. ``--json``: one row per size and baseline
with size, baseline, ours_gbps, baseline_gbps, ratio (= ours/baseline).
"""

import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import traceback

import numpy as np

from rdma_device._units import parse_size

OURS = "rdma_device"
SHM = "shared_memory+pipe"
GLOO = "gloo"
TENSORPIPE = "tensorpipe_rpc"
PING_SIZES = (64, 4096)
WAIT = 120.0


def add_parser(sub):
    p = sub.add_parser("py", help="the endpoint API (no TensorFlow) vs shared_memory+pipe and gloo")
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="stream sizes (K/M suffix)")
    p.add_argument("--reps", type=int, default=5, help="interleaved blocks per size and baseline")
    p.add_argument("--pings", type=int, default=200, help="round trips per ping-pong block")
    p.add_argument("--quick", action="store_true", help="smoke run: 4K and 1M, 2 reps, 20 pings")
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo baseline")
    p.add_argument("--rpc", action="store_true",
                   help="add the PyTorch RPC (TensorPipe) baseline; off by default: its threads "
                        "keep polling while idle and change the other baselines' numbers")
    p.add_argument("--plot", default="rdma_device_py.png", help="plot file ('' for none)")
    p.add_argument("--json", action="store_true", help="one JSON row per size and baseline")
    return pybench


def _count(size):
    """Arrays per stream block: about 64 MiB of traffic, 4..256 arrays."""
    return max(4, min(256, (64 << 20) // size))


def _touch(view):
    return int(view.view(np.uint64).sum())


_RPC_DONE = threading.Event()


def _rpc_take(t):
    """PyTorch RPC baseline, in the consumer: touch the tensor."""
    _touch(t.numpy())


def _rpc_echo(t):
    _touch(t.numpy())
    return t


def _rpc_done():
    _RPC_DONE.set()


def _rpc_missing():
    try:
        import torch.distributed.rpc as rpc
    except ImportError as e:
        return f"torch is not importable ({e})"
    if not rpc.is_available():
        return "this torch has no RPC"
    return None


def _gloo_missing():
    try:
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not importable ({e})"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch has no gloo backend"
    return None


# -- the two processes --------------------------------------------------------


class _Side:
    """One process's transports (producer: rank 0, consumer: rank 1)."""

    def __init__(self, rank, cfg, conn):
        from rdma_device.endpoint import Endpoint

        self.rank, self.cfg, self.conn = rank, cfg, conn
        me, other = ("p", "c") if rank == 0 else ("c", "p")
        self.peer = other
        self.ep = Endpoint(me, cfg["addr"][me])
        self.ep.add_peer(other, cfg["addr"][other])
        self.data_r, self.data_w = cfg["pipes"][rank]  # this side reads data_r, writes data_w
        from multiprocessing import shared_memory

        self.block = cfg["block"]
        self.shm = shared_memory.SharedMemory(name=cfg["shm"])
        # The parent created it and unlinks it (spawned children share its
        # resource tracker, so opening it here registers nothing new).
        self.blocks = [np.ndarray((self.block,), np.uint8, self.shm.buf, offset=i * self.block)
                       for i in range(2)]
        self.gloo = None
        if GLOO in cfg["baselines"]:
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['gloo_port']}",
                                    rank=rank, world_size=2)
            self.torch, self.dist = torch, dist
            self.gloo = torch.empty(self.block, dtype=torch.uint8)
        self.rpc = None
        if TENSORPIPE in cfg["baselines"]:
            import torch
            import torch.distributed.rpc as rpc

            opts = rpc.TensorPipeRpcBackendOptions(
                init_method=f"tcp://127.0.0.1:{cfg['rpc_port']}", num_worker_threads=8,
                rpc_timeout=WAIT)
            rpc.init_rpc(me, rank=rank, world_size=2, rpc_backend_options=opts)
            self.torch, self.rpc = torch, rpc

    def place(self):
        if self.rank == 1:
            for size in self.cfg["sizes"]:
                self.ep.place("p", f"s{size}", (size,), np.uint8)
            for size in PING_SIZES:
                self.ep.place("p", f"ping{size}", (size,), np.uint8)
        else:
            self.ep.place("c", "done", (1,), np.uint8)
            for size in PING_SIZES:
                self.ep.place("c", f"pong{size}", (size,), np.uint8)

    # Stream blocks. Producer: returns the block's wall time.

    def stream(self, baseline, size, n, src):
        return getattr(self, f"_stream_{baseline.split('+')[0]}")(size, n, src)

    def _stream_rdma_device(self, size, n, src):
        if self.rank == 0:
            t0 = time.perf_counter()
            futs = [self.ep.send("c", f"s{size}", src) for _ in range(n)]
            self.ep.recv("c", "done", timeout=WAIT).release()
            for f in futs:
                f.result(WAIT)
            return time.perf_counter() - t0
        for _ in range(n):
            with self.ep.recv("p", f"s{size}", timeout=WAIT) as r:
                _touch(r.array)
        self.ep.send("p", "done", np.ones(1, np.uint8)).result(WAIT)

    def _stream_shared_memory(self, size, n, src):
        if self.rank == 0:
            t0 = time.perf_counter()
            in_flight = 0
            for i in range(n):
                if in_flight == 2:
                    self.data_r.recv_bytes()  # a block is free again
                    in_flight -= 1
                np.copyto(self.blocks[i % 2][:size], src)
                self.data_w.send_bytes(b"f")
                in_flight += 1
            for _ in range(in_flight):
                self.data_r.recv_bytes()
            return time.perf_counter() - t0
        for i in range(n):
            self.data_r.recv_bytes()
            _touch(self.blocks[i % 2][:size])
            self.data_w.send_bytes(b"e")

    def _stream_tensorpipe_rpc(self, size, n, src):
        if self.rank == 0:
            t = self.torch.from_numpy(src)
            t0 = time.perf_counter()
            futs = [self.rpc.rpc_async("c", _rpc_take, args=(t,)) for _ in range(n)]
            for f in futs:
                f.wait()
            elapsed = time.perf_counter() - t0
            self.rpc.rpc_sync("c", _rpc_done)
            return elapsed
        self._rpc_block_end()

    def _rpc_block_end(self):
        """Consumer: the producer's calls run on RPC threads; wait for the
        block's end."""
        if not _RPC_DONE.wait(WAIT):
            raise TimeoutError("the producer's RPC block did not end")
        _RPC_DONE.clear()

    def _stream_gloo(self, size, n, src):
        dist, torch = self.dist, self.torch
        if self.rank == 0:
            t = torch.from_numpy(src)
            done = torch.empty(1, dtype=torch.uint8)
            t0 = time.perf_counter()
            for _ in range(n):
                dist.send(t, dst=1)
            dist.recv(done, src=1)
            return time.perf_counter() - t0
        buf = self.gloo[:size]
        for _ in range(n):
            dist.recv(buf, src=0)
            _touch(buf.numpy())
        dist.send(torch.ones(1, dtype=torch.uint8), dst=0)

    # Ping-pong blocks. Producer: returns the median round trip.

    def ping(self, baseline, size, k, src):
        rtts = []
        if baseline == TENSORPIPE:
            if self.rank == 1:
                return self._rpc_block_end()
            t = self.torch.from_numpy(src)
            for _ in range(k):
                t0 = time.perf_counter()
                _touch(self.rpc.rpc_sync("c", _rpc_echo, args=(t,)).numpy())
                rtts.append(time.perf_counter() - t0)
            self.rpc.rpc_sync("c", _rpc_done)
            return statistics.median(rtts)
        for _ in range(k):
            t0 = time.perf_counter()
            if baseline == OURS:
                if self.rank == 0:
                    self.ep.send("c", f"ping{size}", src)
                    self.ep.recv("c", f"pong{size}", timeout=WAIT).release()
                else:
                    with self.ep.recv("p", f"ping{size}", timeout=WAIT) as r:
                        _touch(r.array)
                    self.ep.send("p", f"pong{size}", src)
            elif baseline == SHM:
                if self.rank == 0:
                    np.copyto(self.blocks[0][:size], src)
                    self.data_w.send_bytes(b"f")
                    self.data_r.recv_bytes()
                    _touch(self.blocks[1][:size])
                else:
                    self.data_r.recv_bytes()
                    _touch(self.blocks[0][:size])
                    np.copyto(self.blocks[1][:size], src)
                    self.data_w.send_bytes(b"f")
            elif baseline == GLOO:
                t, buf = self.torch.from_numpy(src), self.gloo[:size]
                if self.rank == 0:
                    self.dist.send(t, dst=1)
                    self.dist.recv(buf, src=1)
                else:
                    self.dist.recv(buf, src=0)
                    _touch(buf.numpy())
                    self.dist.send(t, dst=0)
            rtts.append(time.perf_counter() - t0)
        return statistics.median(rtts)


def _memcpy(dst, src, n):
    """The memcpy line: one thread copying ``src`` into a warm block, ``n``
    times, timed like a stream block."""
    t0 = time.perf_counter()
    for _ in range(n):
        np.copyto(dst, src)
    return time.perf_counter() - t0


def _schedule(cfg):
    """The blocks both processes run, in order: (kind, baseline, size, n)."""
    out = []
    bases = cfg["baselines"]
    for rep in range(cfg["reps"]):
        order = bases[rep % len(bases):] + bases[:rep % len(bases)]
        for size in PING_SIZES:
            out += [("ping", b, size, cfg["pings"]) for b in order]
        for size in cfg["sizes"]:
            out += [("stream", b, size, _count(size)) for b in order]
            out.append(("memcpy", "memcpy", size, _count(size)))  # producer only
    return out


def _side_main(rank, cfg, conn):
    try:
        side = _Side(rank, cfg, conn)
        conn.send("ready")
        if not conn.poll(WAIT):
            raise TimeoutError("no go from the parent")
        conn.recv()
        side.place()
        conn.send("placed")
        if not conn.poll(WAIT):
            raise TimeoutError("no start from the parent")
        conn.recv()
        src = {s: np.random.default_rng(s).integers(0, 256, s, dtype=np.uint8)
               for s in list(cfg["sizes"]) + list(PING_SIZES)}
        rows = []
        for kind, base, size, n in _schedule(cfg):
            c0 = time.process_time()
            if kind == "ping":
                value = side.ping(base, size, n, src[size])
            elif kind == "memcpy":
                value = _memcpy(side.blocks[0][:size], src[size], n) if rank == 0 else None
            else:
                value = side.stream(base, size, n, src[size])
            rows.append({"kind": kind, "baseline": base, "size": size, "n": n, "value": value,
                         "cpu": time.process_time() - c0})
        conn.send({"rows": rows, "stats": side.ep.stats()["counters"]})
        # Close once the other process is done too (a receiver still
        # claiming arrays from a closed endpoint fails them).
        conn.poll(WAIT) and conn.recv()
        side.ep.close()
        if side.gloo is not None:
            side.dist.destroy_process_group()
        if side.rpc is not None:
            side.rpc.shutdown()
        side.shm.close()
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def measure(cfg):
    """Runs the two processes; returns (rows of both, memcpy GB/s by size)."""
    from multiprocessing import shared_memory

    from rdma_device._cluster import free_ports

    ctx = mp.get_context("spawn")
    ports = free_ports(4)
    cfg = dict(cfg, addr={"p": f"127.0.0.1:{ports[0]}", "c": f"127.0.0.1:{ports[1]}"},
               gloo_port=ports[2], rpc_port=ports[3], block=max(list(cfg["sizes"]) + list(PING_SIZES)))
    shm = shared_memory.SharedMemory(create=True, size=2 * cfg["block"])
    p2c_r, p2c_w = ctx.Pipe(duplex=False)
    c2p_r, c2p_w = ctx.Pipe(duplex=False)
    cfg["shm"], cfg["pipes"] = shm.name, [(c2p_r, p2c_w), (p2c_r, c2p_w)]
    conns, procs = [], []
    try:
        for rank in (0, 1):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_side_main, args=(rank, cfg, child), daemon=True)
            p.start()
            conns.append(parent)
            procs.append(p)
        for step, reply in (("go", "placed"), ("start", None)):
            for c in conns:
                msg = _expect(c, WAIT) if step == "go" else None
                assert step != "go" or msg == "ready", msg
                c.send(step)
            if reply:
                for c in conns:
                    msg = _expect(c, WAIT)
                    assert msg == reply, msg
        out = [_expect(c, 1800) for c in conns]
        for c in conns:
            c.send("bye")
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        shm.close()
        shm.unlink()


def _expect(conn, timeout):
    if not conn.poll(timeout):
        raise TimeoutError(f"a benchmark process sent nothing for {timeout} s")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(f"benchmark process failed:\n{msg['error']}")
    return msg


def summarize(prod, cons):
    """JSON rows: one per (kind, size, baseline other than ours)."""
    by = {}
    memcpy = {}
    for a, b in zip(prod["rows"], cons["rows"]):
        if a["kind"] == "memcpy":
            memcpy.setdefault(a["size"], []).append(a["n"] * a["size"] / a["value"] / 1e9)
            continue
        key = (a["kind"], a["size"], a["baseline"])
        by.setdefault(key, []).append((a, b))
    rows = []
    kinds = sorted({k[:2] for k in by}, key=lambda k: (k[0] != "ping", k[1]))
    for kind, size in kinds:
        def stat(base):
            blocks = by[(kind, size, base)]
            if kind == "ping":
                lat = statistics.median(a["value"] for a, _ in blocks) / 2
                gbps = size / lat / 1e9
                cpu = statistics.median((a["cpu"] + b["cpu"]) / a["n"] for a, b in blocks)
                return gbps, {"latency_us": lat * 1e6, "cpu_us_per_roundtrip": cpu * 1e6}
            gbps = statistics.median(a["n"] * size / a["value"] / 1e9 for a, _ in blocks)
            cpu = statistics.median((a["cpu"] + b["cpu"]) / (a["n"] * size / 1e9)
                                    for a, b in blocks)
            return gbps, {"cpu_s_per_gb": cpu}
        ours, ours_x = stat(OURS)
        for base in sorted({k[2] for k in by if k[2] != OURS}):
            theirs, theirs_x = stat(base)
            row = {"kind": kind, "size": size, "baseline": base, "ours_gbps": ours,
                   "baseline_gbps": theirs, "ratio": ours / theirs}
            row.update({f"ours_{k}": v for k, v in ours_x.items()})
            row.update({f"baseline_{k}": v for k, v in theirs_x.items()})
            if kind == "stream":
                row["memcpy_gbps"] = statistics.median(memcpy[size])
            rows.append(row)
    return rows


def pybench(args):
    from rdma_device.bench.pybench_plot import plot, table

    sizes = ["4K", "1M"] if args.quick else args.sizes.split(",")
    cfg = {"sizes": [parse_size(s) for s in sizes], "reps": 2 if args.quick else args.reps,
           "pings": 20 if args.quick else args.pings, "baselines": [OURS, SHM]}
    why = "--no-gloo" if args.no_gloo else _gloo_missing()
    if why:
        print(f"gloo baseline SKIPPED: {why}", file=sys.stderr)
    else:
        cfg["baselines"].append(GLOO)
    why = _rpc_missing() if args.rpc else "not asked for (--rpc)"
    if why:
        print(f"PyTorch RPC baseline SKIPPED: {why}", file=sys.stderr)
    else:
        cfg["baselines"].append(TENSORPIPE)
    prod, cons = measure(cfg)
    rows = summarize(prod, cons)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(table(rows, cfg, prod["stats"], cons["stats"]))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {os.path.abspath(args.plot)}", file=sys.stderr)
    return rows
