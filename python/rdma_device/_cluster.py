"""A local multi-task TensorFlow cluster: one subprocess per task, on free
loopback ports, for benchmarks and demos.

Each task process creates its server (loading the plugin first when the
protocol needs it), prints ``READY`` and then answers commands on stdin:
``stats`` prints the transport's counters as one JSON line, ``trace_on`` /
``trace_off`` / ``trace_take`` record and return the transport's timeline
(Chrome trace events); end of input stops the task.
"""

import json
import os
import socket
import subprocess
import sys
import time

from rdma_device import _quiet

_TASK_MAIN = r"""
import json, os, sys
cluster, job, index, protocol = json.loads(sys.argv[1])
import tensorflow as tf
if protocol != "grpc":
    import rdma_device
    rdma_device.load()
server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job,
                              task_index=index, protocol=protocol, start=True)
print("READY", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "stats":
        if protocol == "grpc":
            print("{}", flush=True)
        else:
            import rdma_device
            print(json.dumps(rdma_device.stats()), flush=True)
    elif cmd == "reset":
        if protocol != "grpc":
            import rdma_device
            rdma_device.reset_stats()
        print("{}", flush=True)
    elif cmd in ("trace_on", "trace_off"):
        if protocol != "grpc":
            import rdma_device
            rdma_device.trace_enable(cmd == "trace_on")
            if cmd == "trace_on":
                rdma_device.trace_take()  # start from an empty buffer
        print("{}", flush=True)
    elif cmd.startswith("profile_start "):
        tf.profiler.experimental.start(cmd.split(" ", 1)[1] + f"/{job}-{index}")
        print("{}", flush=True)
    elif cmd == "profile_stop":
        tf.profiler.experimental.stop()
        print("{}", flush=True)
    elif cmd == "trace_take":
        events = []
        if protocol != "grpc":
            import rdma_device
            events = rdma_device.trace_take(f"/job:{job}/task:{index}")
        print(json.dumps(events), flush=True)
os._exit(0)
"""


def free_ports(n):
    """n distinct free loopback ports (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def stop_tasks(procs, logs):
    """End task processes that serve commands on stdin: close their stdin
    (they exit), kill those still running after 10 s, close their logs."""
    procs = list(procs)
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for f in logs:
        f.close()


def timed_block(session, fetch, clusters, steps, times):
    """One benchmark block: ``fetch`` once untimed (that step absorbs the
    switch from whatever ran before), then ``steps`` times, each step's
    wall time in ms appended to ``times``. Returns the CPU seconds that
    ``clusters``' tasks and this process used over the timed steps."""
    session.run(fetch)
    c0 = cpu_seconds(clusters)
    for _ in range(steps):
        t = time.perf_counter()
        session.run(fetch)
        times.append((time.perf_counter() - t) * 1e3)
    return cpu_seconds(clusters) - c0


def cpu_seconds(clusters):
    """CPU seconds used so far by every thread of every task process of
    ``clusters`` (``/proc/PID/task/*/schedstat``, nanoseconds) plus this
    client process."""
    total = time.process_time()
    for c in clusters:
        for p in c.procs.values():
            base = f"/proc/{p.pid}/task"
            try:
                tids = os.listdir(base)
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"{base}/{tid}/schedstat") as f:
                        total += int(f.read().split()[0]) / 1e9
                except (OSError, IndexError, ValueError):
                    pass
    return total


class LocalCluster:
    """Tasks ``jobs`` (e.g. {"worker": 2}) under ``protocol``, as processes."""

    def __init__(self, protocol, jobs, env=None, timeout=120, log_dir=None, name=None):
        """``log_dir``: write each task's stderr to ``log_dir/NAME-JOB-I.log``
        instead of this process's stderr."""
        self.protocol = protocol
        names = [(job, i) for job, n in jobs.items() for i in range(n)]
        ports = free_ports(len(names))
        self.spec = {}
        for (job, i), port in zip(names, ports):
            self.spec.setdefault(job, []).append(f"localhost:{port}")
        self.procs = {}
        self._env = dict(os.environ)
        if not _quiet.verbose():
            self._env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self._env.update(env or {})
        self._log_dir = log_dir
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        self._name = name
        self._logs = []
        for job, i in names:
            self.procs[(job, i)] = self._spawn(job, i)
        deadline = time.time() + timeout
        for key in self.procs:
            self._wait_ready(key, deadline)

    def _spawn(self, job, i):
        arg = json.dumps([self.spec, job, i, self.protocol])
        err = None
        if self._log_dir:
            # Appended to: a restarted task's log follows its first life's.
            err = open(os.path.join(self._log_dir, f"{self._name or self.protocol}-{job}-{i}.log"), "a")
            self._logs.append(err)
        return subprocess.Popen([sys.executable, "-c", _TASK_MAIN, arg], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=self._env)

    def _wait_ready(self, key, deadline):
        # A task that dies before READY closes its stdout: readline returns.
        p = self.procs[key]
        line = p.stdout.readline()
        if line.strip() != "READY":
            self.close()
            raise RuntimeError(f"task {key} of the {self.protocol} cluster did not start (exit {p.poll()})")
        if time.time() > deadline:
            self.close()
            raise RuntimeError("cluster start timed out")

    def kill(self, job, index, sig=9):
        """Kill one task (SIGKILL by default) and reap it."""
        p = self.procs[(job, index)]
        p.send_signal(sig)
        p.wait(timeout=30)

    def restart(self, job, index, timeout=120):
        """Start a killed task again, on the same address."""
        self.procs[(job, index)] = self._spawn(job, index)
        self._wait_ready((job, index), time.time() + timeout)

    def pid(self, job, index):
        return self.procs[(job, index)].pid

    def rss_mb(self, job, index, field="VmRSS"):
        """Resident memory of one task's process in MiB: VmRSS (all),
        RssAnon (private memory: heap, stacks) or RssShmem (shared memory,
        such as receive arenas)."""
        with open(f"/proc/{self.pid(job, index)}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
        return 0.0

    def target(self, job="worker", index=0):
        return "grpc://" + self.spec[job][index]

    def device(self, job, index):
        return f"/job:{job}/replica:0/task:{index}"

    def task_stats(self, job, index):
        """Transport counters of one task."""
        p = self.procs[(job, index)]
        p.stdin.write("stats\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline() or "{}")

    def _ask(self, cmd):
        out = {}
        for key, p in self.procs.items():
            p.stdin.write(cmd + "\n")
            p.stdin.flush()
            out[f"/job:{key[0]}/task:{key[1]}"] = json.loads(p.stdout.readline() or "{}")
        return out

    def stats(self):
        """Transport counters of every task (empty for stock grpc)."""
        return self._ask("stats")

    def reset_stats(self):
        self._ask("reset")

    def trace(self, on):
        """Start (True, each task from an empty buffer) or stop recording the
        transport's timeline in every task."""
        self._ask("trace_on" if on else "trace_off")

    def trace_take(self):
        """Every task's recorded spans as one list of Chrome trace events."""
        return [e for events in self._ask("trace_take").values() for e in events]

    def close(self):
        stop_tasks(self.procs.values(), getattr(self, "_logs", []))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
