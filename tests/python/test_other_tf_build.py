"""The plugin loaded into another build of the same TensorFlow version
registers nothing.

PyPI's ``tensorflow`` and ``tensorflow-cpu`` 2.21.0 share the version
string, the git version, the compiler and the compile flags, yet their
libraries are other binaries (``libtensorflow_cc.so.2`` is 1.10 GB in one,
0.79 GB in the other): the shim's classes, laid out for one, must never
run in the other. What a user would notice, having built the plugin
against ``tensorflow`` and then loaded it by hand with
``tf.load_library(".../librdma_device_tf.so")`` in a ``tensorflow-cpu``
environment (bypassing ``rdma_device.load()``): before the fix the load
was silent, ``tf.distribute.Server(..., protocol="grpc+rdma_device")``
was created and ran steps on another build's class layouts (undefined
behaviour: wrong results or a crash later, far from the cause). Now the
load logs an ERROR naming the two builds' differing libraries, creating
the server fails with TensorFlow's "No server factory registered", and
``rdma_device_tf_load_error()`` / ``rdma_device.load()`` say why.

``tensorflow-cpu`` lives in a venv of its own, cached outside the
repository (``~/.cache/rdma_device/tf-cpu-venv``, about 1 GB, made once:
``tensorflow-cpu==2.21.0`` without its dependencies plus only those its
import needs, at the project venv's versions). The shim under test is the
package's (``rdma_device.lib_dir()``), or ``RDMA_DEVICE_TEST_SHIM`` (a
build directory's ``librdma_device_tf.so``, with its ``build_info.json``
beside it).
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata

import pytest

import rdma_device
import tf_fingerprint

TF_VERSION = "2.21.0"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "rdma_device")
CPU_VENV = os.environ.get("RDMA_DEVICE_TF_CPU_VENV", os.path.join(CACHE, "tf-cpu-venv"))
WHEELHOUSE = os.environ.get("RDMA_DEVICE_WHEELHOUSE", os.path.join(CACHE, "wheelhouse"))
LIBS = ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2")

# What `import tensorflow` and tf.distribute.Server need of tensorflow's
# requirements (measured: each missing one fails the import); keras,
# h5py, grpcio, libclang are not imported on this path.
_IMPORT_DEPS = ("absl-py", "numpy", "protobuf", "ml_dtypes", "typing_extensions", "wrapt", "six",
                "gast", "astunparse", "termcolor", "opt_einsum", "packaging", "flatbuffers",
                "requests", "urllib3", "idna", "certifi", "charset-normalizer")


def _pinned(name):
    """``name==<version in this (the project's) venv>``: versions known to
    work with this TensorFlow, and the wheels the wheelhouse caches."""
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return name


def _clean_env(**extra):
    """The environment for another interpreter: conftest points PYTHONPATH
    at this venv's site-packages (the package's parent), which would hand
    the other venv this venv's TensorFlow."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"  # the shim's LOG(ERROR) is asserted
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def cpu_python():
    """The interpreter of a venv holding ``tensorflow-cpu`` alone (made
    once; about 30 s with a fast network, then only checked)."""
    python = os.path.join(CPU_VENV, "bin", "python")
    want = json.dumps({"tensorflow-cpu": TF_VERSION, "deps": [_pinned(d) for d in _IMPORT_DEPS]})
    ready = os.path.join(CPU_VENV, ".rdma_device-ready")
    os.makedirs(CACHE, exist_ok=True)
    with open(CPU_VENV.rstrip("/") + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once make it once
        try:
            with open(ready) as f:
                if f.read() == want and os.access(python, os.X_OK):
                    return python
        except OSError:
            pass
        shutil.rmtree(CPU_VENV, ignore_errors=True)  # a half-made one
        steps = [[sys.executable, "-m", "venv", CPU_VENV],
                 [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
                 + (["--find-links", WHEELHOUSE] if os.path.isdir(WHEELHOUSE) else [])
                 + [f"tensorflow-cpu=={TF_VERSION}"] + [_pinned(d) for d in _IMPORT_DEPS],
                 [python, "-c", "import importlib.metadata as m, tensorflow as tf; "
                  f"assert tf.__version__ == {TF_VERSION!r} and m.version('tensorflow-cpu') == {TF_VERSION!r}"]]
        for step in steps:
            done = subprocess.run(step, env=_clean_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=1200)
            if done.returncode != 0:
                pytest.fail(f"making {CPU_VENV} failed at {step[:4]}...:\n{done.stdout[-4000:]}")
        with open(ready, "w") as f:
            f.write(want)
    return python


@pytest.fixture(scope="module")
def shim(plugin_built):
    path = os.environ.get("RDMA_DEVICE_TEST_SHIM") or plugin_built
    assert os.path.exists(path), path
    return os.path.abspath(path)


# Run in the other interpreter: loads the shim by hand, as a user bypassing
# rdma_device.load() would, then tries the plugin's server.
_BY_HAND = r"""
import ctypes, json, socket, sys
import tensorflow as tf
shim = sys.argv[1]
tf.load_library(shim)
load_error = ctypes.CDLL(shim).rdma_device_tf_load_error
load_error.restype = ctypes.c_char_p
out = {"tf": tf.__file__, "load_error": load_error().decode("utf-8", "replace"),
       "mapped": sorted({l.split()[-1] for l in open("/proc/self/maps") if "libtensorflow_" in l})}
s = socket.socket(); s.bind(("localhost", 0)); port = s.getsockname()[1]; s.close()
try:
    tf.distribute.Server({"worker": [f"localhost:{port}"]}, job_name="worker", task_index=0,
                         protocol="grpc+rdma_device", start=False)
    out["server"] = "created"
except Exception as e:
    out["server"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out), flush=True)
"""

# rdma_device.load() from the shim's directory (its build_info.json).
_LOADER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import rdma_device
try:
    rdma_device.load(sys.argv[2])
    out = {"load": "ok"}
except RuntimeError as e:
    out = {"load": "RuntimeError: " + str(e)}
print("RESULT " + json.dumps(out), flush=True)
"""


def _run(python, script, *args, env=None):
    done = subprocess.run([python, "-c", script, *args], env=env or _clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (
        f"rc {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):]), done.stderr


def _tf_dir(python):
    out, _ = _run(python, "import json, os, tensorflow as tf; print('RESULT ' + json.dumps(["
                  "os.path.dirname(tf.__file__), tf.__version__, tf.version.GIT_VERSION, "
                  "tf.version.COMPILER_VERSION, [f for f in tf.sysconfig.get_compile_flags() "
                  "if not f.startswith('-I')]]))")
    return out


def test_the_two_distributions_share_the_version_but_not_the_binaries(cpu_python):
    """What the shim's check rests on: everything the version strings say
    is equal, the libraries' load segments (read as CMakeLists.txt reads
    them) are not."""
    ours, cpu = _tf_dir(sys.executable), _tf_dir(cpu_python)
    assert ours[1:] == cpu[1:], (ours, cpu)  # version, git version, compiler, ABI flags
    for lib in LIBS:
        a = tf_fingerprint.load_segments(os.path.join(ours[0], lib))
        b = tf_fingerprint.load_segments(os.path.join(cpu[0], lib))
        assert a != b, (lib, a)


def test_loaded_by_hand_into_tensorflow_cpu_it_registers_nothing(cpu_python, shim):
    out, stderr = _run(cpu_python, _BY_HAND, shim)
    # The scenario is real: the shim bound to tensorflow-cpu's libraries.
    assert out["mapped"] and all(p.startswith(CPU_VENV) for p in out["mapped"]), out["mapped"]
    error = out["load_error"]
    assert "another build of TensorFlow 2.21.0" in error and "libtensorflow_cc.so.2" in error \
        and "rebuild" in error, f"the shim accepted tensorflow-cpu: load error {error!r}"
    assert error in stderr, "no LOG(ERROR) at load"
    # No ServerFactory (nor anything else) was registered.
    assert out["server"].startswith("NotFoundError") and "No server factory registered" in out["server"], \
        out["server"]
    available = out["server"].split("The available server factories are:")[-1]
    assert "rdma" not in available.lower(), out["server"]


def test_rdma_device_load_refuses_tensorflow_cpu(cpu_python, shim, tmp_path):
    """The package's loader: its build_info.json check cannot tell the two
    apart (equal fields), the shim's own check can: load() raises."""
    (tmp_path / "rdma_device").symlink_to(os.path.dirname(os.path.abspath(rdma_device.__file__)))
    out, _ = _run(cpu_python, _LOADER, str(tmp_path), os.path.dirname(shim))
    assert out["load"].startswith("RuntimeError") and "another build of TensorFlow" in out["load"], out


def test_in_its_own_tensorflow_it_loads_and_serves(shim):
    out, stderr = _run(sys.executable, _BY_HAND, shim)
    assert out["load_error"] == "", out["load_error"]
    assert out["server"] == "created", out["server"]
    assert "another build" not in stderr
