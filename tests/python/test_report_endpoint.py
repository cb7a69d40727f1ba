"""The report's endpoint tables (`bench py`, examples/param_server.py):
cells are medians over runs, ratios the median of the per-run ratios with
their range, and a run whose weights differed shows as such."""

from rdma_device.bench import report, report_endpoint


def _cells(line):
    return [c.strip() for c in line.strip("|").split("|")]


def _ps(ours, base, ratio, same=True):
    return {"params": 65536, "bytes": 262144, "baseline": "shared_memory+pipe", "ours_step_ms": ours,
            "baseline_step_ms": base, "ratio": ratio, "ours_cpu_ms": 1.0, "baseline_cpu_ms": 0.5,
            "identical": same}


def test_param_server_table_takes_medians_and_per_run_ratios():
    runs = [[_ps(2.0, 1.0, 0.5)], [_ps(4.0, 1.0, 0.25)], [_ps(3.0, 3.0, 1.0)]]
    table = report_endpoint.param_server_md(runs).splitlines()
    assert _cells(table[2]) == ["256 KiB", "shared_memory+pipe", "3.00 ms", "1.00 ms", "**0.50** (0.25–1.00)",
                                "1.00 / 0.50 ms", "yes"]
    runs[1] = [_ps(4.0, 1.0, 0.25, same=False)]
    assert _cells(report_endpoint.param_server_md(runs).splitlines()[2])[-1] == "**no**"


def test_py_table_has_a_row_per_kind_size_and_baseline():
    ping = {"kind": "ping", "size": 64, "baseline": "gloo", "ratio": 2.0, "ours_latency_us": 50.0,
            "baseline_latency_us": 100.0, "ours_cpu_us_per_roundtrip": 80.0, "baseline_cpu_us_per_roundtrip": 90.0}
    stream = {"kind": "stream", "size": 4096, "baseline": "gloo", "ratio": 0.5, "ours_gbps": 1.0,
              "baseline_gbps": 2.0, "ours_cpu_s_per_gb": 3.0, "baseline_cpu_s_per_gb": 4.0}
    runs = [[ping, stream], [dict(ping, ratio=4.0, ours_latency_us=25.0), dict(stream, ratio=1.5)]]
    table = report_endpoint.py_md(runs).splitlines()
    assert len(table) == 4
    assert _cells(table[2]) == ["ping 64 B, one way", "gloo", "37.5 µs", "100.0 µs", "**3.00** (2.00–4.00)",
                                "80 / 90 µs per round trip"]
    assert _cells(table[3])[:5] == ["stream 4 KiB", "gloo", "1.00 GB/s", "2.00 GB/s", "**1.00** (0.50–1.50)"]


def test_the_report_runs_the_endpoint_benchmarks():
    for name in ("py", "py_rpc", "param_server"):
        assert name in report.ORDER and name in report.RENDER
    assert report.command("param_server", False) == "python examples/param_server.py --json --params 4M,64K"
    assert "--rpc" in report.command("py_rpc", False)
