#!/usr/bin/env bash
# The whole test suite: Rust unit, conformance, multi-process, hostile-input
# and C ABI tests; the TensorFlow cluster tests; the verbs tests on real
# Soft-RoCE inside a qemu VM. Installs what it needs first (.ci/setup.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}
cd "$ROOT"
bash .ci/setup.sh

echo "== Rust tests (cargo test)"
cargo test

echo "== TensorFlow cluster tests (pytest)"
"$VENV/bin/python" -m pytest -q tests/python

echo "== verbs on Soft-RoCE (qemu VM)"
bash tests/softroce/run.sh
