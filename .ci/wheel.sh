#!/usr/bin/env bash
# The wheel as a user installs it: built by the documented command, installed
# into a fresh venv whose environment has no cargo, cmake or compiler and
# nothing of the building environment (env -i: no PYTHONPATH, no
# LD_LIBRARY_PATH), then
#   1. the rpath: the installed shim, dlopen'ed before TensorFlow is
#      imported (so nothing preloads TF's libraries), must find
#      libtensorflow_*.so.2 in the fresh venv's own tensorflow/ package;
#   2. a 2-task job (examples/run_local.sh mwms) with RDMA_DEVICE_STRICT=1:
#      every tensor over the transport, the same loss on both workers.
#
# TensorFlow for the fresh venv comes from a wheelhouse cached outside the
# repository (~/.cache/rdma_device/wheelhouse, ~600 MB, downloaded once by
# the fresh venv's pip); later runs install offline from it.
#
# The building venv (RDMA_DEVICE_VENV, the shared one .ci/setup.sh makes) is
# only read: `pip wheel` builds in the repository and installs nothing, with
# PYTHONDONTWRITEBYTECODE so not even bytecode is written into it. Every
# install and download goes through the fresh venv's own pip.
#
# Environment: RDMA_DEVICE_VENV (the build venv), RDMA_DEVICE_WHEELHOUSE,
# RDMA_DEVICE_CMAKE_BUILD_DIR (reuse a configured shim build; CI passes the
# one setup.sh made, so the wheel costs no second compile).
#
# Time it adds to CI with a warm wheelhouse and built libraries: about 80 s
# of CPU (user + sys); wall 4.7 min (2026-11-25 00:12 UTC, load 9) and 6.2 min
# (00:30, load 23-27) on a shared 2-core machine. Measured with
# `time RDMA_DEVICE_CMAKE_BUILD_DIR=$PWD/build bash .ci/wheel.sh`, see the
# README ("Installing into your own environment") for the split.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}
HOUSE=${RDMA_DEVICE_WHEELHOUSE:-$HOME/.cache/rdma_device/wheelhouse}
export RDMA_DEVICE_CMAKE_BUILD_DIR=${RDMA_DEVICE_CMAKE_BUILD_DIR:-$ROOT/build/python-package}
step() { printf '%s [%3ds] %s\n' "wheel:" "$SECONDS" "$*"; }
cd "$ROOT"
rm -rf dist

step "building (the documented command, README \"Installing\")"
PATH="$VENV/bin:$PATH" PYTHONDONTWRITEBYTECODE=1 \
  "$VENV/bin/pip" wheel -q --no-build-isolation --no-deps -w dist ./python
