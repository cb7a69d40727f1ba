"""The report's suite table: ratios are per run (never of medians), and the
ceiling column is stock gRPC's step over the compute-only step of the same
run: the ratio a transport that moved every tensor for free would reach."""

from rdma_device import _bench_tables


def _rows(grpc, ours, compute):
    return [{"workload": "w", "workers": 2, "mode": "grpc", "step_ms": grpc, "compute_ms": compute},
            {"workload": "w", "workers": 2, "mode": "grpc+rdma_device", "step_ms": ours, "compute_ms": compute}]


def test_suite_table_has_per_run_ratios_and_the_compute_ceiling():
    runs = [_rows(30.0, 20.0, 10.0), _rows(40.0, 20.0, 20.0), _rows(36.0, 24.0, 12.0)]
    table = _bench_tables.suite_md(runs).splitlines()
    assert table[0].startswith("| workload | workers | step ms grpc / grpc+rdma_device |")
    assert "ceiling vs grpc" in table[0]
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    # step medians: grpc 36, ours 20; vs grpc per run 1.5, 2.0, 1.5
    assert cells[:4] == ["w", "2", "36.0 / 20.0", "**1.50** (1.50–2.00)"]
    # compute-only median 12; ceilings per run 3.0, 2.0, 3.0
    assert cells[4:] == ["12.0", "3.00 (2.00–3.00)"]


def test_a_run_without_compute_only_steps_leaves_the_ceiling_empty():
    rows = [dict(r, compute_ms=0) for r in _rows(30.0, 20.0, 10.0)]
    cells = [c.strip() for c in _bench_tables.suite_md([rows]).splitlines()[2].strip("|").split("|")]
    assert cells[4:] == ["—", "—"]
