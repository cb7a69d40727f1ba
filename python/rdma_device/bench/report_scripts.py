"""Blocks of `bench report` measured by the test scripts, not by a bench
command: the coverage-guided fuzzer's counts, the deterministic
simulation's, the verbs backend's tested limits on Soft-RoCE (one qemu
VM) and the two-host failure times (two VMs on one virtual L2). Each
script prints one JSON row per line among its other output; the tables
are medians over the runs with their range, as in report_tables.

The scripts build what they run from the checkout (cargo), so their
numbers are always the tree's. The VM scripts need qemu and download a
Debian kernel once (tests/softroce/README.md); `--quick` (CI) leaves all
four out, because .ci/test.sh runs each of them in a section of its own.
"""

from rdma_device.bench.report_tables import _med, _rng, _table, aggregate

# name -> (argv from the checkout's root, extra environment, what its
# rows depend on besides the library's code (for `--check`)).
SCRIPTS = {
    "fuzz": (["bash", "tests/fuzz/run.sh", "240"], {}, ("tests/fuzz",)),
    "sim": (["cargo", "run", "--release", "--quiet", "--features", "sim", "--bin", "rdma-device-sim", "--",
             "--seeds", "1000", "--first", "{first}"], {}, ()),
    "verbs_limits": (["bash", "tests/softroce/run.sh"],
                     {"SOFTROCE_FILTER": "many_connections_to_one_receiver stuck_receiver_fails_the_sender "
                                         "reaches_asks_rdma_cm"},
                     ("tests/softroce", "tests/fabric_verbs.rs", "tests/common")),
    "two_hosts": (["bash", "tests/softroce/two_hosts.sh"], {}, ("tests/softroce", "tests/two_hosts.rs", "tests/common")),
}
SIM_SEEDS = 1000


def argv(name, run):
    """The argv of run `run` (0-based) of `name`; the simulation's runs
    take disjoint seeds."""
    return [a.replace("{first}", str(1 + run * SIM_SEEDS)) for a in SCRIPTS[name][0]]


def command_line(name):
    env = " ".join(f"{k}={v!r}" if " " in v else f"{k}={v}" for k, v in SCRIPTS[name][1].items())
    cmd = " ".join(argv(name, 0)).replace("--first 1", "--first 1+1000·(run−1)")
    return f"{env} {cmd}" if env else cmd


def _rows_of(runs, key):
    return [[r for r in rows if key in r] for rows in runs]


def fuzz_md(runs):
    """tests/fuzz/run.sh: per target, its share of the time, executions
    and new inputs (median, range) and crashes summed over the runs."""
    runs = _rows_of(runs, "target")
    agg = aggregate(runs, lambda r: r["target"])
    crashes = {t: sum(r.get("crashes", 0) for rows in runs for r in rows if r["target"] == t) for t in agg}
    rows = []
    for t, d in agg.items():
        label = "all targets" if t == "all" else f"`{t}`"
        rows.append([label, _med(d.get("seconds"), "{:.0f}") + " s", _rng(d.get("executions"), "{:,.0f}"),
                     _med(d.get("execs_per_s"), "{:,.0f}"), _rng(d.get("new_units"), "{:.0f}"),
                     f"{crashes[t]} in {d['n']} run{'s' if d['n'] != 1 else ''}"])
    return _table(["target", "time per run", "executions (median, range)", "per second",
                   "new inputs found (median, range)", "crashes"],
                  ["---", "---:", "---:", "---:", "---:", "---:"], rows)


def sim_md(runs):
    """rdma-device-sim: per run of 1,000 seeds (2,000 schedules), what the
    runs exercised and the violations found, summed over the runs."""
    runs = _rows_of(runs, "schedules")
    flat = [r for rows in runs for r in rows]
    agg = aggregate(runs, lambda r: "sim")["sim"] if flat else {}
    fields = (("seeds", "seeds"), ("schedules", "schedules (reordered; reordered with faults)"),
              ("events", "events"), ("tensors_delivered", "tensors delivered intact"),
              ("receives_failed", "receives failed by injected faults"), ("calls_answered", "calls answered"),
              ("calls_failed", "calls failed by injected faults"), ("faults", "faults injected"),
              ("seconds", "seconds"))
    rows = [[label, _rng(agg.get(f), "{:,.0f}" if f != "seconds" else "{:,.1f}"), f"{sum(r.get(f, 0) for r in flat):,.0f}"] for f, label in fields]
    rows.append(["**violations**", _rng(agg.get("violations"), "{:.0f}"),
                 f"**{sum(r.get('violations', 0) for r in flat)}**"])
    return _table(["per run", "median (range)", f"all {len(flat)} runs"], ["---", "---:", "---:"], rows)


