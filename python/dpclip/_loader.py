"""Finding and checking libdpclip for the ctypes bindings (dpclip._lib).

Where the library comes from (first hit wins):
  1. $DPCLIP_LIBRARY (a path to libdpclip.so), as given;
  2. <repo>/build/libdpclip.so, the default build tree of the checkout this
     package lives in, unless it is a sanitizer build;
  3. an installed library under the prefix this package is installed in
     (PREFIX/lib/python3.X/site-packages/dpclip: PREFIX/lib, its multiarch
     directory, lib64), then under the user's base (~/.local), which the
     loader's search (4) misses: ldconfig never lists them;
  4. ctypes.util.find_library("dpclip") (a library the system lists).
Never another build tree, and never by modification time: after
scripts/test.sh the newest tree is build-asan, whose library kills a Python
that did not preload the ASan runtime ("ASan runtime does not come first").
A sanitizer build named by $DPCLIP_LIBRARY without its runtime preloaded is
refused with a message saying so, for the same reason.

Every library is checked before use: its dpclip_version() must be this
package's release and its dpclip_sizeof() must match each mirrored struct
(importing dpclip does this), so a stale or foreign library is an error
naming what differs, not memory corrupted by a struct of the wrong size.
"""
import ctypes
import ctypes.util
import os
import site
import struct
import sysconfig
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple, Type

from ._version import __version__

_SHT_DYNAMIC, _DT_NULL, _DT_NEEDED = 6, 0, 1
_SANITIZERS = ("libasan", "libubsan", "libtsan", "liblsan", "libmsan", "libhwasan",
               "libclang_rt.")


