"""The suite's further report tables (breakdown, transfer sweep, MWMS):
medians over the runs, ratios per run with their range, read from each
run's rows and its raw directory; and they land in their own generated
blocks."""

import json

from rdma_device.bench import report_suite


def _cells(line):
    return [c.strip() for c in line.strip("|").split("|")]


def _bd(step, transport, critical="ps/replica:0/task:0"):
    return {"workload": "w", "workers": 2, "mode": "grpc+rdma_device", "step_ms": step,
            "breakdown": {"traced_step_ms": step, "client_master": 1.0, "dispatch": 0.5,
                          "waiting_for_sender": step - 3.0, "in_transport": transport, "partition_other": 0.5,
                          "critical_task": "/job:" + critical}}


def test_breakdown_takes_medians_over_the_runs_and_names_the_usual_critical_partition():
    runs = [[_bd(10.0, 1.0)], [_bd(14.0, 3.0, "worker/replica:0/task:1")], [_bd(12.0, 2.0)],
            [{"workload": "w", "workers": 2, "mode": "grpc", "step_ms": 20.0}]]
    lines = report_suite.breakdown_table(runs).splitlines()
    assert len(lines) == 3, "one row: stock gRPC has no breakdown"
    cells = _cells(lines[2])
    assert cells[:4] == ["w", "2", "grpc+rdma_device", "12.00 (10.00–14.00)"]
    assert "tensor in the transport ms" in _cells(lines[0])
    assert cells[_cells(lines[0]).index("tensor in the transport ms")] == "2.00"
    assert cells[-1] == "ps/replica:0/task:0 (2 of 3)"


def _sw(size, grpc, ours):
    return [{"size": size, "mode": "grpc", "step_ms": grpc, "gbps": size / grpc / 1e6, "cpu_s_per_gb": 2.0,
             "memcpy_gbps": 6.0},
            {"size": size, "mode": "grpc+rdma_device", "step_ms": ours, "gbps": size / ours / 1e6,
             "cpu_s_per_gb": 1.0, "memcpy_gbps": 6.0}]


def test_sweep_ratios_are_per_run_and_sizes_are_in_order():
    runs = [_sw(1 << 20, 4.0, 2.0) + _sw(65536, 1.0, 1.0), _sw(1 << 20, 6.0, 2.0) + _sw(65536, 1.2, 1.0),
            _sw(1 << 20, 4.5, 3.0) + _sw(65536, 1.1, 1.0)]
    lines = report_suite.sweep_table(runs).splitlines()
    assert _cells(lines[0])[:3] == ["size", "step ms grpc / grpc+rdma_device", "grpc / grpc+rdma_device (median, range)"]
    assert [_cells(line)[0] for line in lines[2:]] == ["64 KiB", "1 MiB"]
    # Per run 2.0, 3.0, 1.5: median 2.0; the medians' 4.5 / 2.0 would say 2.25.
    assert _cells(lines[3])[1:3] == ["4.50 / 2.00", "**2.00** (1.50–3.00)"]


def test_mwms_shows_medians_the_ratio_range_and_whether_the_weights_agreed():
    row = {"workload": "mlp_allreduce", "workers": 2, "weights_mib": 4.0, "grpc_step_ms": 15.0,
           "rdma_device_step_ms": 9.0, "ratio": 1.67, "grpc_cpu_ms": 25.0, "rdma_device_cpu_ms": 17.0,
           "collective_mb_per_step": 8.4, "collective_fallback": 0, "weights_bit_identical": True}
    runs = [[row], [dict(row, ratio=1.5, collective_fallback=2)], [dict(row, ratio=1.9, weights_bit_identical=False)]]
    cells = _cells(report_suite.mwms_table(runs).splitlines()[2])
    assert cells[4] == "**1.67** (1.50–1.90)"
    assert cells[-2:] == ["2", "**no**"]


def test_the_blocks_come_from_each_completed_runs_raw_directory(tmp_path):
    records = [{"bench": "suite", "run": 0, "rows": [_bd(10.0, 1.0)]},
               {"bench": "suite", "run": 1, "rows": [], "error": "exit 1"},
               {"bench": "suite", "run": 2, "rows": [_bd(12.0, 2.0)]}]
    for i, size in ((0, 65536), (1, 1 << 20), (2, 65536)):
        d = tmp_path / "raw" / f"suite-{i}"
        d.mkdir(parents=True)
        (d / "transfer.json").write_text(json.dumps(_sw(size, 2.0, 1.0)))
        (d / "mwms.json").write_text("[]")
    tables = report_suite.tables(records, str(tmp_path))
    assert sorted(tables) == ["suite_breakdown", "suite_sweep"], "no MWMS rows: no block"
    # The failed run's sweep (1 MiB) is not counted.
    assert [_cells(line)[0] for line in tables["suite_sweep"].splitlines()[2:]] == ["64 KiB"]


def test_the_allocation_counts_are_a_report_block_from_the_tests_json_rows():
    from rdma_device.bench import report, report_tables

    assert "allocs" in report.ORDER and report.command("allocs", False) == \
        "python -m pytest -q -s tests/python/test_allocs.py"
    argv = report._argv("allocs", False, "/nowhere", "/repo")
    assert argv[1:] == ["-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "/repo/tests/python/test_allocs.py"]
    line = ('{"task": "ps", "steps": 50, "tensors_per_step": 8, "grpc": 315.0, "rdma_device": 116.0, "shim": 30.0, '
            '"transport": 7.0, "transport_rpc": 7.0, "transport_setup": 0.0, "transport_other": 0.0}')
    rows = report._rows("....\n" + line + "\n1 passed in 60.00s\n")
    runs = [rows, [dict(rows[0], rdma_device=120.0, shim=32.0)], [dict(rows[0], rdma_device=118.0)]]
    cells = _cells(report_tables.allocs_md(runs).splitlines()[2])
    assert cells == ["ps", "315.0", "118.0", "30.0 (30.0–32.0)", "7.0 (7.0–7.0)", "7.00 / 0.00 / 0.00"]


def test_the_report_runs_bench_trace_with_its_trace_file_and_plot_in_the_run_directory():
    from rdma_device.bench import report

    assert "trace" in report.ORDER and "trace" in report.RENDER
    argv = report._argv("trace", False, "/run", "/repo")
    assert argv[3:] == ["trace", "--json", "--out", "/run/trace.json", "--plot", "/run/trace.png"]
    assert "--out" in report._argv("trace", True, "/run", "/repo"), "the quick run writes no file into the cwd"
