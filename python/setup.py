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
        build_dir = os.path.join(REPO, "build", "python-package")
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


setup(
    cmdclass={"build_py": BuildNative},
    distclass=BinaryDistribution,
    # Build products go under the repository's (ignored) build/ directory.
    options={"build": {"build_base": os.path.join(REPO, "build", "python-setuptools")}},
)
