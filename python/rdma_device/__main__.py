"""python -m rdma_device: print the effective configuration and counters."""
import json

import rdma_device

print(json.dumps({"config": rdma_device.config(), "stats": rdma_device.stats()}, indent=2))