def verbs_limits_md(runs):
    """tests/softroce/run.sh, three tests of tests/fabric_verbs.rs: how
    long 256 connections to one receiver take to connect, how soon a
    sender fails when its receiver stops reposting (RNR retry 1), how
    soon an unroutable peer is not viable."""
    runs = _rows_of(runs, "limit")
    agg = aggregate(runs, lambda r: r["limit"])
    what = {"connections": ("256 connections to one receiver connected (each then moves an inline write, a staged "
                            "write and a control message, all checked)", "connect_ms", "30 s per connection"),
            "rnr": ("a sender fails with \"RNR retry counter exceeded\" after its receiver's progress thread "
                    "stops (RNR retry 1)", "fail_ms", "20 s"),
            "unroutable": ("an unroutable peer (192.0.2.1) is \"not viable\" from rdma_cm", "not_viable_ms",
                           "2 s")}
    rows = []
    for limit, d in agg.items():
        label, field, bound = what.get(limit, (limit, "ms", "—"))
        cell = d.get(field)
        rows.append([label, _rng(cell, "{:,.0f}" if cell and cell[0] >= 10 else "{:.1f}", unit="ms"), bound,
                     f"{d['n']}"])
    return _table(["what (Soft-RoCE in one qemu VM, TCG)", "took (median, range)", "the test's bound", "runs"],
                  ["---", "---:", "---:", "---:"], rows)


def two_hosts_md(runs):
    """tests/softroce/two_hosts.sh: each failure time and the bound the
    script asserts, medians over the runs with their range."""
    runs = _rows_of(runs, "vanish_writes_ms")
    flat = [r for rows in runs for r in rows]
    agg = aggregate(runs, lambda r: "two")["two"] if flat else {}

    def ms(f):
        return _rng(agg.get(f), "{:,.0f}", unit="ms")

    documented = _med(agg.get("vanish_bound_ms"), "{:,.0f}")
    recv_bound = agg.get("vanish_recv_bound_ms")
    # The receive's bound is one keepalive interval plus the writes' (the
    # documented bound plus 150 ms and a tenth: rxe's timers tick in
    # jiffies, late under emulation).
    writes_bound = "—" if recv_bound is None else f"{recv_bound[0] - 1000:,.0f}"
    recv_bound = _med(recv_bound, "{:,.0f}")
    ok = sum(1 for r in flat if r.get("ok"))
    reached = sum(1 for r in flat if r.get("restarted_a_reached") and r.get("restarted_b_reached"))
    rows = [
        ["SIGKILL of A: B's waiters fail (from A's last step; A waits 2 s of it before its SIGKILL)",
         ms("kill_a_ms"), "3,000 ms"],
        ["SIGKILL of B: A's waiters fail (likewise)", ms("kill_b_ms"), "3,000 ms"],
        ["the restarted process is reached again", f"{reached} of {len(flat)} runs", "every run"],
        ["B's VM stopped 1.5 s mid-exchange: the longest step (every step must complete)", ms("blip_longest_ms"),
         "completes"],
        ["host B vanishes (VM killed): A's writes fail, from its last completed write", ms("vanish_writes_ms"),
         f"{writes_bound} ms: {documented} documented, + 150 and a tenth"],
        ["then a receive A waits on from B fails, from the writes' failure", ms("vanish_recv_ms"),
         f"{recv_bound} ms: 1,000 (keepalive) + the writes' bound"],
        ["tensors exchanged (checksummed, both ways)", _rng(agg.get("tensors"), "{:,.0f}"), ""],
        ["the script's whole run under TCG", _rng(agg.get("seconds"), "{:,.0f}", unit="s"), ""],
    ]
    return (_table(["two hosts, verbs over one virtual L2 (two qemu VMs, TCG)", "measured (median, range)",
                    "the script's bound"], ["---", "---:", "---:"], rows)
            + f"\n\n{ok} of {len(flat)} runs passed every check.")


RENDER = {"fuzz": fuzz_md, "sim": sim_md, "verbs_limits": verbs_limits_md, "two_hosts": two_hosts_md}
