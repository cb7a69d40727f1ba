#!/usr/bin/env bash
# The whole test suite: Rust unit, conformance, multi-process, hostile-input
# and C ABI tests; the TensorFlow cluster tests; the verbs tests on real
# Soft-RoCE inside a qemu VM. Installs what it needs first (.ci/setup.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}
cd "$ROOT"
bash .ci/setup.sh
# PyTorch, for the endpoint API's DLPack test with torch tensors and the gloo
# baseline of `bench py` (CPU only; PyPI's wheel with its CUDA libraries is
# about 5 GB, downloaded once into the venv; the main job does not need it).
TORCH_VERSION=2.15.0
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" >/dev/null 2>&1; then
  echo "== installing torch==$TORCH_VERSION into $VENV (downloaded once)"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
fi

echo "== Rust tests (cargo test --features verbs; verbs device tests run in the VM below)"
cargo test --features verbs
echo "== the shm-only build (no rdma-core needed): its own tests (cargo test, no features)"
cargo test

echo "== coverage-guided fuzzing of every peer-fed decoder and the protocol state machine (60 s)"
bash tests/fuzz/run.sh 60

echo "== the wheel: built, installed into a fresh venv without build tools, a 2-task job with RDMA_DEVICE_STRICT=1"
RDMA_DEVICE_CMAKE_BUILD_DIR="$ROOT/build/python-package" bash .ci/wheel.sh

echo "== TensorFlow cluster tests (pytest)"
"$VENV/bin/python" -m pytest -q tests/python

echo "== bench report --quick: every benchmark the README quotes, once, small (tables to a temporary dir, not committed)"
report_dir=$(mktemp -d)
"$VENV/bin/python" -m rdma_device.bench report --quick --out "$report_dir"
rm -rf "$report_dir"

echo "== verbs on Soft-RoCE (qemu VM)"
bash tests/softroce/run.sh

echo "== verbs between two VMs (two rxe devices on one virtual L2, SIGKILL of either side)"
bash tests/softroce/two_hosts.sh

echo "== the node, multi-process and hostile-input suites over verbs (Soft-RoCE VM)"
bash tests/softroce/suites_over_verbs.sh
