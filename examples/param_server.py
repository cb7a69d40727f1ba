"""A parameter-server loop in NumPy between two processes, without
TensorFlow, over rdma_device.endpoint and over the stock way to move
arrays between Python processes (a multiprocessing Pipe), interleaved.

Each step the "ps" process sends the weights (float32, --params of them)
to the "worker" process, which computes the gradient of a least-squares
loss on its batch and sends it back; the ps applies it (SGD). The same
arithmetic runs over both transports on two copies of the model, so their
final weights must be bit-identical. Blocks of --block steps alternate
between the transports (the first step of each block is not counted);
the ps reports median step times, the ratio, and CPU per step (both
processes, every thread).

    PYTHONPATH=python python examples/param_server.py [--params 4M] [--steps 60]

Pipe, its best shot: ``send_bytes`` of the array's buffer (no pickling)
and ``recv_bytes_into`` a preallocated array.
"""

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import traceback

import numpy as np

WAIT = 120.0
TRANSPORTS = ("rdma_device", "pipe")


def _schedule(steps, block):
    """(transport, counted) for every step, both sides alike."""
    out = []
    while len(out) < 2 * steps + 2 * (steps // block + 1):
        for t in TRANSPORTS:
            out += [(t, i > 0) for i in range(block + 1)]
    counted = {t: 0 for t in TRANSPORTS}
    sched = []
    for t, c in out:
        if counted[t] < steps:
            sched.append((t, c))
            counted[t] += c
    return sched


def _data(params, batch):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((batch, params), dtype=np.float32)
    y = rng.standard_normal(batch, dtype=np.float32)
    return x, y


def _grad(x, y, w, out):
    """Least-squares gradient x.T @ (x @ w - y) / batch into ``out``."""
    r = x @ w - y
    np.matmul(r / np.float32(len(y)), x, out=out)


def ps_main(cfg, conn, pipe):
    try:
        from rdma_device.endpoint import Endpoint

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
                if t == "rdma_device":
                    sent = ep.send("worker", "weights", w[t])
                    with ep.recv("worker", "grad", timeout=WAIT) as g:
                        sent.result(WAIT)  # w may change only once it is written
                        w[t] -= lr * g.array
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
                       "identical": w["rdma_device"].tobytes() == w["pipe"].tobytes(),
                       "weights_norm": float(np.linalg.norm(w["pipe"]))})
            conn.poll(WAIT) and conn.recv()  # close once the peer is done too
    except BaseException:
        conn.send({"error": traceback.format_exc()})


def worker_main(cfg, conn, pipe):
    try:
        from rdma_device.endpoint import Endpoint

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
                if t == "rdma_device":
                    with ep.recv("ps", "weights", timeout=WAIT) as w:
                        _grad(x, y, w.array, g)  # reads the weights in place
                    ep.send("ps", "grad", g).result(WAIT)
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
    from rdma_device._cluster import free_ports
    from rdma_device._units import parse_size

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="4M", help="float32 weights (K/M suffix; default 4M = 16 MiB)")
    ap.add_argument("--batch", type=int, default=4, help="examples per gradient")
    ap.add_argument("--steps", type=int, default=60, help="counted steps per transport")
    ap.add_argument("--block", type=int, default=5, help="steps per block before switching")
    ap.add_argument("--lr", type=float, default=1e-7)
    args = ap.parse_args(argv)
    ports = free_ports(2)
    cfg = {"params": parse_size(args.params), "batch": args.batch, "steps": args.steps,
           "block": args.block, "lr": args.lr,
           "addr": {"ps": f"127.0.0.1:{ports[0]}", "worker": f"127.0.0.1:{ports[1]}"}}
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()  # the stock transport: ps end, worker end
    conns, procs = [], []
    for fn, end in ((ps_main, a), (worker_main, b)):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=fn, args=(cfg, child, end), daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    try:
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
    from rdma_device._units import human_bytes

    print(f"parameter server, 2 processes: {cfg['params']} float32 weights "
          f"({human_bytes(cfg['params'] * 4)}) out, "
          f"the same-sized gradient back, batch {cfg['batch']}; {cfg['steps']} counted steps per "
          f"transport in blocks of {cfg['block']}, interleaved")
    med = {t: statistics.median(ps["times"][t]) for t in TRANSPORTS}
    for t in TRANSPORTS:
        c = statistics.median(a + b for a, b in zip(ps["cpu"][t], wk["cpu"][t]))
        print(f"  {t:>12}: median step {med[t] * 1e3:8.2f} ms, CPU {c * 1e3:8.2f} ms/step "
              f"(both processes)")
    print(f"  ratio (pipe step / rdma_device step): {med['pipe'] / med['rdma_device']:.2f}")
    print(f"  final weights bit-identical across transports: {ps['identical']} "
          f"(|w| = {ps['weights_norm']:.6f})")
    s = ps["stats"]
    print(f"  ps transport counters: pushed {s['tensors_pushed']} / {s['bytes_pushed']} bytes, "
          f"received {s['tensors_received']} / {s['bytes_received']} bytes")
    return 0 if ps["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
