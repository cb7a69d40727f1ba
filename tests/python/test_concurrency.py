"""Concurrency that real jobs bring, repeated under deadlines.

Every worker process is its own client (between-graph replication): several
masters register graphs on one ps at once and step at the same time, with
more concurrent registrations than the ps has compute-pool threads on this
machine. Each scenario runs ROUNDS rounds in a row on one cluster (every
round builds new graphs, so registration happens every round), under stock
"grpc" and under "grpc+rdma_device" in strict mode, and must fetch
bit-identical values. A round that misses its deadline fails the test with
every task's native and Python stacks (a hang is a failure, never a skip).
"""

import time

import pytest

import harness

ROUNDS = 10
ROUND_DEADLINE_S = 90
STRICT = {"RDMA_DEVICE_STRICT": "1"}


class Replicas:
    """A ps/worker cluster whose workers run replicas.py workloads."""

    def __init__(self, jobs, log_dir, protocol, env=None, ps_protocol=None,
                 start_timeout=harness.START_TIMEOUT):
        self.cluster = harness.make_cluster(jobs)
        specs = []
        for job, n in jobs.items():
            for task in range(n):
                proto = ps_protocol if (job == "ps" and ps_protocol) else protocol
                specs.append(dict(role="server", cluster=self.cluster, job=job, task=task,
                                  protocol=proto))
        self.tasks = harness.start_tasks(specs, log_dir, env, start_timeout)
        self.workers = [t for t, s in zip(self.tasks, specs) if s["job"] == "worker"]
        self.ps = [t for t, s in zip(self.tasks, specs) if s["job"] == "ps"]

    def round(self, workload, args, workers=None, deadline_s=ROUND_DEADLINE_S):
        """Runs `workload` on the given workers at once; their replies."""
        workers = self.workers if workers is None else workers
        for w in workers:
            w.send("run", workload=workload, args=args)
        replies = harness.replies_within(workers, deadline_s, self.tasks,
                                         f"{workload} round {args.get('round')}")
        for w, r in zip(workers, replies):
            assert "error" not in r, (w.name, r["error"], w.log_tail())
        return replies

    def rounds(self, workload, args, workers=None):
        """ROUNDS rounds; per round, per worker digests, and round times."""
        digests, times = [], []
        for rnd in range(ROUNDS):
            start = time.monotonic()
            replies = self.round(workload, dict(args, round=rnd), workers)
            times.append(time.monotonic() - start)
            digests.append([r["digest"] for r in replies])
        return digests, times

    def close(self):
        for t in self.tasks:
            t.close()


def run_both(jobs, workload, args, log_dir, workers=None):
    """The scenario under grpc, then under grpc+rdma_device (strict)."""
    results = {}
    for protocol, env in ((harness.PROTOCOL_GRPC, None), (harness.PROTOCOL_RDMA, STRICT)):
        cluster = Replicas(jobs, log_dir, protocol, env)
        try:
            chosen = None if workers is None else [cluster.workers[i] for i in workers]
            digests, times = cluster.rounds(workload, args, chosen)
            stats = [t.stats() for t in cluster.tasks] if protocol != "grpc" else None
        finally:
            cluster.close()
        results[protocol] = (digests, times, stats)
        print(f"{workload} {protocol}: round times {[round(t, 2) for t in times]}")
    return results


def check_over_transport(stats):
    counters = [s["counters"] for s in stats]
    assert all(c["fallback_tensors"] == 0 for c in counters), counters
    assert sum(c["tensors_pushed"] for c in counters) > 0, counters
    assert sum(c["tensors_received"] for c in counters) > 0, counters
    assert sum(c["edges_static"] for c in counters) > 0, counters


def test_ps_with_four_workers_each_its_own_session(log_dir, plugin_built):
    res = run_both({"ps": 1, "worker": 4}, "ps_round", {"steps": 5}, log_dir)
    want, got = res[harness.PROTOCOL_GRPC][0], res[harness.PROTOCOL_RDMA][0]
    assert got == want
    check_over_transport(res[harness.PROTOCOL_RDMA][2])


def test_sync_replicas_token_queues_two_ps_three_workers(log_dir, plugin_built):
    res = run_both({"ps": 2, "worker": 3}, "sync_round", {"steps": 4, "workers": 3}, log_dir)
    want, got = res[harness.PROTOCOL_GRPC][0], res[harness.PROTOCOL_RDMA][0]
    assert got == want
    check_over_transport(res[harness.PROTOCOL_RDMA][2])


def test_four_threads_on_one_session(log_dir, plugin_built):
    res = run_both({"ps": 1, "worker": 1}, "threads_round", {"threads": 4, "steps": 10}, log_dir)
    want, got = res[harness.PROTOCOL_GRPC][0], res[harness.PROTOCOL_RDMA][0]
    assert got == want
    check_over_transport(res[harness.PROTOCOL_RDMA][2])


def test_ps_on_plain_grpc_beside_transport_workers(log_dir, plugin_built):
    """A ps that does not run the transport: its tensors go by stock gRPC
    at once (counted, with the reason), not after a connect timeout."""
    jobs = {"ps": 1, "worker": 2}
    reference = Replicas(jobs, log_dir, harness.PROTOCOL_GRPC)
    try:
        want, grpc_times = reference.rounds("ps_round", {"steps": 5})
    finally:
        reference.close()
    mixed = Replicas(jobs, log_dir, harness.PROTOCOL_RDMA, ps_protocol=harness.PROTOCOL_GRPC)
    try:
        got, times = mixed.rounds("ps_round", {"steps": 5})
        stats = [w.stats() for w in mixed.workers]
    finally:
        mixed.close()
    print(f"grpc rounds {[round(t, 2) for t in grpc_times]}, mixed {[round(t, 2) for t in times]}")
    assert got == want
    for s in stats:
        c = s["counters"]
        assert c["fallback_tensors"] > 0, s
        assert any("/job:ps/replica:0/task:0" in r or "does not run" in r
                   for r in s["fallback_reasons"]), s
    # No connect timeout inside any round: at most 1 s over the slowest
    # grpc round (a round is 6 session.run calls plus registration).
    assert max(times) < max(grpc_times) + 1.0, (times, grpc_times)


def test_in_process_local_cluster(log_dir, plugin_built):
    """tf.test.create_local_cluster: three servers in one process."""
    results = {}
    for protocol, env in ((harness.PROTOCOL_GRPC, None), (harness.PROTOCOL_RDMA, STRICT)):
        task = harness.Task(dict(role="more_scenarios.local_cluster", cluster={}, job="chief",
                                 task=0, protocol=protocol, rounds=ROUNDS), log_dir, env)
        try:
            task.wait_ready()
            try:
                results[protocol] = task.result(ROUND_DEADLINE_S * 2)
            except TimeoutError:
                pytest.fail(f"local cluster under {protocol} hung\n{task.dump_stacks()}")
        finally:
            task.close()
    assert results[harness.PROTOCOL_RDMA]["digest"] == results[harness.PROTOCOL_GRPC]["digest"]
    c = results[harness.PROTOCOL_RDMA]["stats"]["counters"]
    assert c["fallback_tensors"] == 0 and c["tensors_pushed"] > 0 and c["tensors_received"] > 0, c
