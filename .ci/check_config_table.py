#!/usr/bin/env python3
"""docs/configuration.md's table of settings is what `python -m rdma_device
config --markdown` prints from the library's own table (src/config.rs),
between its `<!-- config:table begin -->` and `<!-- config:table end -->`
lines. Run it with the Python that has the package installed; `--write`
puts the command's table into the document instead. Exit status 1 when
they differ."""

import difflib
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "configuration.md")
BLOCK = re.compile(r"(<!-- config:table begin -->\n)(.*?)(<!-- config:table end -->)", re.S)


def generated():
    p = subprocess.run([sys.executable, "-m", "rdma_device", "config", "--markdown"], cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"check_config_table: python -m rdma_device config --markdown failed:\n{p.stderr}")
    return p.stdout


def main(argv):
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    m = BLOCK.search(text)
    if not m:
        sys.exit("check_config_table: docs/configuration.md has no config:table block")
    want = generated()
    if m.group(2) == want:
        print("check_config_table: docs/configuration.md matches the library's settings")
        return 0
    if "--write" in argv:
        with open(DOC, "w", encoding="utf-8") as f:
            f.write(text[:m.start(2)] + want + text[m.end(2):])
        print("check_config_table: docs/configuration.md's table rewritten")
        return 0
    sys.stdout.writelines(difflib.unified_diff(m.group(2).splitlines(True), want.splitlines(True),
                                               "docs/configuration.md", "python -m rdma_device config --markdown"))
    print("check_config_table: docs/configuration.md's table differs from the library's settings; "
          "regenerate it with `python .ci/check_config_table.py --write`")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
