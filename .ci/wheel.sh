#!/usr/bin/env bash
# The wheel as a user installs it: built by the documented command, installed
# into a fresh venv whose PATH has no cargo, cmake or compiler, then a
# 2-task job (examples/run_local.sh mwms) with RDMA_DEVICE_STRICT=1.
#
# TensorFlow for the fresh venv comes from a wheelhouse cached outside the
# repository (~/.cache/rdma_device/wheelhouse, downloaded once with
# `pip download`); later runs install offline from it.
#
# Environment: RDMA_DEVICE_VENV (the build venv, as .ci/setup.sh makes it),
# RDMA_DEVICE_CMAKE_BUILD_DIR (reuse a configured shim build; CI passes the
# one setup.sh made, so the wheel costs no second compile).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}
HOUSE=${RDMA_DEVICE_WHEELHOUSE:-$HOME/.cache/rdma_device/wheelhouse}
export RDMA_DEVICE_CMAKE_BUILD_DIR=${RDMA_DEVICE_CMAKE_BUILD_DIR:-$ROOT/build/python-package}
cd "$ROOT"
rm -rf dist
# The documented command (README, "Install"):
PATH="$VENV/bin:$PATH" "$VENV/bin/pip" wheel -q --no-build-isolation --no-deps -w dist ./python
WHEEL=$(ls dist/rdma_device-*.whl)
echo "built $WHEEL"
REQ=$(unzip -p "$WHEEL" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p')
echo "it requires: $REQ"
if ! ls "$HOUSE" 2>/dev/null | grep -q "^${REQ%%==*}-${REQ##*==}-"; then
  "$VENV/bin/pip" download -q -d "$HOUSE" "$REQ"
fi
FRESH=$(mktemp -d)
trap 'rm -rf "$FRESH"' EXIT
python3 -m venv "$FRESH/venv"
# No build tools from here on: the venv's bin and the shell's basics only.
TOOLS="$FRESH/tools"; mkdir -p "$TOOLS"
for t in bash sh env mktemp rm cat grep sed head tail seq timeout sleep kill dirname; do ln -s "$(command -v $t)" "$TOOLS/$t"; done
CLEAN_PATH="$FRESH/venv/bin:$TOOLS"
for t in cargo rustc cmake cc gcc g++ c++ make ld; do
  if PATH=$CLEAN_PATH command -v "$t" >/dev/null; then echo "$t is on the fresh PATH" >&2; exit 1; fi
done
env PATH="$CLEAN_PATH" "$FRESH/venv/bin/pip" install -q --no-index --find-links "$HOUSE" "$WHEEL"
cd "$FRESH"  # not the repository: the installed package, not python/
env PATH="$CLEAN_PATH" python -c "import rdma_device, sys; print('installed:', rdma_device.__file__); sys.exit('python/' in rdma_device.__file__)"
env PATH="$CLEAN_PATH" PYTHON="$FRESH/venv/bin/python" bash "$ROOT/examples/run_local.sh" mwms 2 | tee "$FRESH/out"
grep -q '"fallback_tensors": 0' "$FRESH/out"
[ "$(grep -c '"collective_tensors": [1-9]' "$FRESH/out")" = 2 ]
echo "wheel: installs without build tools and runs a 2-task job over the transport"
