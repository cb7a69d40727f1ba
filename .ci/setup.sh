#!/usr/bin/env bash
# Idempotent set-up on a Debian machine (as root): system packages, the Rust
# build, a Python venv with pinned TensorFlow, and the plugin installed into
# that venv. Every other script calls this first; re-running is cheap.
#
# Environment:
#   RDMA_DEVICE_VENV  where the venv lives (default ~/.cache/rdma_device/venv,
#                     outside the repository so TensorFlow is downloaded once)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RDMA_DEVICE_VENV:-$HOME/.cache/rdma_device/venv}
TF_VERSION=2.21.0
log() { printf '\n== %s\n' "$*" >&2; }

# --- system packages ----------------------------------------------------------
PKGS=(cmake pkg-config g++ libclang-dev libibverbs-dev librdmacm-dev rdma-core ibverbs-providers)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
python3 -m venv --help >/dev/null 2>&1 || missing+=(python3-venv)
command -v cargo >/dev/null 2>&1 || missing+=(cargo)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing system packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
rustc_minor=$(rustc --version | sed -E 's/^rustc 1\.([0-9]+).*/\1/')
if [ "${rustc_minor:-0}" -lt 80 ]; then
  echo "rustc $(rustc --version) is too old: rdma_device needs Rust 1.80 or newer (install it with rustup)." >&2
  exit 1
fi

# --- Rust: the transport library and the benchmark ---------------------------
# With rdma-core's headers present (installed above) the library includes the
# verbs backend; it reports "not viable" at run time where no device exists.
log "cargo build --release --features verbs"
(cd "$ROOT" && cargo build --release --quiet --features verbs --lib --bins)

# --- Python venv with pinned TensorFlow --------------------------------------
# One TensorFlow distribution: `tensorflow` (the PyPI build every other
# package names; tf_keras requires it by that name). `tensorflow-cpu`
# beside it would ship the same files under a second name: the one
# installed last wins file by file, and the plugin is built against
# whichever that was. A venv that holds both (earlier set-ups made one)
# keeps `tensorflow` alone, its files restored.
if ! "$VENV/bin/python" -c "import tensorflow as tf, sys; sys.exit(tf.__version__ != '$TF_VERSION')" >/dev/null 2>&1; then
  log "creating $VENV with tensorflow==$TF_VERSION (a few hundred MB, downloaded once)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "tensorflow==$TF_VERSION" "tf_keras==$TF_VERSION" pytest portpicker
fi
if "$VENV/bin/python" -c "import importlib.metadata as m; m.version('tensorflow-cpu')" >/dev/null 2>&1; then
  log "removing tensorflow-cpu from $VENV (it overwrote tensorflow's files; keeping tensorflow==$TF_VERSION alone)"
  "$VENV/bin/pip" uninstall -q -y tensorflow-cpu
  "$VENV/bin/pip" install -q --force-reinstall --no-deps "tensorflow==$TF_VERSION"
fi
"$VENV/bin/python" -c "import pytest, portpicker" 2>/dev/null || "$VENV/bin/pip" install -q pytest portpicker
# matplotlib: the evaluation suite's plots (python -m rdma_device.bench suite)
"$VENV/bin/python" -c "import matplotlib" 2>/dev/null || "$VENV/bin/pip" install -q matplotlib

# --- the plugin, built against that venv's TensorFlow ------------------------
log "building the TensorFlow plugin and installing the rdma_device package into $VENV"
"$VENV/bin/pip" install -q --no-build-isolation --no-deps --force-reinstall "$ROOT/python"
"$VENV/bin/python" -c "import rdma_device; rdma_device.load(); print('rdma_device plugin loads into TensorFlow', __import__('tensorflow').__version__)"
