"""Placement at graph-registration time, seen through TensorFlow.

A TF1 graph with static shapes has every cross-task edge placed on its
receiver while the graph is registered, so its first step already moves
every tensor with one push and no negotiation; tensors whose size changes
every step are re-placed; an arena too small for the graph still trains,
through the streamed path. Results are bit-identical to stock gRPC.
"""

import pytest

import harness
from conftest import ServerSet

STRICT = {"RDMA_DEVICE_STRICT": "1"}
STATIC_STEPS = 10
RESIZE_STEPS = 8


def totals(counter_sets):
    out = {}
    for counters in counter_sets:
        for name, value in counters.items():
            out[name] = out.get(name, 0) + value
    return out


def run_paused(servers, role, steps):
    """Runs a pausing scenario; returns (pause payload, server counters at
    the pause, result)."""
    client = harness.Task(dict(role=role, cluster=servers.cluster, job="chief", task=0,
                               protocol=servers.protocol, steps=steps, pause=True),
                          servers.log_dir, servers.env)
    try:
        client.wait_ready()
        paused = client.expect("PAUSED", 120)
        at_pause = [t.stats()["counters"] for t in servers.servers]
        client.proc.stdin.write("go\n")
        client.proc.stdin.flush()
        return paused, at_pause, client.result(120)
    finally:
        client.close()


def test_static_graph_first_step_pushes_without_negotiation(log_dir, plugin_built,
                                                            grpc_reference):
    servers = ServerSet(harness.PROTOCOL_RDMA, log_dir, env=STRICT)
    try:
        paused, at_pause, got = run_paused(servers, "tf1_static", STATIC_STEPS)
        at_end = [t.stats()["counters"] for t in servers.servers]
    finally:
        servers.close()
    after_first = totals(at_pause + [paused["stats"]["counters"]])
    edges = paused["cross_task_edges"]
    print(f"{edges} cross-task edges; counters after step 1: "
          + ", ".join(f"{k}={after_first[k]}" for k in (
              "edges_static", "edges_traced", "replacements", "negotiation_messages",
              "tensors_pushed", "inline_tensors")))
    assert edges > 5
    # Every cross-task edge was placed at registration, none on first use.
    assert after_first["edges_static"] == edges, after_first
    assert after_first["edges_traced"] == 0, after_first
    assert after_first["replacements"] == 0, after_first
    # The only negotiation: one Announce + one Publish per static placement.
    assert after_first["negotiation_messages"] == 2 * edges, after_first
    # Step 1 moved every cross-task tensor (dead ones too) as one push.
    assert after_first["tensors_pushed"] == edges, after_first
    assert after_first["inline_tensors"] == 0, after_first
    assert after_first["fallback_tensors"] == 0, after_first

    # The later steps negotiated nothing either: every tensor was a push.
    # (The final fetch of the variables is one more graph, placed statically
    # too: `extra` edges, one tensor each.)
    after_all = totals(at_end + [got["stats"]["counters"]])
    extra = after_all["edges_static"] - edges
    assert after_all["edges_traced"] == 0, after_all
    assert after_all["replacements"] == 0, after_all
    assert after_all["negotiation_messages"] == 2 * after_all["edges_static"], after_all
    assert after_all["inline_tensors"] == 0, after_all
    assert after_all["tensors_pushed"] == edges * STATIC_STEPS + extra, after_all

    want = grpc_reference("tf1_static", STATIC_STEPS)
    assert got["cross_task_edges"] == want["cross_task_edges"] == edges
    assert got["losses"] == want["losses"]
    assert got["digest"] == want["digest"]


@pytest.mark.parametrize("arena", [None, "1M"], ids=["default-arena", "arena-1M"])
def test_changing_shapes_and_small_arena_match_grpc(arena, log_dir, plugin_built,
                                                    grpc_reference):
    env = dict(STRICT)
    if arena:
        env["RDMA_DEVICE_ARENA_BYTES"] = arena
    servers = ServerSet(harness.PROTOCOL_RDMA, log_dir, env=env)
    try:
        got = servers.run_client("tf1_resize", steps=RESIZE_STEPS)
        counters = totals([t.stats()["counters"] for t in servers.servers]
                          + [got["stats"]["counters"]])
    finally:
        servers.close()
    print(f"arena {arena or 'default'}: " + ", ".join(f"{k}={counters[k]}" for k in (
        "edges_static", "edges_traced", "replacements", "negotiation_messages",
        "tensors_pushed", "inline_tensors", "slots_reclaimed")))
    want = grpc_reference("tf1_resize", RESIZE_STEPS)
    assert got["losses"] == want["losses"]
    assert got["digest"] == want["digest"]
    assert counters["fallback_tensors"] == 0, counters
    if arena:
        # Multi-MB tensors cannot fit a 1 MiB arena: streamed in chunks.
        assert counters["inline_tensors"] > 0, counters
    else:
        # Sizes change every step: edges were re-placed as they grew.
        assert counters["replacements"] > 0, counters
        assert counters["inline_tensors"] == 0, counters
