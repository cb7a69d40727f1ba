"""python -m rdma_device: print the effective configuration and counters.

python -m rdma_device config [--markdown]: the settings alone (JSON), or
their table (variable, default, help) in Markdown, as in
docs/configuration.md.

python -m rdma_device doctor [...]: check this host, or a pair of hosts
(see ``python -m rdma_device doctor --help``).
"""
import json
import sys

if len(sys.argv) > 1 and sys.argv[1] == "doctor":
    from rdma_device.doctor.cli import main

    sys.exit(main(sys.argv[2:]))

import rdma_device  # noqa: E402

if len(sys.argv) > 1 and sys.argv[1] == "config":
    import argparse

    from rdma_device import _config_doc

    ap = argparse.ArgumentParser(prog="python -m rdma_device config",
                                 description="The RDMA_DEVICE_* settings: value, default and help of each.")
    ap.add_argument("--markdown", action="store_true", help="their table (variable, default, help) in Markdown")
    args = ap.parse_args(sys.argv[2:])
    cfg = rdma_device.config()
    sys.stdout.write(_config_doc.markdown(cfg) if args.markdown else json.dumps(cfg, indent=2) + "\n")
    sys.exit(0)

print(json.dumps({"config": rdma_device.config(), "stats": rdma_device.stats()}, indent=2))
