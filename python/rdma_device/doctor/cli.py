"""python -m rdma_device doctor: is this host (and a pair of hosts) ready?

    python -m rdma_device doctor [--addr HOST] [--json]
    python -m rdma_device doctor --listen PORT [--addr HOST]     (one host)
    python -m rdma_device doctor --peer HOST:PORT [--quick]      (the other)

The host checks: RDMA devices and their ports, a RoCE v2 GID on the
interface that carries the task's address, the MTU, the memlock limit
against the arena, userfaultfd (the sender's registration cache), shared
memory against the arena, the libraries built for the running TensorFlow
and the plugin loading. Each prints ✓ or ✗ (``!``: works, but slower or
riskier than it should; ``-``: does not apply here) with a one-line fix.
The host checks live in ``rdma_device.doctor.host``, the pair test
(``--listen``/``--peer``) in ``rdma_device.doctor.pair``. The exit
status is 1 when any check failed.

The task's address is ``--addr``, else this task's entry in ``TF_CONFIG``,
else the address of the interface that carries the default route.
"""

import argparse
import json

from rdma_device import _quiet
from rdma_device.doctor.checks import FAIL, print_results
from rdma_device.doctor.host import host_checks


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m rdma_device doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--addr", help="this task's address (HOST or HOST:PORT; default: TF_CONFIG, else the "
                    "default route's interface)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the list")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--listen", type=int, metavar="PORT", help="wait for one `doctor --peer` and serve its test")
    g.add_argument("--peer", metavar="HOST:PORT", help="test the pair with a host running `doctor --listen`")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (--peer)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds --listen waits for its peer (600)")
    ap.add_argument("--verbose", action="store_true", help="keep TensorFlow's C++ log lines")
    args = ap.parse_args(argv)
    _quiet.set_verbose(args.verbose)
    _quiet.filter_stderr()
    if args.listen is not None or args.peer:
        from rdma_device.doctor.pair import check_pair

        return check_pair(args)
    results = host_checks(args.addr)
    if args.json:
        print(json.dumps({"checks": results, "ok": all(r["status"] != FAIL for r in results)}, indent=2))
    else:
        print_results(results)
    return 1 if any(r["status"] == FAIL for r in results) else 0
