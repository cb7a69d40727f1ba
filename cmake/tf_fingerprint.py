"""Which binaries of TensorFlow a directory holds, for CMakeLists.txt.

    python tf_fingerprint.py <tensorflow's package directory>

prints four lines: the distribution whose RECORD lists its
libtensorflow_framework.so.2 ("unknown" if none), the load segments of
libtensorflow_framework.so.2, those of libtensorflow_cc.so.2, and a JSON
object with each library's segments and size. A library's load segments
are what the dynamic loader maps, as the shim spells them at load time
(server.cc): each PT_LOAD's "p_vaddr:p_filesz:p_memsz" in hex, joined by
",". The tests read ELF files with pt_loads() and load_segments() too.
"""

import importlib.metadata as metadata
import json
import os
import struct
import sys

LIBS = ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2")
PT_LOAD = 1


def pt_loads(path):
    """(p_offset, p_vaddr, p_filesz, p_memsz) of each PT_LOAD segment of a
    little-endian ELF64 file; ValueError for any other file."""
    with open(path, "rb") as f:
        ehdr = f.read(64)
        if ehdr[:4] != b"\x7fELF" or ehdr[4] != 2 or ehdr[5] != 1:
            raise ValueError(f"{path}: not a little-endian ELF64 file")
        phoff, = struct.unpack_from("<Q", ehdr, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", ehdr, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    segments = []
    for i in range(phnum):
        p_type, _flags, offset, vaddr, _paddr, filesz, memsz, _align = struct.unpack_from(
            "<IIQQQQQQ", table, i * phentsize)
        if p_type == PT_LOAD:
            segments.append((offset, vaddr, filesz, memsz))
    return segments


def load_segments(path):
    """The PT_LOAD segments of an ELF64 file as the shim spells them;
    ValueError for a file that has none."""
    segments = pt_loads(path)
    if not segments:
        raise ValueError(f"{path}: no PT_LOAD segment")
    return ",".join(f"{vaddr:x}:{filesz:x}:{memsz:x}" for _offset, vaddr, filesz, memsz in segments)


def main(directory):
    libs = {}
    for name in LIBS:
        path = os.path.join(directory, name)
        try:
            segments = load_segments(path)
        except ValueError as e:
            sys.exit(str(e))
        libs[name] = {"load_segments": segments, "size": os.path.getsize(path)}

    # The distribution whose RECORD lists this very file (tensorflow and
    # tensorflow-cpu both ship tensorflow/; the size tells which one's is here).
    size = libs["libtensorflow_framework.so.2"]["size"]
    distribution = "unknown"
    for d in metadata.distributions():
        for f in d.files or []:
            if f.name == "libtensorflow_framework.so.2" and f.size == size and \
                    os.path.realpath(f.locate()) == os.path.realpath(os.path.join(directory, f.name)):
                distribution = d.metadata["Name"]
    print(distribution)
    print(libs["libtensorflow_framework.so.2"]["load_segments"])
    print(libs["libtensorflow_cc.so.2"]["load_segments"])
    print(json.dumps(libs, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1])
