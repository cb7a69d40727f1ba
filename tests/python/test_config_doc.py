"""The Markdown table of settings (``python -m rdma_device config
--markdown``, docs/configuration.md's): one row per variable in config()'s
order, an empty default shown as such, a '|' in help text escaped."""

from rdma_device import _config_doc


def test_one_row_per_setting_in_order():
    cfg = {"RDMA_DEVICE_B": {"value": "3", "default": "2", "help": "Two (1-64)."},
           "RDMA_DEVICE_A": {"value": "", "default": "", "help": "a | b"}}
    lines = _config_doc.markdown(cfg).splitlines()
    assert lines[:2] == ["| variable | default | meaning |", "|---|---|---|"]
    assert lines[2:] == ["| `RDMA_DEVICE_B` | `2` | Two (1-64). |", "| `RDMA_DEVICE_A` | empty | a \\| b |"]
