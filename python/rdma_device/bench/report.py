"""`python -m rdma_device.bench report`: every benchmark the README quotes,
on the current tree, N runs each in randomised interleaved order.

    python -m rdma_device.bench report [--runs 3] [--out DIR] [--only fabric,train]
    python -m rdma_device.bench report --quick --out DIR     (CI: minutes; README untouched)

Runs `rdma-device-bench fabric`, `python -m rdma_device.bench` transfer,
train, allreduce, suite, soak, trace (where a step's time goes), py (the endpoint API against shared
memory + a pipe and gloo) and py --rpc (against PyTorch RPC), `examples/param_server.py` (the endpoint
API's parameter server), tests/python/test_allocs.py (allocations per step, with pytest -s) and the
test scripts whose counts and times the documents quote (report_scripts: the fuzzer, the simulation,
the verbs limits on Soft-RoCE and the two-host failure times; not with --quick, which CI runs beside
them) as subprocesses, each printing JSON rows; the
order of all (benchmark, run) pairs is shuffled with a recorded seed, so
no benchmark always runs first, or on a machine warmed by the same
neighbour. Writes DIR/report.json (machine, date, commit, order, every
run's rows and wall time) and DIR/report.md (the tables). Without
`--quick` it also rewrites the README's generated regions (between
`<!-- report:NAME begin -->` and `<!-- report:NAME end -->`) and the plots
in docs/eval/ (fabric.png; the suite's plots from its last run).
`--quick` runs the same benchmarks with fewer runs and smaller settings
and writes only to DIR.
"""

import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time

from rdma_device.bench import report_endpoint, report_scripts, report_suite, report_tables

# name -> (full arguments, quick arguments); the README quotes the full ones.
PY_BENCHES = {
    "transfer": (["transfer", "--json"], ["transfer", "--json", "--sizes", "64K,16M", "--reps", "2", "--block", "3"]),
    "train": (["train", "--json", "--steps", "100"], ["train", "--json", "--steps", "20"]),
    "allreduce": (["allreduce", "--json"],
                  ["allreduce", "--json", "--sizes", "1M,16M", "--workers", "2", "--reps", "2", "--block", "2"]),
    "soak": (["soak", "--json", "--steps", "10000"], ["soak", "--json", "--steps", "60"]),
    "suite": (["suite", "--quick", "--json"],
              ["suite", "--quick", "--json", "--workloads", "wide_deep", "--workers", "2", "--reps", "2",
               "--block", "2", "--no-sweep", "--mwms-workers", ""]),
    "trace": (["trace", "--json"], ["trace", "--json", "--sizes", "4K", "--steps", "5", "--blocks", "1"]),
    "py": (["py", "--json"], ["py", "--json", "--quick", "--no-gloo", "--plot", ""]),
    # PyTorch RPC apart: its threads poll while it is up and change the
    # other baselines' numbers (see pybench.py).
    "py_rpc": (["py", "--json", "--rpc", "--no-gloo"],
               ["py", "--json", "--quick", "--rpc", "--no-gloo", "--plot", ""]),
}
# The endpoint API's parameter server is an example script, not a bench
# command: run from the checkout.
EXAMPLES = {
    "param_server": (["param_server.py", "--json", "--params", "4M,64K"],
                     ["param_server.py", "--json", "--params", "64K", "--steps", "10"]),
}
# Tests whose measurement the documents quote: run with -s from the
# checkout, they print one JSON row per line.
TESTS = {"allocs": "tests/python/test_allocs.py"}
# The plots of `bench py` runs, as docs/endpoint.md shows them.
PLOTS = {"py": "endpoint_py.png", "py_rpc": "endpoint_py_rpc.png", "trace": "trace.png"}
ORDER = ("fabric", "transfer", "train", "allreduce", "suite", "soak", "trace", "py", "py_rpc", "param_server", "allocs",
         *report_scripts.SCRIPTS)
RENDER = {**report_tables.RENDER, **report_endpoint.RENDER, **report_scripts.RENDER}


