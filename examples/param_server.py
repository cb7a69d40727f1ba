"""A parameter-server loop in NumPy between two processes, without
TensorFlow, over rdma_device.endpoint and over two stock ways to move
arrays between Python processes (multiprocessing.shared_memory with a
pipe for notifications, and a multiprocessing Pipe), interleaved.

Each step the "ps" process sends the weights (float32, --params of them)
to the "worker" process, which computes the gradient of a least-squares
loss on its batch and sends it back; the ps applies it (SGD). The same
arithmetic runs over every transport on its own copy of the model, so
their final weights must be bit-identical. Blocks of --block steps
alternate between the transports, their order rotating every round (the
first step of each block is not counted); the ps reports median step
times, the ratio of each baseline's step to ours (above 1: ours is
faster), and CPU per step (both processes, every thread).

    PYTHONPATH=python python examples/param_server.py [--params 4M] [--steps 60]

The baselines, each at its best shot, on the same threads as ours:

``shared_memory+pipe``  multiprocessing.shared_memory, created once with
                        one block for the weights and one for the
                        gradient. The ps copies the weights into their
                        block (the one copy any transport needs) and a
                        one-way pipe carries "the block is full"; the
                        worker computes the gradient reading the weights
                        in place from shared memory, copies the gradient
                        into its block and answers the same way; the ps
                        applies it reading it in place. In this lock-step
                        loop each "full" also says the other block is
                        free again (the worker answers only once it has
                        read the weights, the ps sends the next weights
                        only once it has applied the gradient), so no
                        separate "free" message is needed, and a second
                        block per direction would only add to what the
                        caches hold.
``pipe``                a multiprocessing Pipe: ``send_bytes`` of the
                        array's buffer (no pickling) and
                        ``recv_bytes_into`` a preallocated array.

``rdma_device`` sends into a slot the other side placed; the receiver
reads it in place (the worker computes the gradient from it, the ps
applies the gradient from it) and then releases it.
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import traceback

import numpy as np

WAIT = 120.0
OURS, SHM, PIPE = "rdma_device", "shared_memory+pipe", "pipe"
TRANSPORTS = (OURS, SHM, PIPE)
BASELINES = (SHM, PIPE)


def _schedule(steps, block):
    """(transport, counted) for every step, both sides alike: rounds of one
    block per transport, the order rotating every round; each block is an
    uncounted warm-up step and up to ``block`` counted ones."""
    sched, counted, r = [], dict.fromkeys(TRANSPORTS, 0), 0
    while min(counted.values()) < steps:
        k = r % len(TRANSPORTS)
        for t in TRANSPORTS[k:] + TRANSPORTS[:k]:
            m = min(block, steps - counted[t])
            if m:
                sched += [(t, False)] + [(t, True)] * m
                counted[t] += m
        r += 1
    return sched


class _Shm:
    """One process's view of the shared-memory baseline: the weights'
    block, the gradient's block, and its ends of the two notification
    pipes."""

    def __init__(self, cfg, ends):
        from multiprocessing import shared_memory

        n = cfg["params"]
        # The parent created the segment and unlinks it (spawned children
        # share its resource tracker, so opening it here registers nothing
        # new).
        self.seg = shared_memory.SharedMemory(name=cfg["shm"])
        self.weights = np.ndarray((n,), np.float32, self.seg.buf)
        self.grad = np.ndarray((n,), np.float32, self.seg.buf, offset=4 * n)
        self.rd, self.wr = ends  # reads the other side's notices, writes its own

    def close(self):
        del self.weights, self.grad
        self.seg.close()


def _data(params, batch):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((batch, params), dtype=np.float32)
    y = rng.standard_normal(batch, dtype=np.float32)
    return x, y


def _grad(x, y, w, out):
    """Least-squares gradient x.T @ (x @ w - y) / batch into ``out``."""
    r = x @ w - y
    np.matmul(r / np.float32(len(y)), x, out=out)


def ps_main(cfg, conn, pipe, notes):
    try:
        from rdma_device.endpoint import Endpoint

        shm = _Shm(cfg, notes)
        n, lr = cfg["params"], np.float32(cfg["lr"])
        w = {t: np.zeros(n, np.float32) for t in TRANSPORTS}
        gbuf = np.empty(n, np.float32)
        times = {t: [] for t in TRANSPORTS}
        cpu = {t: [] for t in TRANSPORTS}
        with Endpoint("ps", cfg["addr"]["ps"]) as ep:
            ep.add_peer("worker", cfg["addr"]["worker"])
            conn.send("ready")
            conn.poll(WAIT) and conn.recv()
            ep.place("worker", "grad", (n,), np.float32)
            conn.send("placed")
            conn.poll(WAIT) and conn.recv()
            for t, counted in _schedule(cfg["steps"], cfg["block"]):
                t0, c0 = time.perf_counter(), time.process_time()
                if t == OURS:
                    sent = ep.send("worker", "weights", w[t])
                    with ep.recv("worker", "grad", timeout=WAIT) as g:
                        sent.result(WAIT)  # w may change only once it is written
                        w[t] -= lr * g.array
                elif t == SHM:
                    np.copyto(shm.weights, w[t])
                    shm.wr.send_bytes(b"f")  # the weights' block is full
                    shm.rd.recv_bytes()  # the gradient's block is full
                    w[t] -= lr * shm.grad
                else:
                    pipe.send_bytes(w[t])
                    if not pipe.poll(WAIT):
                        raise TimeoutError("no gradient from the worker")
                    pipe.recv_bytes_into(gbuf)
                    w[t] -= lr * gbuf
                if counted:
                    times[t].append(time.perf_counter() - t0)
                    cpu[t].append(time.process_time() - c0)
            conn.send({"times": times, "cpu": cpu, "stats": ep.stats()["counters"],
                       "identical": {t: w[t].tobytes() == w[OURS].tobytes() for t in BASELINES},
                       "weights_norm": float(np.linalg.norm(w[OURS]))})
            conn.poll(WAIT) and conn.recv()  # close once the peer is done too
        shm.close()
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def worker_main(cfg, conn, pipe, notes):
    try:
        from rdma_device.endpoint import Endpoint

        shm = _Shm(cfg, notes)
        n = cfg["params"]
        x, y = _data(n, cfg["batch"])
        wbuf = np.empty(n, np.float32)
        g = np.empty(n, np.float32)
        cpu = {t: [] for t in TRANSPORTS}
        with Endpoint("worker", cfg["addr"]["worker"]) as ep:
            ep.add_peer("ps", cfg["addr"]["ps"])
            conn.send("ready")
            conn.poll(WAIT) and conn.recv()
            ep.place("ps", "weights", (n,), np.float32)
            conn.send("placed")
            conn.poll(WAIT) and conn.recv()
            for t, counted in _schedule(cfg["steps"], cfg["block"]):
                c0 = time.process_time()
                if t == OURS:
                    with ep.recv("ps", "weights", timeout=WAIT) as w:
                        _grad(x, y, w.array, g)  # reads the weights in place
                    ep.send("ps", "grad", g).result(WAIT)
                elif t == SHM:
                    shm.rd.recv_bytes()  # the weights' block is full
                    _grad(x, y, shm.weights, g)  # reads the weights in place
                    np.copyto(shm.grad, g)
                    shm.wr.send_bytes(b"f")  # the gradient's block is full
                else:
                    if not pipe.poll(WAIT):
                        raise TimeoutError("no weights from the ps")
                    pipe.recv_bytes_into(wbuf)
                    _grad(x, y, wbuf, g)
                    pipe.send_bytes(g)
                if counted:
                    cpu[t].append(time.process_time() - c0)
            conn.send({"cpu": cpu})
            # A receiver still claiming arrays from a closed endpoint fails
            # them: close once the ps has its last gradient.
            conn.poll(WAIT) and conn.recv()
        shm.close()
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def _expect(conn, timeout=WAIT):
    if not conn.poll(timeout):
        raise TimeoutError(f"no message within {timeout} s")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(msg["error"])
    return msg


def main(argv=None):
    from rdma_device._units import parse_size

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="4M",
                    help="float32 weights (K/M suffix; default 4M = 16 MiB); several, comma-separated, "
                         "run one after the other")
    ap.add_argument("--batch", type=int, default=4, help="examples per gradient")
    ap.add_argument("--steps", type=int, default=60, help="counted steps per transport")
    ap.add_argument("--block", type=int, default=5, help="steps per block before switching")
    ap.add_argument("--lr", type=float, default=1e-7)
    ap.add_argument("--json", action="store_true",
                    help="also print one JSON row per baseline (for `python -m rdma_device.bench report`)")
    args = ap.parse_args(argv)
    ok = True
    for params in args.params.split(","):
        ok = run(args, parse_size(params.strip())) and ok
    return 0 if ok else 1


def run(args, params):
    """One comparison with ``params`` weights; True when the weights of
    every transport came out bit-identical."""
    from multiprocessing import shared_memory

    from rdma_device._cluster import free_ports
    from rdma_device._units import human_bytes

    ports = free_ports(2)
    cfg = {"params": params, "batch": args.batch, "steps": args.steps,
           "block": args.block, "lr": args.lr,
           "addr": {"ps": f"127.0.0.1:{ports[0]}", "worker": f"127.0.0.1:{ports[1]}"}}
    ctx = mp.get_context("spawn")
    seg = shared_memory.SharedMemory(create=True, size=2 * 4 * cfg["params"])
    cfg["shm"] = seg.name
    a, b = ctx.Pipe()  # the Pipe baseline: ps end, worker end
    to_wk_r, to_wk_w = ctx.Pipe(duplex=False)  # shared_memory+pipe notices, ps -> worker
    to_ps_r, to_ps_w = ctx.Pipe(duplex=False)  # and worker -> ps
    ends = ((ps_main, a, (to_ps_r, to_wk_w)), (worker_main, b, (to_wk_r, to_ps_w)))
    conns, procs = [], []
    try:
        for fn, end, notes in ends:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=fn, args=(cfg, child, end, notes), daemon=True)
            p.start()
            conns.append(parent)
            procs.append(p)
        # Each child has its own copies now: a process that dies closes the
        # last writer of what its peer reads, which then fails, not hangs.
        for c in (a, b, to_wk_r, to_wk_w, to_ps_r, to_ps_w):
            c.close()
        for want, then in (("ready", "go"), ("placed", "start")):
            for c in conns:
                assert _expect(c) == want
            for c in conns:
                c.send(then)
        ps, wk = _expect(conns[0], 3600), _expect(conns[1], 3600)
        for c in conns:
            c.send("bye")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        seg.close()
        seg.unlink()

    print(f"parameter server, 2 processes: {cfg['params']} float32 weights "
          f"({human_bytes(cfg['params'] * 4)}) out, "
          f"the same-sized gradient back, batch {cfg['batch']}; {cfg['steps']} counted steps per "
          f"transport in blocks of {cfg['block']}, interleaved")
    med = {t: statistics.median(ps["times"][t]) for t in TRANSPORTS}
    cpu = {t: statistics.median(a + b for a, b in zip(ps["cpu"][t], wk["cpu"][t])) for t in TRANSPORTS}
    for t in TRANSPORTS:
        print(f"  {t:>18}: median step {med[t] * 1e3:8.3f} ms, CPU {cpu[t] * 1e3:8.3f} ms/step "
              f"(both processes)")
    for t in BASELINES:
        print(f"  ratio ({t} step / rdma_device step): {med[t] / med[OURS]:.2f}")
    same = all(ps["identical"].values())
    print(f"  final weights bit-identical across transports: {same} ("
          + ", ".join(f"rdma_device = {t}: {ps['identical'][t]}" for t in BASELINES)
          + f"; |w| = {ps['weights_norm']:.6f})")
    s = ps["stats"]
    print(f"  ps transport counters: pushed {s['tensors_pushed']} / {s['bytes_pushed']} bytes, "
          f"received {s['tensors_received']} / {s['bytes_received']} bytes")
    if args.json:
        import json

        for t in BASELINES:
            # ratio: the baseline's step over ours (above 1: ours faster).
            print(json.dumps({"params": cfg["params"], "bytes": cfg["params"] * 4, "baseline": t,
                              "ours_step_ms": med[OURS] * 1e3, "baseline_step_ms": med[t] * 1e3,
                              "ratio": med[t] / med[OURS], "ours_cpu_ms": cpu[OURS] * 1e3,
                              "baseline_cpu_ms": cpu[t] * 1e3, "identical": ps["identical"][t],
                              "pushed": s["tensors_pushed"], "received": s["tensors_received"]}))
    return same


if __name__ == "__main__":
    sys.exit(main())
