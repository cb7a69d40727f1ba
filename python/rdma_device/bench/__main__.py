"""python -m rdma_device.bench: see rdma_device.bench.cli."""

import sys

from rdma_device.bench.cli import main

sys.exit(main())
