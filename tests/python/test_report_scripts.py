"""The report's blocks measured by test scripts (bench/report_scripts.py):
the rows the scripts print are the rows the tables read, failed runs and
crashes show, and the simulation's runs cover disjoint seeds."""

import json
import os
import re
import subprocess

from rdma_device.bench import report, report_scripts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _json_echo(script, start, end, variables):
    """Run the lines of `script` from the one matching `start` to the one
    matching `end` (the part that prints its JSON row) with `variables`
    set, and parse what they print."""
    with open(os.path.join(ROOT, script)) as f:
        lines = f.read().splitlines()
    a = next(i for i, l in enumerate(lines) if re.search(start, l))
    b = next(i for i in range(a, len(lines)) if re.search(end, lines[i]))
    body = "\n".join(lines[a:b + 1])
    setup = "".join(f"{k}={v!r}\n" if not isinstance(v, int) else f"{k}={v}\n" for k, v in variables.items())
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", setup + body], capture_output=True, text=True, check=True)
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def test_two_hosts_row_has_every_field_the_table_reads():
    rows = _json_echo("tests/softroce/two_hosts.sh", r"^num\(\) ", r'seconds\\": \$\(\(SECONDS - start\)\)\}"$',
                      dict(ok="ok", tensors=600, bytes=1000, kill_a="2132", kill_b="2177", reach_a="1", reach_b="1",
                           blip="1744", vanish_ms="3357", vanish_bound="3758", vanish_recv="955",
                           recv_bound="5284", SECONDS=75, start=0))
    assert rows == [{"ok": True, "tensors": 300, "bytes": 500, "kill_a_ms": 2132, "kill_b_ms": 2177,
                     "restarted_a_reached": True, "restarted_b_reached": True, "blip_longest_ms": 1744,
                     "vanish_writes_ms": 3357, "vanish_bound_ms": 3758, "vanish_recv_ms": 955,
                     "vanish_recv_bound_ms": 5284, "seconds": 75}]
    # A failed run's missing numbers are null, not a broken line.
    bad = _json_echo("tests/softroce/two_hosts.sh", r"^num\(\) ", r'seconds\\": \$\(\(SECONDS - start\)\)\}"$',
                     dict(ok="FAILED", tensors=0, bytes=0, kill_a="", kill_b="", reach_a="0", reach_b="0", blip="",
                          vanish_ms="", vanish_bound="", vanish_recv="", recv_bound="", SECONDS=9, start=0))
    assert bad[0]["ok"] is False and bad[0]["kill_a_ms"] is None


def test_two_hosts_table_shows_medians_ranges_and_failed_runs():
    run = {"ok": True, "tensors": 300, "kill_a_ms": 2132, "kill_b_ms": 2177, "restarted_a_reached": True,
           "restarted_b_reached": True, "blip_longest_ms": 1744, "vanish_writes_ms": 3357, "vanish_bound_ms": 3758,
           "vanish_recv_ms": 955, "vanish_recv_bound_ms": 5284, "seconds": 75}
    md = report_scripts.two_hosts_md([[run], [dict(run, vanish_writes_ms=3800, kill_a_ms=2100)],
                                      [dict(run, ok=False, restarted_b_reached=False, vanish_writes_ms=3500)]])
    assert "3,500 ms (3,357–3,800)" in md
    assert "2,132 ms (2,100–2,132)" in md
    assert "2 of 3 runs" in md  # the restarted process reached
    assert "2 of 3 runs passed every check." in md
    assert "4,284 ms: 3,758 documented" in md and "5,284 ms: 1,000 (keepalive)" in md


def test_fuzz_rows_have_every_field_the_table_reads():
    rows = _json_echo("tests/fuzz/run.sh", r"^  rate=\$\(", r'^  echo "\{\\"target', dict(
        t="rx", secs=120, n=1500000, rc=0, log="/dev/null"))
    assert rows == [{"target": "rx", "seconds": 120, "executions": 1500000, "execs_per_s": 0, "new_units": 0,
                     "crashes": 0}]
    crashed = _json_echo("tests/fuzz/run.sh", r"^  rate=\$\(", r'^  echo "\{\\"target', dict(
        t="rx", secs=120, n=7, rc=77, log="/dev/null"))
    assert crashed[0]["crashes"] == 1


