"""Multi-process TensorFlow clusters on free loopback ports.

Each task is a subprocess running ``task_main.py``. It prints one line
``READY`` once its server listens, answers commands written to its stdin
(one JSON object per line) with ``REPLY <json>`` lines, and prints
``RESULT <json>`` when a client scenario finishes. Readiness is a line read
from a pipe, never a sleep.
"""

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from rdma_device._cluster import free_ports  # noqa: F401  (the package's helper; tests use it via harness)

HERE = os.path.dirname(os.path.abspath(__file__))
TASK_MAIN = os.path.join(HERE, "task_main.py")
PROTOCOL_RDMA = "grpc+rdma_device"
PROTOCOL_GRPC = "grpc"

# Seconds a task may take to import TensorFlow and start its server (two
# busy cores, several tasks starting at once).
START_TIMEOUT = 120




def make_cluster(jobs):
    """{"worker": 2, "ps": 1} -> {"worker": ["127.0.0.1:p", ...], ...}."""
    ports = iter(free_ports(sum(jobs.values())))
    return {job: [f"127.0.0.1:{next(ports)}" for _ in range(n)]
            for job, n in jobs.items()}


def task_env(extra=None):
    env = dict(os.environ)
    import rdma_device  # the copy the tests import is the one tasks use

    pkg_parent = os.path.dirname(os.path.dirname(rdma_device.__file__))
    env["PYTHONPATH"] = os.pathsep.join(
        [pkg_parent, HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = "-1"
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


class Task:
    """One subprocess running task_main.py."""

    def __init__(self, spec, log_dir, env=None, name=None):
        self.spec = spec
        self.name = name or f"{spec['role']}-{spec.get('job')}-{spec.get('task')}"
        self.log_path = os.path.join(log_dir, f"{self.name}.{os.getpid()}.{id(self)}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, TASK_MAIN, json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=task_env(env), text=True, bufsize=1)
        self._lines = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def expect(self, prefix, timeout):
        """Waits for a stdout line starting with prefix; returns its JSON."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no {prefix} within {timeout}s\n{self.log_tail()}")
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(
                    f"{self.name} exited (rc={self.proc.wait()}) before {prefix}\n{self.log_tail()}")
            if line.startswith(prefix):
                rest = line[len(prefix):].strip()
                return json.loads(rest) if rest else None

    def wait_ready(self, timeout=START_TIMEOUT):
        return self.expect("READY", timeout)

    def result(self, timeout):
        return self.expect("RESULT", timeout)

    def send(self, cmd, **kw):
        """Writes a command; its REPLY is read later with expect()."""
        self.proc.stdin.write(json.dumps(dict(cmd=cmd, **kw)) + "\n")
        self.proc.stdin.flush()

    def command(self, cmd, timeout=60, **kw):
        self.send(cmd, **kw)
        return self.expect("REPLY", timeout)

    def dump_stacks(self):
        """Every thread's stack (native, with gdb; Python, by SIGUSR1 to
        faulthandler) into the task's log; returns the log's tail."""
        if self.proc.poll() is not None:
            return self.log_tail()
        try:
            self.proc.send_signal(signal.SIGUSR1)
        except OSError:
            pass
        try:
            out = subprocess.run(
                ["gdb", "-p", str(self.proc.pid), "-batch", "-ex", "thread apply all bt 25"],
                capture_output=True, text=True, timeout=60).stdout
            self._log.write("\n=== native stacks (gdb) ===\n" + out)
        except (OSError, subprocess.TimeoutExpired) as e:
            self._log.write(f"\n=== no native stacks: {e} ===\n")
        time.sleep(0.5)
        return self.log_tail(400)

    def stats(self):
        return self.command("stats")

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait()

    def close(self, timeout=20):
        """Asks the task to exit (stdin EOF); kills it if it does not."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def log_tail(self, n=60):
        self._log.flush()
        with open(self.log_path) as f:
            lines = f.readlines()
        return "".join(lines[-n:])


def replies_within(tasks, deadline_s, everyone, what):
    """Each task's next REPLY, all within deadline_s of this call; when one
    misses it, fails the test ("<what> missed its deadline (a hang)") with
    the native and Python stacks of `everyone`."""
    deadline = time.monotonic() + deadline_s
    replies = []
    try:
        for t in tasks:
            replies.append(t.expect("REPLY", max(1.0, deadline - time.monotonic())))
    except TimeoutError:
        stacks = "\n\n".join(f"##### {t.name}\n{t.dump_stacks()}" for t in everyone)
        pytest.fail(f"{what} missed its {deadline_s} s deadline (a hang)\n{stacks}")
    return replies


def build_preload(tmp_path_factory, name, what, libs=()):
    """Compiles <name>/<name>.c beside this file into lib<name>.so in a new
    temporary directory, for LD_PRELOAD; returns its path. Fails the test,
    naming `what`, where there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail(f"no C compiler (cc) to build {what}")
    out = str(tmp_path_factory.mktemp(name) / f"lib{name}.so")
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", out,
                    os.path.join(HERE, name, f"{name}.c"), *libs], check=True, timeout=120)
    return out


def build_preload_cxx(tmp_path_factory, name, what):
    """As build_preload, for C++ against TensorFlow's headers: compiles
    <name>/<name>.cc beside this file into lib<name>.so with the compile
    flags the plugin's shim was built with (its build_info.json: the C++
    ABI, the standard, Eigen's alignment), TensorFlow's headers found
    without importing it. Links nothing of TensorFlow's: the library may
    call only what TensorFlow's headers define inline."""
    import importlib.util

    import rdma_device

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.fail(f"no C++ compiler (c++) to build {what}")
    with open(os.path.join(rdma_device.lib_dir(), "build_info.json")) as f:
        flags = [f for f in json.load(f)["compile_flags"].split("|") if f and not f.startswith("-I")]
    tf_dir = importlib.util.find_spec("tensorflow").submodule_search_locations[0]
    out = str(tmp_path_factory.mktemp(name) / f"lib{name}.so")
    subprocess.run([cxx, "-O1", "-Wall", "-Werror", "-shared", "-fPIC", *flags, "-DNDEBUG",
                    "-isystem", os.path.join(tf_dir, "include"), "-o", out,
                    os.path.join(HERE, name, f"{name}.cc")], check=True, timeout=300)
    return out


def start_tasks(specs, log_dir, env=None, timeout=START_TIMEOUT):
    """Starts every spec, then waits until all are READY (each within
    `timeout` seconds of the wait for it)."""
    tasks = [Task(s, log_dir, env) for s in specs]
    try:
        for t in tasks:
            t.wait_ready(timeout)
    except BaseException:
        for t in tasks:
            t.kill()
            t.close()
        raise
    return tasks
