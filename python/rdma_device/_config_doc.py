"""The settings as a Markdown table, from the library's own table of them
(name, default and help of each ``RDMA_DEVICE_*`` variable, as config()
reports them): ``python -m rdma_device config --markdown`` prints it and
docs/configuration.md holds it."""


def _cell(text):
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(cfg):
    """``cfg``: what config() returns, {name: {"default", "help", ...}}."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for name, row in cfg.items():
        default = f"`{_cell(row['default'])}`" if row["default"] else "empty"
        lines.append(f"| `{name}` | {default} | {_cell(row['help'])} |")
    return "\n".join(lines) + "\n"