def _elf_needed(path: str) -> List[str]:
    """The DT_NEEDED entries of a shared object (the libraries the dynamic
    loader brings in with it), read from its section headers; [] for a file
    that is not a readable ELF object."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        if data[:4] != b"\x7fELF":
            return []
        e = "<" if data[5] == 1 else ">"
        if data[4] == 2:  # ELFCLASS64
            (shoff,), (shentsize, shnum) = struct.unpack_from(e + "Q", data, 0x28), \
                struct.unpack_from(e + "HH", data, 0x3A)
            shdr, dyn = e + "IIQQQQIIQQ", e + "qQ"
        else:
            (shoff,), (shentsize, shnum) = struct.unpack_from(e + "I", data, 0x20), \
                struct.unpack_from(e + "HH", data, 0x2E)
            shdr, dyn = e + "IIIIIIIIII", e + "iI"
        secs = [struct.unpack_from(shdr, data, shoff + i * shentsize) for i in range(shnum)]
        out = []
        for sec in secs:
            if sec[1] != _SHT_DYNAMIC:
                continue
            strtab = secs[sec[6]][4]  # sh_link: the section of its strings
            for off in range(sec[4], sec[4] + sec[5], struct.calcsize(dyn)):
                tag, val = struct.unpack_from(dyn, data, off)
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    end = data.index(b"\0", strtab + val)
                    out.append(data[strtab + val:end].decode(errors="replace"))
        return out
    except (OSError, struct.error, IndexError, ValueError):
        return []


def sanitizer_runtime(path: str) -> Optional[str]:
    """The sanitizer runtime a library was linked with (e.g. "libasan.so.8"),
    or None for a plain build."""
    for name in _elf_needed(path):
        if name.startswith(_SANITIZERS):
            return name
    return None


def _preloaded(runtime: str) -> bool:
    # ASan must come first in the process's initial libraries: LD_PRELOAD.
    pre = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    stem = runtime.split(".so")[0]
    return any(os.path.basename(p).split(".so")[0] == stem for p in pre)


def soname(version: str = __version__) -> str:
    """The installed library's file name for this release: its soname,
    libdpclip.so.MAJOR, or before 1.0 libdpclip.so.0.MINOR (a minor release
    may change the ABI then: CMakeLists.txt's SOVERSION)."""
    major, minor = version.split(".")[:2]
    return "libdpclip.so." + (major if major != "0" else "0." + minor)


def installed(here: Optional[str] = None) -> List[str]:
    """This release's libdpclip (soname()) installed under this package's
    prefix and the user's base, in that order. here: the package's
    directory (default: this one's)."""
    here = here or os.path.dirname(os.path.abspath(__file__))
    bases = []
    parts = here.split(os.sep)
    for i in range(len(parts) - 1, 0, -1):  # PREFIX/lib*/pythonX.Y/*-packages/dpclip
        if parts[i].endswith("-packages") and i >= 3 and parts[i - 1].startswith("python"):
            bases.append(os.sep.join(parts[:i - 2]) or os.sep)
            break
    bases.append(site.getuserbase())
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    out = []
    for base in bases:
        for libdir in ("lib", os.path.join("lib", arch) if arch else None, "lib64"):
            path = os.path.join(base, libdir, soname()) if libdir else None
            if path and os.path.exists(path) and path not in out:
                out.append(path)
    return out


def candidates(repo: Optional[str] = None) -> Tuple[List[str], List[str], bool]:
    """(paths to try in order, paths passed over with the reason, whether
    the first path came from $DPCLIP_LIBRARY). repo: the checkout to look in
    (default: the one this package lives in, if it lives in one)."""
    env = os.environ.get("DPCLIP_LIBRARY")
    if env:
        return [env], [], True
    out, skipped = [], []
    if repo is None:
        # python/dpclip/_lib.py -> the repository root, when running from a checkout
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.exists(os.path.join(repo, "client", "dpclip.h")):
        built = os.path.join(repo, "build", "libdpclip.so")
        if os.path.exists(built):
            rt = sanitizer_runtime(built)
            if rt:
                skipped.append("%s: a sanitizer build (linked with %s), not loadable into a "
                               "plain python" % (built, rt))
            else:
                out.append(built)
    out.extend(p for p in installed() if p not in out)
    sys_lib = ctypes.util.find_library("dpclip")
    if sys_lib:
        out.append(sys_lib)
    return out, skipped, False


def check_abi(L: ctypes.CDLL, path: str, structs: Dict[str, Type[ctypes.Structure]],
              unlisted: FrozenSet[str] = frozenset()) -> None:
    """Raises OSError naming what differs where library L (loaded from path)
    is not the release this package mirrors, or a struct's size differs
    (for the `unlisted` ones, which the library may not report: one it
    reports)."""
    try:
        L.dpclip_version.restype = ctypes.c_char_p
        L.dpclip_version.argtypes = []
        L.dpclip_sizeof.restype = ctypes.c_size_t
        L.dpclip_sizeof.argtypes = [ctypes.c_char_p]
    except AttributeError:
        raise OSError("dpclip: %s predates this package (it exports no dpclip_version / "
                      "dpclip_sizeof); rebuild it or install libdpclip %s"
                      % (path, __version__)) from None
    v = (L.dpclip_version() or b"").decode(errors="replace")
    if v != __version__:
        raise OSError("dpclip: %s is libdpclip %s, this package is dpclip %s; use the "
                      "library of the same release" % (path, v, __version__))
    bad = ["%s is %d bytes there, %d here" % (n, L.dpclip_sizeof(n.encode()), ctypes.sizeof(t))
           for n, t in structs.items() if L.dpclip_sizeof(n.encode()) != ctypes.sizeof(t) and
           not (n in unlisted and L.dpclip_sizeof(n.encode()) == 0)]
    if bad:
        raise OSError("dpclip: %s does not match this package's structs (%s); rebuild the "
                      "library and the package from one checkout" % (path, "; ".join(bad)))


def load(declare: Callable[[ctypes.CDLL], None], structs: Dict[str, Type[ctypes.Structure]],
         unlisted: FrozenSet[str] = frozenset()) -> ctypes.CDLL:
    """The first candidate that loads and passes check_abi, its functions
    declared by `declare`; L.path says where it came from. OSError saying
    which libraries were tried and why each was refused."""
    cands, errors, from_env = candidates()
    for path in cands:
        rt = sanitizer_runtime(path) if from_env else None
        if rt and rt.startswith("libasan") and not _preloaded(rt):
            errors.append("%s is a sanitizer build linked with %s, which must be loaded first "
                          "(LD_PRELOAD=$(cc -print-file-name=libasan.so)); or use a plain build "
                          "such as build/libdpclip.so" % (path, rt))
            break
        try:
            L = ctypes.CDLL(path)
            check_abi(L, path, structs, unlisted)
            declare(L)
        except (OSError, AttributeError) as e:
            errors.append("%s: %s" % (path, e))
            if from_env:
                break
            continue
        L.path = path
        return L
    hint = ("set DPCLIP_LIBRARY to the path of libdpclip.so, build the repository "
            "(cmake --build build) or install libdpclip")
    if errors:
        raise OSError("dpclip: cannot load libdpclip (%s); %s" % ("; ".join(errors), hint))
    raise OSError("dpclip: libdpclip.so not found; " + hint)
