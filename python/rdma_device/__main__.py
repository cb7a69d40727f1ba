"""python -m rdma_device: print the effective configuration and counters.

python -m rdma_device doctor [...]: check this host, or a pair of hosts
(see ``python -m rdma_device doctor --help``).
"""
import json
import sys

if len(sys.argv) > 1 and sys.argv[1] == "doctor":
    from rdma_device import doctor

    sys.exit(doctor.main(sys.argv[2:]))

import rdma_device  # noqa: E402

print(json.dumps({"config": rdma_device.config(), "stats": rdma_device.stats()}, indent=2))
