#!/usr/bin/env bash
# The main job: on this machine, start local TensorFlow clusters with stock
# "grpc" and with "grpc+rdma_device" side by side, move tensors of 4 KiB to
# 64 MiB task to task, run a short parameter-server training under both,
# an all-reduce across 2 and 3 MultiWorkerMirroredStrategy workers,
# then the evaluation suite (six workloads, every mode, 1/2/4 workers,
# communication/compute breakdown, colour plots), and print the comparison.
# Installs what it needs first (.ci/setup.sh). The suite's outputs go to
# suite-results/ (override with RDMA_DEVICE_SUITE_OUT).
#
#   bash examples/main_job.sh [--quick] [--verbose] [transfer options]
#
# --quick: fewer sizes and repetitions everywhere (a functional run: minutes).
# --verbose: keep TensorFlow's C++ log lines (by default they stay off the
# terminal: TF_CPP_MIN_LOG_LEVEL=2 and a filter for the lines written before
# that applies). Headings, progress (stderr) and each table once (stdout).
set -euo pipefail
QUICK=0
ARGS=()
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    --verbose) export RDMA_DEVICE_VERBOSE=1 ;;
    *) ARGS+=("$a") ;;
  esac
done
if [ "$QUICK" = 1 ]; then
  TRANSFER=(--sizes 4K,1M,16M --reps 2 --block 3); TRAIN=(--steps 20)
  ALLREDUCE=(--sizes 1M,16M --workers 2 --reps 2 --block 2); SUITE=(--reps 2 --workers 1,2 --sweep-sizes 64K,16M)
  FABRIC=(--quick)
else
  TRANSFER=(); TRAIN=(); ALLREDUCE=(); SUITE=(); FABRIC=()
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}
[ "${RDMA_DEVICE_SKIP_SETUP:-0}" = 1 ] || bash "$ROOT/.ci/setup.sh"
cd "$ROOT"
echo
echo "== one-sided write device (shm) vs memcpy"
./target/release/rdma-device-bench fabric ${FABRIC[@]+"${FABRIC[@]}"}
echo
echo "== tensor transfer: stock grpc vs grpc+rdma_device"
"$VENV/bin/python" -m rdma_device.bench transfer ${TRANSFER[@]+"${TRANSFER[@]}"} ${ARGS[@]+"${ARGS[@]}"}
echo
echo "== parameter-server training: stock grpc vs grpc+rdma_device"
"$VENV/bin/python" -m rdma_device.bench train ${TRAIN[@]+"${TRAIN[@]}"}
echo
echo "== MultiWorkerMirroredStrategy all-reduce: stock grpc vs grpc+rdma_device"
"$VENV/bin/python" -m rdma_device.bench allreduce ${ALLREDUCE[@]+"${ALLREDUCE[@]}"}
echo
echo "== evaluation suite (--quick): workloads x modes x workers"
OUT=${RDMA_DEVICE_SUITE_OUT:-$ROOT/suite-results}
"$VENV/bin/python" -m rdma_device.bench suite --quick ${SUITE[@]+"${SUITE[@]}"} --out "$OUT"
echo
echo "results: $OUT/results.json, $OUT/summary.md; plots: $OUT/*.png"
