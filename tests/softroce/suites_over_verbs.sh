#!/usr/bin/env bash
# The node-level suites over verbs on Soft-RoCE: run.sh with the test
# targets node_shm (the protocol end to end between two or three nodes),
# multiprocess (thousands of tensors between processes, SIGKILL of either
# side), malformed (hostile control messages, bogus writes, bad
# handshakes) and context_lifecycle (a receive cancelled alone; callbacks
# run on the verbs progress thread, a context freed inside one), their nodes on the VM's rxe0 address with only verbs allowed
# (tests/common: RDMA_DEVICE_TEST_HOST, RDMA_DEVICE_TRANSPORTS).
# hostile_peers stays shm-only: it attacks shm mechanisms (abstract-socket
# uid checks, raw Unix-socket handshakes, scribbling on the shm arena).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SOFTROCE_TESTS="${SOFTROCE_TESTS:-node_shm multiprocess malformed context_lifecycle}" \
SOFTROCE_ENV="RDMA_DEVICE_TEST_HOST=10.0.2.15 RDMA_DEVICE_TRANSPORTS=verbs RDMA_DEVICE_LOG=warn ${SOFTROCE_ENV:-}" \
SOFTROCE_HOST_CHECKS="${SOFTROCE_HOST_CHECKS:-0}" \
SOFTROCE_TIMEOUT="${SOFTROCE_TIMEOUT:-1200}" \
    exec "$here/run.sh" "$@"
