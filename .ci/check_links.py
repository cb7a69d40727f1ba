#!/usr/bin/env python3
"""Every relative link in README.md and docs/**/*.md resolves: the file
(or directory) exists and, for a ``#anchor`` into a Markdown file, that
file has the heading (GitHub's anchors: lowercase, punctuation other than
'-' and '_' dropped, spaces to '-', repeats numbered -1, -2, ...).
Links inside code are not links. Exit status 1 on any broken link."""

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[`~]*[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
# [text](target "title") and ![alt](target); text may hold one level of [].
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)


def _blank(m):
    """The match's text with everything but newlines blanked (keeps line numbers)."""
    return re.sub(r"[^\n]", " ", m.group(0))


def prose(text):
    """``text`` without fenced code blocks and code spans."""
    return CODE_SPAN.sub(_blank, FENCE.sub(_blank, text))


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        with open(path, encoding="utf-8") as f:
            text = FENCE.sub(_blank, f.read())
        seen, out = {}, set()
        for m in HEADING.finditer(text):
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
        cache[path] = out
    return cache[path]


def links(text):
    """(line, target) of every link in ``text``'s prose."""
    text = prose(text)
    found = [(m.start(1), m.group(1)) for rx in (INLINE, REFERENCE) for m in rx.finditer(text)]
    for start, target in sorted(found):
        yield text.count("\n", 0, start) + 1, target


def broken(path):
    """(line, target, why) of each broken relative link in ``path``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for line, target in links(text):
        if not target or re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        if file_part.startswith("/"):
            dest = os.path.join(ROOT, file_part.lstrip("/"))
        else:
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(dest):
            out.append((line, target, "no such file"))
        elif anchor and dest.endswith(".md") and os.path.isfile(dest) and anchor not in anchors(dest):
            out.append((line, target, f"no heading #{anchor} in {os.path.relpath(dest, ROOT)}"))
    return out


def documents(root=ROOT):
    return [os.path.join(root, "README.md")] + sorted(
        glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))


def main():
    bad = 0
    docs = documents()
    for path in docs:
        for line, target, why in broken(path):
            print(f"{os.path.relpath(path, ROOT)}:{line}: broken link ({target}): {why}")
            bad += 1
    print(f"check_links: {len(docs)} documents, {bad} broken link(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
