"""python -m rdma_device.doctor: the same as python -m rdma_device doctor."""

import sys

from rdma_device.doctor.cli import main

sys.exit(main())
