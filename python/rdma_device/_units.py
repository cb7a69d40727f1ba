"""Byte sizes on the command lines and in the tables."""


def parse_size(s):
    """``"64K"``, ``"16M"``, ``"1G"`` or a plain number of bytes."""
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def size_label(n):
    """A benchmark's tensor size, whole units: ``4 KiB``, ``64 MiB``."""
    if n >= 1 << 20:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def human_bytes(n):
    """Any byte count, 4 significant digits: ``1.5 GiB``, ``100 B``."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}iB"
    return f"{n} B"
