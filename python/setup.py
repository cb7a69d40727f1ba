"""Builds the native libraries while building the package.

The Rust transport and the TensorFlow shim live outside this directory (the
repository root holds Cargo.toml and CMakeLists.txt), so `pip install ./python`
builds them in place and copies both .so files into rdma_device/lib/.
"""

import os
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _clean_env():
    """The environment of the interpreter we are installing into.

    pip's build isolation hides the target environment's site-packages
    (PYTHONPATH + a sitecustomize); the shim must see that environment's
    TensorFlow, so the build tools run without those overrides.
    """
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME"):
        env.pop(var, None)
    return env


def _run(cmd, cwd=REPO):
    print("+", " ".join(cmd), flush=True)
    subprocess.check_call(cmd, cwd=cwd, env=_clean_env())


def _cargo_features():
    """The verbs backend when rdma-core's headers are here (or as asked).

    RDMA_DEVICE_FEATURES overrides: "verbs", or "" for a shared-memory-only
    build that needs no rdma-core at run time.
    """
    asked = os.environ.get("RDMA_DEVICE_FEATURES")
    if asked is None:
        try:
            have = subprocess.call(["pkg-config", "--exists", "libibverbs", "librdmacm"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0
        except OSError:  # no pkg-config
            have = False
        asked = "verbs" if have else ""
        if not have:
            print("rdma_device: libibverbs/librdmacm headers not found: building without the "
                  "verbs backend (install libibverbs-dev librdmacm-dev libclang-dev for it)", flush=True)
    return ["--features", asked] if asked else []


class BuildNative(build_py):
    def run(self):
        super().run()
        jobs = str(max(1, min(4, os.cpu_count() or 1)))
        _run(["cargo", "build", "--release", "--lib"] + _cargo_features())
        # RDMA_DEVICE_CMAKE_BUILD_DIR: reuse a configured build (an in-place
        # build, CI's) instead of compiling the shim again.
        build_dir = os.environ.get("RDMA_DEVICE_CMAKE_BUILD_DIR") or os.path.join(REPO, "build", "python-package")
        lib_dir = os.path.join(REPO, "target", "release")
        _run(["cmake", "-S", REPO, "-B", build_dir,
              f"-DPython_EXECUTABLE={sys.executable}",
              f"-DRDMA_DEVICE_LIB_DIR={lib_dir}",
              "-DCMAKE_BUILD_TYPE=Release"])
        _run(["cmake", "--build", build_dir, "-j", jobs])
        dest = os.path.join(os.path.abspath(self.build_lib), "rdma_device", "lib")
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        _run(["cmake", "--install", build_dir, "--prefix", dest])


class BinaryDistribution(Distribution):
    """Wheels carry native code: tag them for the platform."""

    def has_ext_modules(self):
        return True


VERSION = "0.1.0"


_WHICH_TF = r"""
import base64, hashlib, importlib.metadata as m, os, tensorflow as tf
lib = os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2")
with open(lib, "rb") as f:
    digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(f.read()).digest()).rstrip(b"=").decode()
# The distribution whose record holds this very file: tensorflow and
# tensorflow-cpu both ship tensorflow/, and both may be installed.
for d in m.distributions():
    for f in d.files or []:
        if f.name == "libtensorflow_framework.so.2" and f.hash and f"{f.hash.mode}={f.hash.value}" == digest:
            print(d.metadata["Name"], tf.__version__)
            raise SystemExit(0)
print("tensorflow", tf.__version__)
"""


def _tensorflow_requirement():
    """(distribution, version) of the TensorFlow the libraries are built
    against: the one the build's Python imports."""
    out = subprocess.check_output([sys.executable, "-c", _WHICH_TF], env=_clean_env(), text=True,
                                  stderr=subprocess.DEVNULL)
    name, version = out.split()[-2:]
    return name.replace("_", "-").lower(), version


TF_DIST, TF_VERSION = _tensorflow_requirement()

setup(
    version=f"{VERSION}+tf{TF_VERSION}",
    install_requires=[f"{TF_DIST}=={TF_VERSION}"],
    cmdclass={"build_py": BuildNative},
    distclass=BinaryDistribution,
    # Build products go under the repository's (ignored) build/ directory.
    options={"build": {"build_base": os.path.join(REPO, "build", "python-setuptools")}},
)