def command(name, quick):
    """The command one run of `name` is, as the README quotes it."""
    if name == "fabric":
        return "rdma-device-bench fabric --transport shm --json" + (" --quick" if quick else "")
    if name in EXAMPLES:
        return "python examples/" + " ".join(EXAMPLES[name][1 if quick else 0])
    if name in TESTS:
        return f"python -m pytest -q -s {TESTS[name]}"
    if name in report_scripts.SCRIPTS:
        return report_scripts.command_line(name)
    args = [a if a else "''" for a in PY_BENCHES[name][1 if quick else 0]]
    plot = f" --plot DIR/{PLOTS[name]}" if name in PLOTS and not quick else ""
    out = {"suite": " --out DIR", "trace": " --out DIR/trace.json"}.get(name, "")
    return "python -m rdma_device.bench " + " ".join(args) + out + plot


def repo_root():
    """The checkout this package lives in, else the current directory if
    it is one (an installed copy run from the checkout), else None."""
    def is_root(d):
        return os.path.exists(os.path.join(d, "Cargo.toml")) and os.path.exists(os.path.join(d, "README.md"))

    d = os.path.dirname(os.path.abspath(__file__))
    for _ in range(4):
        d = os.path.dirname(d)
        if is_root(d):
            return d
    return os.getcwd() if is_root(os.getcwd()) else None


def fabric_binary(root):
    cand = os.environ.get("RDMA_DEVICE_BENCH_BIN") or (
        os.path.join(root, "target", "release", "rdma-device-bench") if root else "")
    if cand and os.access(cand, os.X_OK):
        return cand
    return shutil.which("rdma-device-bench")


def commit(root):
    if not root:
        return "unknown (not a git checkout)"
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return (head or "unknown") + (" with uncommitted changes" if dirty else "")


# What the measured libraries and binaries are built from.
_SOURCES = ("src", "tf_plugin", "include", "Cargo.toml", "Cargo.lock", "CMakeLists.txt", "build.rs", "cmake")


def stale_build(root, fabric=True):
    """Why the libraries (and, with `fabric`, the fabric benchmark's
    binary) this report would measure are older than the checkout's
    sources, or None: a report must measure the tree it stamps. Compares
    modification times: the newest tracked source file against the oldest
    built artefact."""
    if not root:
        return None
    import rdma_device

    built = [os.path.join(rdma_device.lib_dir(), n) for n in ("librdma_device.so", "librdma_device_tf.so")]
    bench = fabric_binary(root) if fabric else None
    if bench:
        built.append(bench)
    have = [(os.path.getmtime(b), b) for b in built if os.path.exists(b)]
    if not have:
        return "no built library found"
    try:
        files = subprocess.run(["git", "-C", root, "ls-files", "--", *_SOURCES], capture_output=True, text=True,
                               timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    newest = max(((os.path.getmtime(os.path.join(root, f)), f) for f in files
                  if os.path.exists(os.path.join(root, f))), default=None)
    oldest = min(have)
    if newest and newest[0] > oldest[0]:
        return (f"{newest[1]} changed after {oldest[1]} was built "
                f"({time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(newest[0]))} against "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(oldest[0]))} UTC)")
    return None


def machine():
    from rdma_device.bench.suite_report import cpus_and_kernel

    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(l.split()[1] for l in f if l.startswith("MemTotal")))
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    osname = ""
    try:
        with open("/etc/os-release") as f:
            osname = next((l.split("=", 1)[1].strip().strip('"') for l in f if l.startswith("PRETTY_NAME")), "")
    except OSError:
        pass
    try:
        from importlib import metadata

        tf = next((f"TensorFlow {metadata.version(d)}" for d in ("tensorflow-cpu", "tensorflow")
                   if _has(metadata, d)), "TensorFlow ?")
    except ImportError:
        tf = "TensorFlow ?"
    return f"{cpus_and_kernel()}{mem}, {osname or platform.platform()}, Python {platform.python_version()}, {tf}"


