#!/usr/bin/env bash
# The whole test suite: Rust unit, conformance, multi-process, hostile-input
# and C ABI tests; the TensorFlow cluster tests; the verbs tests on real
# Soft-RoCE inside a qemu VM. Installs what it needs first (.ci/setup.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}
cd "$ROOT"
# Each section prints how long the one before it took.
SECONDS=0
section() {
  [ -n "${SECTION:-}" ] && echo "== ($SECTION: ${SECONDS} s)"
  SECTION=$1
  SECONDS=0
  echo "== $1"
}
trap '[ -n "${SECTION:-}" ] && echo "== ($SECTION: ${SECONDS} s)"' EXIT
# Rust tests that check nothing on this machine say so (tests/common's
# `skipped`); libtest counts them as passed, so they are listed after each
# Rust section instead.
export RDMA_DEVICE_SKIP_LOG="$(mktemp)"
show_skips() {
  if [ -s "$RDMA_DEVICE_SKIP_LOG" ]; then
    echo "-- skipped (ran, checked nothing here): $(wc -l <"$RDMA_DEVICE_SKIP_LOG") test(s)"
    sort "$RDMA_DEVICE_SKIP_LOG" | sed 's/^/   /'
    : >"$RDMA_DEVICE_SKIP_LOG"
  fi
}
section "set-up (.ci/setup.sh, torch)"
bash .ci/setup.sh
# PyTorch, for the endpoint API's DLPack test with torch tensors and the gloo
# baseline of `bench py` (CPU only; PyPI's wheel with its CUDA libraries is
# about 5 GB, downloaded once into the venv; the main job does not need it).
TORCH_VERSION=2.15.0
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" >/dev/null 2>&1; then
  echo "== installing torch==$TORCH_VERSION into $VENV (downloaded once)"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"
fi

# Before the long sections: documentation that no longer matches the tree.
section "documentation: relative links resolve, the configuration table is the library's; no import circle between Rust modules, none between Python modules and no Python function defined twice (.ci/check_*.py)"
python3 .ci/check_links.py
python3 .ci/check_rust_modules.py
python3 .ci/check_python_imports.py
"$VENV/bin/python" .ci/check_config_table.py

section "Rust tests (cargo test --features verbs; verbs device tests run in the VM below)"
cargo test --features verbs
show_skips
# The shm-only build differs from the one above only where the verbs
# backend is compiled in or out (src/fabric/mod.rs: which backends exist;
# tests/fabric_verbs.rs): its unit tests, the C ABI (transport choice and
# errors), the shm fabric and the node end to end prove it; the other
# suites run the same code in both builds and ran above.
section "the shm-only build (no rdma-core needed): unit, C ABI, shm fabric and node tests (no features)"
cargo test --lib --test c_abi --test fabric_shm --test node_shm --test header
show_skips

section "schedule exploration of the call channel and of streamed and written tensors with aborts, lost links and shutdowns (shuttle: random and PCT schedules)"
cargo test --features shuttle --lib sched

section "deterministic simulation with faults (300 seeds, 600 schedules)"
cargo run --release --quiet --features sim --bin rdma-device-sim -- --seeds 300

section "coverage-guided fuzzing of every peer-fed decoder and the protocol state machine (60 s)"
bash tests/fuzz/run.sh 60

section "the wheel: built, installed into a fresh venv without build tools, a 2-task job with RDMA_DEVICE_STRICT=1"
RDMA_DEVICE_CMAKE_BUILD_DIR="$ROOT/build/python-package" bash .ci/wheel.sh

section "TensorFlow cluster tests (pytest)"
# --durations: the slowest tests, so a suite that grows slower shows where.
"$VENV/bin/python" -m pytest -q --durations=15 tests/python

section "bench report --quick: every benchmark the README quotes, once, small (tables to a temporary dir, not committed)"
report_dir=$(mktemp -d)
"$VENV/bin/python" -m rdma_device.bench report --quick --out "$report_dir"
rm -rf "$report_dir"
# Generated blocks in README.md and docs/ made before a code change, or
# from fewer than 3 runs: listed (regenerating them takes hours, not CI's).
"$VENV/bin/python" -m rdma_device.bench report --check || echo "(the blocks above are stale: regenerate them with python -m rdma_device.bench report)"

section "verbs on Soft-RoCE (qemu VM)"
bash tests/softroce/run.sh

section "verbs between two VMs (two rxe devices on one virtual L2, SIGKILL of either side)"
bash tests/softroce/two_hosts.sh

section "the node, multi-process and hostile-input suites over verbs (Soft-RoCE VM)"
bash tests/softroce/suites_over_verbs.sh
