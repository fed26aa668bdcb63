"""The release this package belongs to, read where its number is written
once: DPCLIP_VERSION_* in client/dpclip.h (CMakeLists.txt reads it there for
the library and the daemon). From a checkout (PYTHONPATH=python, an editable
install, pip building ./python in place) the header is beside the package;
an sdist carries the number in its PKG-INFO, an installed package in its
metadata. Importing dpclip checks it against libdpclip's dpclip_version().

setuptools loads this file alone (pyproject.toml's dynamic version), so it
imports nothing from the package."""
import os
import re

_HERE = os.path.dirname(os.path.abspath(__file__))


def _from_header(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    parts = [re.search(r"^#define DPCLIP_VERSION_%s\s+(\d+)" % k, text, re.M)
             for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise RuntimeError("dpclip: %s lacks DPCLIP_VERSION_MAJOR/MINOR/PATCH" % path)
    return ".".join(m.group(1) for m in parts)


def _find() -> str:
    header = os.path.join(_HERE, os.pardir, os.pardir, "client", "dpclip.h")
    if os.path.exists(header):
        return _from_header(header)
    pkg_info = os.path.join(_HERE, os.pardir, "PKG-INFO")
    if os.path.exists(pkg_info):
        with open(pkg_info, encoding="utf-8") as f:
            for line in f:
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    from importlib import metadata
    return metadata.version("dpclip")


__version__: str = _find()