def _has(metadata, dist):
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _argv(name, quick, run_dir, root, run=0):
    if name in report_scripts.SCRIPTS:
        if not root:
            raise FileNotFoundError(f"{name} runs a script of a checkout, and this is not one")
        return report_scripts.argv(name, run)
    if name == "fabric":
        binary = fabric_binary(root)
        if not binary:
            raise FileNotFoundError("rdma-device-bench not found: build it with `cargo build --release --bins`"
                                    " or set RDMA_DEVICE_BENCH_BIN")
        return [binary, "fabric", "--transport", "shm", "--json"] + (["--quick"] if quick else [])
    if name in TESTS:
        if not root:
            raise FileNotFoundError(f"{name} runs tests/ from a checkout, and this is not one")
        return [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", os.path.join(root, TESTS[name])]
    if name in EXAMPLES:
        if not root:
            raise FileNotFoundError(f"{name} runs examples/ from a checkout, and this is not one")
        script, *rest = EXAMPLES[name][1 if quick else 0]
        return [sys.executable, os.path.join(root, "examples", script)] + rest
    args = list(PY_BENCHES[name][1 if quick else 0])
    if name == "suite":
        args += ["--out", run_dir]
    if name == "trace":
        args += ["--out", os.path.join(run_dir, "trace.json")]
    if name in PLOTS and not quick:
        args += ["--plot", os.path.join(run_dir, PLOTS[name])]
    return [sys.executable, "-m", "rdma_device.bench"] + args


def _rows(stdout, console=False):
    """The JSON rows among a run's output. A VM's console (`console`) also
    has the kernel's lines, "[   18.7] ...": there a line that is not
    JSON is output, not a row."""
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith(("{", "[")):
            continue
        try:
            got = json.loads(line)
        except ValueError:
            if console:
                continue
            raise
        rows.extend(r for r in (got if isinstance(got, list) else [got]) if isinstance(r, dict))
    return rows


def _one(name, i, quick, out, root, timeout):
    run_dir = os.path.join(out, "raw", f"{name}-{i}")
    os.makedirs(run_dir, exist_ok=True)
    rec = {"bench": name, "run": i, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "load_before": os.getloadavg()[0]}
    t0 = time.monotonic()
    try:
        argv = _argv(name, quick, run_dir, root, i)
        rec["argv"] = [os.path.basename(argv[0])] + argv[1:]
        env = report_scripts.SCRIPTS[name][1] if name in report_scripts.SCRIPTS else {}
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                           cwd=root if name in report_scripts.SCRIPTS else None,
                           env={**os.environ, **env} if env else None)
        with open(os.path.join(run_dir, "stdout.txt"), "w") as f:
            f.write(p.stdout)
        with open(os.path.join(run_dir, "stderr.txt"), "w") as f:
            f.write(p.stderr)
        rec["rows"] = _rows(p.stdout, console=name in report_scripts.SCRIPTS)
        if p.returncode != 0 or not rec["rows"]:
            rec["error"] = f"exit {p.returncode}: {p.stderr.strip()[-500:]}"
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        rec.setdefault("rows", [])
    rec["seconds"] = round(time.monotonic() - t0, 1)
    rec["load_after"] = os.getloadavg()[0]
    return rec


def _load(records, name):
    """The 1-minute load average over `name`'s runs (before and after
    each), as "a–b", or "" when not recorded."""
    loads = [r[k] for r in records if r["bench"] == name for k in ("load_before", "load_after") if k in r]
    if not loads:
        return ""
    lo, hi = min(loads), max(loads)
    return f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}–{hi:.1f}"


