#!/usr/bin/env bash
# The main job: on this machine, start local TensorFlow clusters with stock
# "grpc" and with "grpc+rdma_device" side by side, move tensors of 4 KiB to
# 64 MiB task to task, run a short parameter-server training under both,
# an all-reduce across 2 and 3 MultiWorkerMirroredStrategy workers,
# then the evaluation suite (six workloads, every mode, 1/2/4 workers,
# communication/compute breakdown, colour plots), and print the comparison.
# Installs what it needs first (.ci/setup.sh). The suite's outputs go to
# suite-results/ (override with RDMA_DEVICE_SUITE_OUT).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}
bash "$ROOT/.ci/setup.sh"
cd "$ROOT"
echo
echo "== one-sided write device (shm) vs memcpy"
./target/release/rdma-device-bench fabric
echo
echo "== tensor transfer: stock grpc vs grpc+rdma_device"
"$VENV/bin/python" -m rdma_device.bench transfer "$@"
echo
echo "== parameter-server training: stock grpc vs grpc+rdma_device"
"$VENV/bin/python" -m rdma_device.bench train
echo
echo "== MultiWorkerMirroredStrategy all-reduce: stock grpc vs grpc+rdma_device"
"$VENV/bin/python" -m rdma_device.bench allreduce
echo
echo "== evaluation suite (--quick): workloads x modes x workers"
OUT=${RDMA_DEVICE_SUITE_OUT:-$ROOT/suite-results}
"$VENV/bin/python" -m rdma_device.bench suite --quick --out "$OUT"
echo
echo "results: $OUT/results.json, $OUT/summary.md; plots: $OUT/*.png"