def test_fuzz_table_sums_crashes_over_runs():
    def run(n, crashes=0):
        return [{"target": "wire", "seconds": 40, "executions": n, "execs_per_s": n / 40, "new_units": 3,
                 "crashes": crashes},
                {"target": "all", "seconds": 240, "executions": 2 * n, "execs_per_s": n / 120, "new_units": 5,
                 "crashes": crashes}, {"unrelated": 1}]
    md = report_scripts.fuzz_md([run(1000), run(3000, crashes=1), run(2000)])
    assert "| `wire` | 40 s | 2,000 (1,000–3,000) |" in md
    assert "1 in 3 runs" in md
    assert "| all targets | 240 s | 4,000 (2,000–6,000) |" in md


def test_sim_table_counts_violations_of_every_run():
    row = {"seeds": 1000, "schedules": 2000, "events": 1152992, "tensors_delivered": 38198, "receives_failed": 18169,
           "calls_answered": 10410, "calls_failed": 1590, "faults": 16000, "violations": 0, "seconds": 128.5}
    md = report_scripts.sim_md([[row], [dict(row, violations=2)], [row]])
    assert "| **violations** | 0 (0–2) | **2** |" in md
    assert "| seeds | 1,000 (1,000–1,000) | 3,000 |" in md
    # Each run covers its own seeds.
    firsts = [report_scripts.argv("sim", i)[report_scripts.argv("sim", i).index("--first") + 1] for i in range(3)]
    assert firsts == ["1", "1001", "2001"]


def test_verbs_limits_table_names_each_limit_and_its_bound():
    md = report_scripts.verbs_limits_md([[{"limit": "connections", "connections": 256, "connect_ms": 4400.0},
                                          {"limit": "rnr", "fail_ms": 4700.0},
                                          {"limit": "unroutable", "not_viable_ms": 1.2}],
                                         [{"limit": "connections", "connections": 256, "connect_ms": 5000.0},
                                          {"limit": "rnr", "fail_ms": 4600.0},
                                          {"limit": "unroutable", "not_viable_ms": 0.9}]])
    assert "4,700 ms (4,400–5,000)" in md
    assert "4,650 ms (4,600–4,700)" in md
    assert "1.1 ms (0.9–1.2)" in md


def test_the_verbs_tests_print_the_rows_the_table_reads():
    """The three tests' JSON rows carry the fields verbs_limits_md reads."""
    with open(os.path.join(ROOT, "tests", "fabric_verbs.rs")) as f:
        src = f.read()
    for limit, field in (("connections", "connect_ms"), ("rnr", "fail_ms"), ("unroutable", "not_viable_ms")):
        assert re.search(r'\\"limit\\": \\"%s\\".*\\"%s\\"' % (limit, field), src), limit
    # ... and the report runs exactly those tests.
    names = report_scripts.SCRIPTS["verbs_limits"][1]["SOFTROCE_FILTER"].split()
    for name in names:
        assert re.search(r"fn %s" % name, src), name


def test_quick_reports_leave_the_scripts_to_ci_and_check_their_files():
    assert set(report_scripts.SCRIPTS) <= set(report.ORDER)
    for name, (_, _, paths) in report_scripts.SCRIPTS.items():
        assert report.BLOCK_PATHS[name] == paths
        for p in paths:
            assert os.path.exists(os.path.join(ROOT, p)), p
        assert report.command(name, quick=False).startswith(("bash ", "cargo ", "SOFTROCE_FILTER="))


def test_a_vm_consoles_kernel_lines_are_not_rows():
    console = ("[   18.730634] reboot: Power down\n"
               '{"limit": "rnr", "fail_ms": 4062.0}\n'
               "[    0.000000] Linux version 6.1.0\n")
    assert report._rows(console, console=True) == [{"limit": "rnr", "fail_ms": 4062.0}]
    # A bench's own output stays strict: a broken row is an error, not a gap.
    try:
        report._rows(console)
    except ValueError:
        pass
    else:
        raise AssertionError("a line that is not JSON passed as a row")
