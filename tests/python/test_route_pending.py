"""Choosing a peer's route (name resolution, rdma_cm probing) never holds
up server creation, and work that meets a route still being chosen waits
for it in a queue, then goes the chosen way.

The peers' names resolve slowly on purpose: an LD_PRELOAD resolver
(slow_resolver/slow_resolver.c, conftest.py's slow_resolver fixture) makes
every lookup of a "*.slow.test" name take SLOW_MS and then answer
127.0.0.1, as a slow DNS server would. (The other slow part of a choice, the rdma_cm probe of up to
500 ms per peer, needs an RDMA device; it runs in the same place.)

What a user notices:
- a server with PEERS such peers is created in well under PEERS x SLOW_MS
  (choosing the routes one after another on the creating thread took at
  least that), and every peer has its route soon after, all chosen at once;
- steps run at once after creation, while the routes may still be pending,
  give exact values over the transport in strict mode (a fallback to gRPC
  is an error), with nothing over gRPC."""

import pytest

import harness

SLOW_MS = 1000
PEERS = 6
# Creation took >= PEERS * SLOW_MS (6 s) when each choice ran on the
# creating thread; now it does not wait for any. Half of that leaves room
# for a busy machine.
START_BOUND_S = PEERS * SLOW_MS / 1000 / 2
# All routes chosen at once: about one SLOW_MS, not PEERS of them.
ROUTED_BOUND_S = PEERS * SLOW_MS / 1000 / 2
RESULT_TIMEOUT_S = 90


def slow_env(lib, count_file):
    return {"LD_PRELOAD": lib, "SLOW_RESOLVER_MS": str(SLOW_MS),
            "SLOW_RESOLVER_COUNT": count_file, "GRPC_DNS_RESOLVER": "native",
            "RDMA_DEVICE_STRICT": "1"}


def test_server_creation_does_not_wait_for_route_choices(log_dir, plugin_built, slow_resolver,
                                                         tmp_path):
    ports = harness.free_ports(PEERS + 1)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}"] +
               [f"w{i}.slow.test:{p}" for i, p in enumerate(ports[1:], start=1)]}
    count = str(tmp_path / "lookups")
    task = harness.Task(dict(role="start_scenarios.timed_start", cluster=cluster, job="worker",
                             task=0, protocol=harness.PROTOCOL_RDMA, routed_within_s=60),
                        log_dir, env=slow_env(slow_resolver, count))
    try:
        task.wait_ready()
        try:
            r = task.result(RESULT_TIMEOUT_S)
        except TimeoutError:
            pytest.fail(f"the task hung\n{task.dump_stacks()}")
    finally:
        task.close()
    print(f"server created in {r['start_s']:.2f} s; every route chosen "
          f"{r['routed_s']:.2f} s after creation began ({PEERS} peers, {SLOW_MS} ms a lookup)")
    with open(count) as f:
        lookups = len(f.readlines())
    assert lookups >= PEERS, f"only {lookups} slow lookups: the peers' names were not resolved"
    assert r["start_s"] < START_BOUND_S, r
    # Every peer got its route (shm: the names resolve to this host).
    assert {p: r["routes"].get(p) for p in r["want"]} == {p: "shm" for p in r["want"]}, r
    assert r["routed_s"] < ROUTED_BOUND_S, r


def test_steps_wait_for_pending_routes(log_dir, plugin_built, slow_resolver, tmp_path):
    ports = harness.free_ports(2)
    cluster = {"worker": [f"w0.slow.test:{ports[0]}", f"w1.slow.test:{ports[1]}"]}
    env = slow_env(slow_resolver, str(tmp_path / "lookups"))
    holder = harness.Task(dict(role="server", cluster=cluster, job="worker", task=1,
                               protocol=harness.PROTOCOL_RDMA), log_dir, env=env)
    client = None
    try:
        holder.wait_ready()
        client = harness.Task(dict(role="start_scenarios.step_at_once", cluster=cluster,
                                   job="worker", task=0, protocol=harness.PROTOCOL_RDMA,
                                   elements=4096, steps=3), log_dir, env=env)
        client.wait_ready()
        try:
            r = client.result(RESULT_TIMEOUT_S)
        except TimeoutError:
            pytest.fail(f"the step hung\n{client.dump_stacks()}\n{holder.dump_stacks()}")
        held = holder.stats()["counters"]
    finally:
        if client is not None:
            client.close()
        holder.close()
    assert "error" not in r, r
    assert r["start_s"] < SLOW_MS / 1000, r
    want = [[(i + k) * 2.0 for i in range(4096)] for k in (1, 2, 3)]
    assert r["values"] == want
    c = r["counters"]
    assert c["fallback_tensors"] == 0 and held["fallback_tensors"] == 0, (c, held)
    assert c["tensors_received"] >= 3 and held["tensors_pushed"] >= 3, (c, held)


# A transfer waits this long for a pending route (tf_plugin/transport_routes.cc).
ROUTE_WAIT_S = 20.0


def test_a_route_pending_past_its_deadline_fails_the_step_then_recovers(log_dir, plugin_built,
                                                                        slow_resolver, tmp_path):
    # Only the transport's route threads (which choose routes) resolve
    # slowly, for longer than a transfer waits; gRPC resolves at once, so
    # the step starts at once and its transfers queue behind the route.
    slow_s = ROUTE_WAIT_S + 10
    ports = harness.free_ports(2)
    cluster = {"worker": [f"w0.slow.test:{ports[0]}", f"w1.slow.test:{ports[1]}"]}
    env = slow_env(slow_resolver, str(tmp_path / "lookups"))
    env.update(SLOW_RESOLVER_MS=str(int(slow_s * 1000)), SLOW_RESOLVER_THREAD="rdev-route")
    env.pop("RDMA_DEVICE_STRICT")
    holder = harness.Task(dict(role="server", cluster=cluster, job="worker", task=1,
                               protocol=harness.PROTOCOL_RDMA), log_dir, env=env)
    client = None
    try:
        holder.wait_ready()
        client = harness.Task(dict(role="start_scenarios.step_past_route_deadline",
                                   cluster=cluster, job="worker", task=0,
                                   protocol=harness.PROTOCOL_RDMA, elements=4096,
                                   routed_within_s=2 * slow_s), log_dir, env=env)
        client.wait_ready()
        try:
            r = client.result(RESULT_TIMEOUT_S)
        except TimeoutError:
            pytest.fail(f"the step hung\n{client.dump_stacks()}\n{holder.dump_stacks()}")
    finally:
        if client is not None:
            client.close()
        holder.close()
    print(f"first step: {r['first']} after {r['first_s']:.1f} s; route then {r['route']}")
    # The first step fails, naming the pending route, once a transfer has
    # waited its deadline (the holder, started first, may hit it first),
    # not after the name finally resolves.
    assert "still being chosen after" in r["first"], r
    assert r["first_s"] < slow_s, r
    # The route is chosen in the end, and the next step goes over it.
    assert r["route"] == "shm", r
    # (The failed step's assign_add on the holder may have run or not.)
    assert r["second"] in ([(i + 1) * 2.0 for i in range(4)], [(i + 2) * 2.0 for i in range(4)]), r
    assert r["received"] >= 1, r
