#!/usr/bin/env python3
"""Rewrites the supported-layer lists of README.md and python/README.md (the
lines between their `<!-- supported-layers -->` and `<!-- /supported-layers -->`
markers) from dpclip's registry (dpclip._registry.supported_layers), so that
the docs list what the code trains. python/tests/test_docs.py fails where
they differ.

    /usr/bin/python3 scripts/layers_doc.py           # rewrite
    /usr/bin/python3 scripts/layers_doc.py --check   # exit 1 where they differ
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
DOCS = ("README.md", "python/README.md")
BLOCK = re.compile(r"(<!-- supported-layers -->\n)(.*?)(<!-- /supported-layers -->)", re.S)


def render(text, listing):
    """text with its block replaced by listing; ValueError without one."""
    if not BLOCK.search(text):
        raise ValueError("no <!-- supported-layers --> block")
    return BLOCK.sub(lambda m: m.group(1) + listing + m.group(3), text)


def main():
    from dpclip._registry import supported_markdown  # noqa: E402 (after the path)
    listing = supported_markdown()
    stale = []
    for rel in DOCS:
        path = os.path.join(ROOT, rel)
        with open(path) as f:
            text = f.read()
        new = render(text, listing)
        if new != text:
            stale.append(rel)
            if "--check" not in sys.argv:
                with open(path, "w") as f:
                    f.write(new)
    if stale and "--check" in sys.argv:
        print("layers_doc: stale lists in %s: run scripts/layers_doc.py" % ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