def _header(meta, name, runs_ok, records=()):
    runs = f"{meta['runs']} run{'s' if meta['runs'] != 1 else ''}"
    load = _load(records, name)
    cpus = os.cpu_count() or 0
    cells = ("Cells are the median over the runs with their range (min–max), and counts of failures summed "
             "over the runs." if name in report_scripts.SCRIPTS else
             "Cells are medians over the runs of each run's own median; ratios are the median of the per-run "
             "ratios, with their range.")
    busy = (f" 1-minute load average {load} just before and after its runs (the benchmarks' own processes, "
            f"this one's and the one before it, count in it; on {cpus} CPUs, above {cpus} means runnable "
            f"threads waited for a CPU)." if load else "")
    return (f"Generated by `python -m rdma_device.bench report` ({runs} per benchmark in randomised "
            f"interleaved order, seed {meta['seed']}; here {runs_ok} completed), {meta['date']}, {meta['machine']}, "
            f"commit {meta['commit']}. Each run: `{command(name, meta['quick'])}`. {cells}{busy}")


def _fabric_plot(runs, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    agg = report_tables.aggregate(runs, lambda r: r["size"])
    sizes = list(agg)
    fig, ax = plt.subplots(figsize=(7, 4))
    for field, label in (("gbps", "one-sided write"), ("memcpy_gbps", "memcpy, threads as the write"),
                         ("memcpy1_gbps", "memcpy, 1 thread")):
        ax.plot(sizes, [agg[s][field][0] for s in sizes], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per write")
    ax.set_ylabel("GB/s (median over runs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# What a generated block's numbers depend on: a commit touching one of
# these after the block's stamped commit makes the block stale. The
# report's own modules do not count: they run the command each block names
# in its header and render the tables (`--render` renders a saved run
# again); the benchmarks and the library they run do.
CODE_PATHS = ("src", "tf_plugin", "python", "Cargo.toml", "Cargo.lock", "CMakeLists.txt", "include", "cmake",
              ":(exclude,glob)python/rdma_device/bench/report*.py")
# The endpoint API's own modules: only the blocks that measure it depend
# on them. TensorFlow's benchmarks never import them (the package loads
# the endpoint API on first use), and the fabric benchmark is Rust.
ENDPOINT_API = tuple(f"python/rdma_device/{m}" for m in (
    "endpoint.py", "_ops.py", "_dtypes.py", "_ready.py", "_capi.py", "bench/pybench.py", "bench/pybench_plot.py"))
ENDPOINT_BLOCKS = ("py", "py_rpc", "param_server")
# A block measured by a test also depends on the test and what it runs.
BLOCK_PATHS = {"allocs": ("tests/python/test_allocs.py", "tests/python/alloc_scenarios.py",
                          "tests/python/malloc_count", "tests/python/harness.py"),
               "param_server": ("examples/param_server.py",),
               **{n: s[2] for n, s in report_scripts.SCRIPTS.items()}}
_STAMP = re.compile(r"\((\d+) runs? per benchmark.*?commit ([0-9a-f]{7,40})\b", re.S)


def stale_blocks(root):
    """Every generated block of README.md and docs/*.md that is not fresh:
    [(document, benchmark, why)]. Stale: code changed (CODE_PATHS) after
    the commit the block is stamped with, the stamp is unknown to git, or
    it was made from fewer than 3 runs."""
    found = []
    begin = re.compile(r"<!-- report:(\S+) begin -->\n(.*?)<!-- report:\1 end -->", re.S)
    for path in _documents(root):
        with open(path) as f:
            text = f.read()
        doc = os.path.relpath(path, root)
        for m in begin.finditer(text):
            name, body = m.group(1), m.group(2)
            stamp = _STAMP.search(body)
            if not stamp:
                found.append((doc, name, "no run count and commit stamp in its header"))
                continue
            runs, rev = int(stamp.group(1)), stamp.group(2)
            paths = (*CODE_PATHS, *BLOCK_PATHS.get(name, ()),
                     *(() if name in ENDPOINT_BLOCKS else (f":(exclude){p}" for p in ENDPOINT_API)))
            p = subprocess.run(["git", "-C", root, "log", "--format=%h %s", f"{rev}..HEAD", "--", *paths],
                               capture_output=True, text=True)
            if p.returncode != 0:
                found.append((doc, name, f"stamped commit {rev} is not in this repository's history"))
                continue
            changed = p.stdout.splitlines()
            if changed:
                found.append((doc, name, f"generated at {rev}; {len(changed)} commit(s) changed code since, "
                                         f"the latest: {changed[0]}"))
            elif runs < 3:
                found.append((doc, name, f"generated from {runs} run(s) per benchmark (at least 3 are needed)"))
    return found


def check_stale(root):
    """`bench report --check`: list the stale generated blocks; exit 1 if any."""
    if not root:
        raise SystemExit("bench report --check: not in a checkout")
    found = stale_blocks(root)
    for doc, name, why in found:
        print(f"stale: {doc}: {name}: {why}")
    print(f"bench report --check: {len(found)} stale generated block(s)"
          + ("; regenerate with `python -m rdma_device.bench report`" if found else ""))
    return 1 if found else 0


def report(args):
    root = repo_root()
    if getattr(args, "check", False):
        return check_stale(root)
    if args.render:
        # Tables, report.md and the README again from a finished run's
        # report.json (nothing is measured).
        with open(os.path.join(args.render, "report.json")) as f:
            saved = json.load(f)
        meta, records = saved["meta"], saved["records"]
        names = [n for n in ORDER if any(r["bench"] == n for r in records)]
        return _render(meta, records, names, args.render, root, args)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(ORDER)
    if args.quick and not args.only:
        # CI runs the fuzzer, the simulation and the VM scripts in sections
        # of their own (.ci/test.sh).
        names = [n for n in names if n not in report_scripts.SCRIPTS]
    # The scripts build what they run themselves.
    measured = [n for n in names if n not in report_scripts.SCRIPTS]
    stale = None if args.allow_stale_build or not measured else stale_build(root, "fabric" in names)
    if stale:
        raise SystemExit(
            f"bench report: the build is older than the tree: {stale}. Rebuild what it measures first "
            f"(pip install --no-build-isolation ./python; cargo build --release --bin rdma-device-bench), "
            f"or pass --allow-stale-build to measure it anyway (the report then says so)")
    for n in names:
        if n not in ORDER:
            raise SystemExit(f"unknown benchmark {n!r}; choose from {', '.join(ORDER)}")
    runs = args.runs or (1 if args.quick else 3)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    out = args.out or ("bench_report_quick" if args.quick else "bench_report")
    os.makedirs(out, exist_ok=True)
    jobs = [(n, i) for n in names for i in range(runs)]
    random.Random(seed).shuffle(jobs)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "commit": commit(root) + (" (build older than the tree: measured anyway)"
                                       if args.allow_stale_build and stale_build(root, "fabric" in names) else ""),
            "runs": runs, "seed": seed, "quick": bool(args.quick),
            "order": [f"{n}#{i}" for n, i in jobs]}
    print(f"bench report: {len(jobs)} runs in this order: {', '.join(meta['order'])}", flush=True)
    t0 = time.monotonic()
    records = []
    for n, i in jobs:
        rec = _one(n, i, args.quick, out, root, args.timeout)
        records.append(rec)
        status = rec.get("error", f"{len(rec['rows'])} rows")
        print(f"  {n} run {i + 1}/{runs}: {rec['seconds']} s (load {rec['load_before']:.1f}): {status}", flush=True)
    meta["seconds"] = round(time.monotonic() - t0, 1)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    return _render(meta, records, names, out, root, args)


def _render(meta, records, names, out, root, args):
    runs, seed = meta["runs"], meta["seed"]
    md = [f"# bench report\n\n{meta['date']} – {meta['finished']} ({meta['seconds']:.0f} s), {meta['machine']}, "
          f"commit {meta['commit']}, {runs} run{'s' if runs != 1 else ''} each{' (--quick)' if meta['quick'] else ''}, "
          f"order seed {seed}.\n"]
    tables = {}
    for n in names:
        ok = [r["rows"] for r in records if r["bench"] == n and "error" not in r]
        failed = [r["error"] for r in records if r["bench"] == n and "error" in r]
        md.append(f"## {n}\n")
        if ok:
            tables[n] = RENDER[n](ok)
            md.append(_header(meta, n, len(ok), records) + "\n\n" + tables[n] + "\n")
        for e in failed:
            md.append(f"- a run failed: {e}\n")
        if n == "suite" and ok:
            for extra, table in report_suite.tables(records, out).items():
                tables[extra] = table
                md.append(f"## {extra}\n\n" + _header(meta, n, len(ok), records) + "\n\n" + table + "\n")
    if "fabric" in tables:
        png = _fabric_plot([r["rows"] for r in records if r["bench"] == "fabric" and "error" not in r],
                           os.path.join(out, "fabric.png"))
        if png:
            md.append(f"![fabric](fabric.png)\n")
    text = "\n".join(md)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    if not meta["quick"] and not args.no_readme:
        _rewrite_readme(root, meta, tables, records, out)
    failed = sum("error" in r for r in records)
    print(f"bench report: {len(records) - failed} of {len(records)} runs completed in {meta['seconds']:.0f} s; "
          f"{os.path.join(out, 'report.md')}", flush=True)
    return 1 if failed else 0


def _documents(root):
    """README.md and docs/*.md: where generated regions may be."""
    paths = [os.path.join(root, "README.md")]
    d = os.path.join(root, "docs")
    if os.path.isdir(d):
        paths += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".md"))
    return paths


