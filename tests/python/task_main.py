"""Entry point of one cluster task (a subprocess started by harness.Task).

argv[1] is a JSON spec: {"role", "cluster", "job", "task", "protocol", ...}.
Roles: "server" runs a tf.distribute.Server until stdin closes; the others
run a client scenario from scenarios.py and print RESULT <json>.
"""

import json
import os
import sys


def say(prefix, payload=None):
    line = prefix if payload is None else f"{prefix} {json.dumps(payload)}"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def serve_commands(server=None, spec=None):
    """Answers stdin commands until EOF, then exits without TF teardown.

    "run" (server role only) runs a workload of replicas.py on this task's
    own server and replies with its result, or {"error": ...}."""
    import faulthandler
    import signal

    # The tests send SIGUSR1 to a task that misses a deadline: its Python
    # stacks go to its log before it is killed.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rdma_device = None
    if spec is None or spec.get("protocol") != "grpc":
        import rdma_device

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd["cmd"] == "stats":
            say("REPLY", rdma_device.stats() if rdma_device else None)
        elif cmd["cmd"] == "run" and server is not None:
            import threading

            import replicas

            def run(cmd=cmd):
                try:
                    say("REPLY", getattr(replicas, cmd["workload"])(server, spec, cmd["args"]))
                except Exception as e:  # the test reports it
                    say("REPLY", {"error": f"{type(e).__name__}: {e}"})

            threading.Thread(target=run, daemon=True).start()
        elif cmd["cmd"] == "config":
            say("REPLY", rdma_device.config())
        else:
            say("REPLY", {"error": f"unknown command {cmd['cmd']}"})
    sys.stdout.flush()
    # TF servers cannot be shut down cleanly; skip interpreter teardown.
    os._exit(0)


def main():
    spec = json.loads(sys.argv[1])
    import tensorflow as tf

    if spec["protocol"] != "grpc":
        import rdma_device

        rdma_device.load()
    role = spec["role"]
    if role == "server":
        # "cpus": this many CPU devices on the task (/device:CPU:0, 1, ...).
        config = tf.compat.v1.ConfigProto(device_count={"CPU": spec["cpus"]}) if "cpus" in spec else None
        server = tf.distribute.Server(
            tf.train.ClusterSpec(spec["cluster"]), job_name=spec["job"],
            task_index=spec["task"], protocol=spec["protocol"], config=config, start=True)
        say("READY")
        # Never returns; `server` stays referenced (Server.__del__ stops it).
        serve_commands(server, spec)
    else:
        import importlib

        module, _, name = role.rpartition(".")
        scenario = getattr(importlib.import_module(module or "scenarios"), name)
        result = scenario(spec, ready=lambda: say("READY"))
        say("RESULT", result)
        serve_commands(spec=spec)


if __name__ == "__main__":
    main()