WHEEL=$(ls "$ROOT"/dist/rdma_device-*.whl)
# The TensorFlow it was built for (other Requires-Dist lines are optional extras).
REQ=$(unzip -p "$WHEEL" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: \(tensorflow[-_a-z]*==[^;]*\)$/\1/p' | head -1)
[ -n "$REQ" ] || { echo "wheel: no tensorflow requirement in $WHEEL's metadata" >&2; exit 1; }
echo "built ${WHEEL#"$ROOT"/}, requires $REQ"
# No build-time path in the shim's run-time search path.
unzip -p "$WHEEL" rdma_device/lib/librdma_device_tf.so > dist/shim.so
RUNPATH=$(readelf -d dist/shim.so | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
rm dist/shim.so
[ "$RUNPATH" = '$ORIGIN:$ORIGIN/../../tensorflow' ] || { echo "the shim's RUNPATH is '$RUNPATH'" >&2; exit 1; }

# The fresh venv (~1.8 GB of TensorFlow) on a tmpfs when /dev/shm has room
# and allows executables: writing and deleting it on a disk mounted with
# `discard` costs minutes; RDMA_DEVICE_WHEEL_TMPDIR overrides.
TMP_FOR_VENV=${RDMA_DEVICE_WHEEL_TMPDIR:-}
if [ -z "$TMP_FOR_VENV" ]; then
  TMP_FOR_VENV=${TMPDIR:-/tmp}
  if [ -w /dev/shm ] && ! awk '$2 == "/dev/shm" && $4 ~ /(^|,)noexec(,|$)/ {f=1} END {exit !f}' /proc/mounts \
      && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -gt $((4 << 20)) ]; then
    TMP_FOR_VENV=/dev/shm
  fi
fi
FRESH=$(mktemp -d "$TMP_FOR_VENV/rdma-device-wheel.XXXXXX")
trap 'rm -rf "$FRESH"' EXIT
# The same interpreter the wheel was built for (its cp3XX tag), as a bare venv.
BASE=$("$VENV/bin/python" -c 'import sys; print(sys._base_executable)')
step "a fresh venv from $BASE in $FRESH"
"$BASE" -m venv "$FRESH/venv"
# No build tools from here on: the venv's bin and the shell's basics only.
TOOLS="$FRESH/tools"; mkdir -p "$TOOLS"
for t in bash sh env mktemp rm cat grep sed head tail seq timeout sleep kill dirname; do ln -s "$(command -v $t)" "$TOOLS/$t"; done
clean() { env -i HOME="$HOME" LANG=C.UTF-8 PATH="$FRESH/venv/bin:$TOOLS" "$@"; }
for t in cargo rustc cmake cc gcc g++ c++ make ld; do
  if clean bash -c "command -v $t" >/dev/null; then echo "$t is on the fresh PATH" >&2; exit 1; fi
done
if ! clean pip install -q --dry-run --no-index --find-links "$HOUSE" "$REQ" >/dev/null 2>&1; then
  step "downloading $REQ into $HOUSE (once)"
  "$FRESH/venv/bin/pip" download -q -d "$HOUSE" "$REQ"
fi
step "installing the wheel offline"
clean pip install -q --no-compile --no-index --find-links "$HOUSE" "$WHEEL"

cd "$FRESH"  # not the repository: the installed package, not python/
step "the rpath: the shim loaded before TensorFlow, from the fresh venv only"
clean python - "$FRESH/venv" 2> "$FRESH/rpath.err" <<'EOF' || { cat "$FRESH/rpath.err" >&2; exit 1; }
import ctypes, importlib.util, os, sys
venv = os.path.realpath(sys.argv[1])
site = [p for p in sys.path if p.endswith("site-packages")]
assert site and all(os.path.realpath(p).startswith(venv + "/") for p in site), f"site-packages outside the venv: {site}"
pkg = os.path.dirname(importlib.util.find_spec("rdma_device").origin)
tf_dir = os.path.dirname(importlib.util.find_spec("tensorflow").origin)
assert os.path.realpath(pkg).startswith(venv + "/") and os.path.realpath(tf_dir).startswith(venv + "/"), (pkg, tf_dir)
ctypes.CDLL(os.path.join(pkg, "lib", "librdma_device_tf.so"))  # tensorflow is not imported
assert "tensorflow" not in sys.modules
maps = {l.split()[-1] for l in open("/proc/self/maps") if "libtensorflow_" in l}
want = {os.path.realpath(os.path.join(tf_dir, n)) for n in ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2")}
got = {os.path.realpath(p) for p in maps}
assert got == want, f"TensorFlow's libraries came from {sorted(got)}, not {sorted(want)}"
print("the shim's rpath found", *sorted(os.path.relpath(p, venv) for p in got))
EOF

step "a 2-task job (run_local.sh mwms 2, RDMA_DEVICE_STRICT=1)"
clean PYTHON="$FRESH/venv/bin/python" bash "$ROOT/examples/run_local.sh" mwms 2 | tee "$FRESH/out"
[ "$(grep -c '"fallback_tensors": 0' "$FRESH/out")" = 2 ]
[ "$(grep -c '"collective_tensors": [1-9]' "$FRESH/out")" = 2 ]
[ "$(grep -o '"loss": [^,]*' "$FRESH/out" | sort -u | wc -l)" = 1 ] || { echo "the workers' losses differ" >&2; exit 1; }
step "installs without build tools and runs a 2-task job over the transport"