def _rewrite_readme(root, meta, tables, records, out):
    if not root:
        print("bench report: not in a checkout: README and docs/ left alone")
        return
    texts = {}
    for path in _documents(root):
        with open(path) as f:
            texts[path] = f.read()
    for n, table in tables.items():
        bench = report_suite.EXTRAS.get(n, n)
        ok = sum(1 for r in records if r["bench"] == bench and "error" not in r)
        body = _header(meta, bench, ok, records) + "\n\n" + table
        for path, text in texts.items():
            new = report_tables.replace_region(text, n, body)
            if new is not None:
                texts[path] = new
                break
        else:
            print(f"bench report: no document has {report_tables.marker(n)} markers: {n}'s table is only in report.md")
    for path, text in texts.items():
        with open(path, "w") as f:
            f.write(text)
    docs = os.path.join(root, "docs", "eval")
    os.makedirs(docs, exist_ok=True)
    if os.path.exists(os.path.join(out, "fabric.png")):
        shutil.copy(os.path.join(out, "fabric.png"), docs)
    for n in ("suite", *PLOTS):
        ok = [r for r in records if r["bench"] == n and "error" not in r]
        if ok:
            # The plots of the benchmark's last run.
            last = os.path.join(out, "raw", f"{n}-{ok[-1]['run']}")
            for f in os.listdir(last):
                if f.endswith(".png"):
                    shutil.copy(os.path.join(last, f), docs)
    print(f"bench report: the generated regions of README.md and docs/*.md, and {docs}, rewritten")


