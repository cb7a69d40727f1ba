"""The loader refuses a plugin built against another TensorFlow build
before it is loaded, with the reason: the version string, git version,
compiler and ABI flags are compared. (``tensorflow`` and ``tensorflow-cpu``
2.21.0 share all of them; the shim's own check of the loaded libraries
tells those apart: test_other_tf_build.py.)"""

import json

import pytest

from rdma_device import _loader


def _write(tmp_path, info):
    (tmp_path / "build_info.json").write_text(json.dumps(info))
    return str(tmp_path)


@pytest.fixture(scope="module")
def running():
    import tensorflow as tf

    return _loader._running_build(tf)


def test_the_installed_plugin_matches_the_running_tensorflow(running, plugin_built):
    import os

    _loader._check_built_for(running, os.path.dirname(plugin_built))


def test_the_same_build_elsewhere_is_accepted(tmp_path, running):
    moved = dict(running, compile_flags=running["compile_flags"].replace("-I", "-I/elsewhere"))
    _loader._check_built_for(running, _write(tmp_path, moved))


@pytest.mark.parametrize("key,value,said", [
    ("tensorflow", "2.20.0", "version"),
    ("git_version", "v2.21.0-0-gdeadbeef", "git version"),
    ("compiler_version", "gcc 9", "compiler"),
    ("compile_flags", "-D_GLIBCXX_USE_CXX11_ABI=0|--std=c++17", "compile flags"),
])
def test_another_build_is_refused_with_the_difference(tmp_path, running, key, value, said):
    with pytest.raises(RuntimeError) as e:
        _loader._check_built_for(running, _write(tmp_path, dict(running, **{key: value})))
    assert said in str(e.value) and "rebuild" in str(e.value), str(e.value)


def test_a_build_info_without_the_build_is_refused(tmp_path, running):
    with pytest.raises(RuntimeError, match="git version"):
        _loader._check_built_for(running, _write(tmp_path, {"tensorflow": running["tensorflow"]}))


# Distributions that ship the `tensorflow` package's files.
_TF_DISTRIBUTIONS = {"tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tf-nightly", "tf-nightly-cpu"}


def test_the_environment_holds_one_tensorflow_distribution():
    """The set-up installs ``tensorflow`` alone. A second distribution of
    the same files (``tensorflow-cpu`` beside it, as tf_keras's dependency
    once made) overwrites them file by file, so the plugin would be built
    against whichever came last while pip reports the other."""
    from importlib import metadata

    names = sorted({(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
                   & _TF_DISTRIBUTIONS)
    assert len(names) == 1, f"TensorFlow is installed as {names}: one distribution expected"