def add_parser(sub):
    r = sub.add_parser("report", help="every benchmark the README quotes, N runs each, interleaved; README tables")
    r.add_argument("--quick", action="store_true",
                   help="fewer runs and smaller settings, written only to --out (CI)")
    r.add_argument("--runs", type=int, default=None, help="runs per benchmark (default 3; 1 with --quick)")
    r.add_argument("--out", default=None, help="output directory (default ./bench_report[_quick])")
    r.add_argument("--only", default="", help=f"comma-separated subset of {','.join(ORDER)}")
    r.add_argument("--seed", type=int, default=None, help="seed of the run order (default: random, recorded)")
    r.add_argument("--timeout", type=int, default=7200, help="seconds one benchmark run may take")
    r.add_argument("--no-readme", action="store_true", help="leave README.md and docs/ alone")
    r.add_argument("--allow-stale-build", action="store_true",
                   help="measure even when the libraries or the benchmark binary are older than the sources")
    r.add_argument("--check", action="store_true",
                   help="measure nothing: list every generated block of README.md and docs/ made before a code "
                        "change or from fewer than 3 runs (exit 1 if any)")
    r.add_argument("--render", default="", metavar="DIR",
                   help="measure nothing: write the tables (and the README's regions) again from DIR/report.json")
    return report
