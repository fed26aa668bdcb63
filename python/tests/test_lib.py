"""The ctypes bindings: struct layouts against the C header, the library's
ABI exports checked at import, which library is loaded, errors, buffers."""
import ctypes
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import DPCLIPD, REPO
import dpclip
from dpclip import _lib, _loader

FIELDS = {
    "dpclip_tensor": ["buffer", "offset", "dtype", "ndim", "shape"],
    "dpclip_connect_opts": ["client_name", "job_id", "timeout_ms"],
    "dpclip_daemon_info": ["protocol_version", "daemon_version", "max_batch", "max_layers",
                           "max_frame", "session_id", "has_cuda", "mps_active"],
    "dpclip_clip_config": ["max_grad_norm", "reduction", "expected_batch_size",
                           "noise_multiplier", "mode", "sample_rate", "target_delta",
                           "target_epsilon"],
    "dpclip_linear": ["name", "activations", "output_grad", "has_bias", "algo",
                      "weight_grad_out", "bias_grad_out", "max_grad_norm"],
    "dpclip_embedding": ["name", "indices", "output_grad", "num_embeddings", "has_padding_idx",
                         "padding_idx", "weight_grad_out", "max_grad_norm"],
    "dpclip_norm_layer": ["name", "input", "output_grad", "eps", "has_bias", "weight_grad_out",
                          "bias_grad_out", "max_grad_norm"],
    "dpclip_result": ["batch", "n_layers", "norms", "coefs", "layer_norms", "layer_coefs",
                      "step_index", "compute_ns", "epsilon", "delta", "input_wait_ns",
                      "logical_id", "micro_batches"],
    "dpclip_enqueued": ["step_index", "epsilon", "delta", "done_value"],
    "dpclip_timing": ["start_ns", "sent_ns", "daemon_received_ns", "daemon_replied_ns",
                      "received_ns", "compute_ns", "group_wait_ns", "group_exchange_ns",
                      "input_wait_ns"],
    "dpclip_group_opts": ["name", "rank", "size", "timeout_ms", "group_wise"],
}


def _cc():
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert cc, "a C compiler is needed to check the bindings against dpclip.h"
    return cc


def _shared_object(path, source, *flags):
    """Compiles `source` into the shared object `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    src = path + ".c"
    with open(src, "w") as f:
        f.write(source)
    subprocess.run([_cc(), "-shared", "-fPIC", *flags, src, "-o", path], check=True)
    return path


def _import_dpclip(library, pythonpath=os.path.join(REPO, "python")):
    """`import dpclip` in a fresh plain python (no sanitizer preloaded) with
    DPCLIP_LIBRARY=library (None: unset); prints the library it loaded."""
    env = {k: v for k, v in os.environ.items() if k not in ("DPCLIP_LIBRARY", "LD_PRELOAD")}
    if library is not None:
        env["DPCLIP_LIBRARY"] = library
    env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", "import dpclip; print(dpclip.lib().path)"],
                          env=env, cwd=os.path.dirname(pythonpath), capture_output=True,
                          text=True, timeout=120)


def test_struct_layouts_match_the_header(tmp_path):
    """Compile a program that prints sizeof/offsetof of every struct the
    bindings mirror, and compare with ctypes."""
    cc = _cc()
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "dpclip.h"',
             'int main(void) {']
    for s, fields in FIELDS.items():
        lines.append('printf("%s sizeof %%zu\\n", sizeof(%s));' % (s, s))
        for f in fields:
            lines.append('printf("%s %s %%zu\\n", offsetof(%s, %s));' % (s, f, s, f))
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", os.path.join(REPO, "client"), str(src), "-o",
                    str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    c = {}
    for line in out.splitlines():
        s, f, v = line.split()
        c[(s, f)] = int(v)
    for s, fields in FIELDS.items():
        py = _lib.STRUCTS[s]
        assert ctypes.sizeof(py) == c[(s, "sizeof")], s
        assert [n for n, _ in py._fields_] == fields, s
        for f in fields:
            assert getattr(py, f).offset == c[(s, f)], "%s.%s" % (s, f)
        # what the library exports for the check at import (0: a struct
        # the library does not list yet, which the check passes over)
        exported = dpclip.lib().dpclip_sizeof(s.encode())
        assert exported == c[(s, "sizeof")] or (s in _lib.UNLISTED and exported == 0), s
    assert dpclip.lib().dpclip_sizeof(b"dpclip_no_such_struct") == 0


def _abi_source(version, sizes):
    cases = "".join('    if (!strcmp(n, "%s")) return %d;\n' % kv for kv in sizes.items())
    return ('#include <stddef.h>\n#include <string.h>\n'
            'const char *dpclip_version(void) { return "%s"; }\n'
            'size_t dpclip_sizeof(const char *n) {\n%s    return 0;\n}\n' % (version, cases))


def test_import_refuses_a_library_of_another_abi(tmp_path):
    """import dpclip itself (not only this suite) refuses a library whose
    release or struct sizes differ from the package's, or that exports no
    ABI information, naming what differs."""
    sizes = {n: ctypes.sizeof(t) for n, t in _lib.STRUCTS.items()}
    grown = dict(sizes, dpclip_result=sizes["dpclip_result"] + 8)
    cases = {
        "grown": (_abi_source(dpclip.__version__, grown), "dpclip_result is %d bytes there"
                  % grown["dpclip_result"]),
        "release": (_abi_source("9.9.9", sizes), "libdpclip 9.9.9, this package is dpclip %s"
                    % dpclip.__version__),
        "old": ("int dpclip_ping(void *c) { return 0; }\n", "exports no dpclip_version"),
    }
    for name, (source, words) in cases.items():
        so = _shared_object(str(tmp_path / name / "libdpclip.so"), source)
        p = _import_dpclip(so)
        assert p.returncode != 0, (name, p.stdout)
        assert "ImportError" in p.stderr and so in p.stderr and words in p.stderr, \
            (name, p.stderr)


def test_one_version_number():
    """The release is written once (client/dpclip.h): the package, the
    library and the daemon report the same one, and no other file of the
    build spells it out."""
    v = dpclip.__version__
    with open(os.path.join(REPO, "client", "dpclip.h")) as f:
        header = f.read()
    assert v == ".".join(header.split("DPCLIP_VERSION_%s " % k)[1].split()[0]
                         for k in ("MAJOR", "MINOR", "PATCH"))
    assert dpclip.lib().dpclip_version().decode() == v
    out = subprocess.run([DPCLIPD, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["dpclipd", v]
    for f in ("CMakeLists.txt", "python/pyproject.toml", "python/dpclip/__init__.py"):
        with open(os.path.join(REPO, f)) as fh:
            assert v not in fh.read(), "%s spells out the version again" % f


PLAIN = "int dpclip_fake(void) { return 1; }\n"


def test_library_search_prefers_build_and_never_a_sanitizer_build(tmp_path, monkeypatch):
    """build/libdpclip.so first, then the installed one: never a newer
    build-asan/, never by modification time, never a sanitizer build."""
    monkeypatch.delenv("DPCLIP_LIBRARY", raising=False)
    repo = tmp_path / "repo"
    (repo / "client").mkdir(parents=True)
    (repo / "client" / "dpclip.h").write_text("")
    plain = _shared_object(str(repo / "build" / "libdpclip.so"), PLAIN)
    asan = _shared_object(str(repo / "build-asan" / "libdpclip.so"), PLAIN, "-fsanitize=address")
    later = time.time() + 3600
    os.utime(asan, (later, later))
    assert _loader.sanitizer_runtime(plain) is None
    assert _loader.sanitizer_runtime(asan).startswith("libasan")
    cands, skipped, from_env = _loader.candidates(str(repo))
    assert cands[0] == plain and not from_env and not skipped
    assert not [c for c in cands if "build-asan" in c]
    # build/ itself configured with -DDPCLIP_SANITIZE=ON: passed over, saying why
    shutil.copy(asan, plain)
    cands, skipped, _ = _loader.candidates(str(repo))
    assert plain not in cands and not [c for c in cands if "build-asan" in c]
    assert len(skipped) == 1 and plain in skipped[0] and "sanitizer build" in skipped[0]


def test_an_installed_package_finds_the_library_installed_beside_it(tmp_path, monkeypatch):
    """`pip install --prefix P ./python` and `cmake --install --prefix P`
    (say P = ~/.local): the package finds P's libdpclip.so.0.MINOR (this
    release's soname), which ldconfig (find_library) never lists; then the
    user's base. Another 0.x release's library is passed over."""
    prefix, user = tmp_path / "prefix", tmp_path / "user"
    here = prefix / "lib" / "python3.11" / "site-packages" / "dpclip"
    here.mkdir(parents=True)
    monkeypatch.setattr(_loader.site, "getuserbase", lambda: str(user))
    assert _loader.installed(str(here)) == []
    name = _loader.soname()
    major, minor = dpclip.__version__.split(".")[:2]
    assert name == ("libdpclip.so.0.%s" % minor if major == "0" else "libdpclip.so." + major)
    (prefix / "lib" / "libdpclip.so.0.999").write_bytes(b"")  # another ABI
    assert _loader.installed(str(here)) == []
    lib = prefix / "lib" / name
    lib.write_bytes(b"")
    (user / "lib64").mkdir(parents=True)
    (user / "lib64" / name).write_bytes(b"")
    assert _loader.installed(str(here)) == [str(lib), str(user / "lib64" / name)]


def test_sonames_of_releases():
    assert _loader.soname("0.1.0") == "libdpclip.so.0.1"
    assert _loader.soname("0.2.3") == "libdpclip.so.0.2"
    assert _loader.soname("1.4.0") == "libdpclip.so.1"


def _plain_build_library():
    for path in (dpclip.lib().path, os.path.join(REPO, "build", "libdpclip.so")):
        if os.path.exists(path) and _loader.sanitizer_runtime(path) is None:
            return path
    pytest.skip("no plain (non-sanitizer) libdpclip.so built here")


def test_checkout_after_a_sanitizer_build_imports_the_plain_build(tmp_path):
    """The README's example after scripts/test.sh: a checkout whose newest
    library is build-asan's. A plain python imports dpclip with build/'s
    (it died with "ASan runtime does not come first")."""
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(REPO, "python", "dpclip"), str(repo / "python" / "dpclip"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "client").mkdir()
    shutil.copy(os.path.join(REPO, "client", "dpclip.h"), str(repo / "client"))
    (repo / "build").mkdir()
    plain = shutil.copy(_plain_build_library(), str(repo / "build" / "libdpclip.so"))
    asan = _shared_object(str(repo / "build-asan" / "libdpclip.so"), PLAIN, "-fsanitize=address")
    later = time.time() + 3600
    os.utime(asan, (later, later))
    p = _import_dpclip(None, str(repo / "python"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == plain and "ASan" not in p.stderr


def test_a_sanitizer_build_named_without_its_runtime_is_refused(tmp_path):
    """DPCLIP_LIBRARY naming an ASan build in a python without the ASan
    runtime preloaded: an ImportError saying so, not a dead interpreter."""
    asan = _shared_object(str(tmp_path / "libdpclip.so"), PLAIN, "-fsanitize=address")
    p = _import_dpclip(asan)
    assert p.returncode == 1 and "ImportError" in p.stderr, p.stderr
    assert "sanitizer build" in p.stderr and "LD_PRELOAD" in p.stderr and asan in p.stderr
    assert "ASan runtime does not come first" not in p.stderr


def test_daemon_down_is_a_clear_error(tmp_path):
    path = str(tmp_path / "nobody-here.sock")
    with pytest.raises(dpclip.DpclipError) as ei:
        dpclip.Client(path)
    e = ei.value
    assert e.code == _lib.EIO
    assert path in str(e) and "cannot reach dpclipd" in str(e)


def test_connect_ping_buffers(daemon):
    with dpclip.Client(daemon.socket, client_name="pytest") as c:
        assert c.info.protocol_version == 1
        assert c.info.max_batch >= 1 and c.info.session_id > 0
        c.ping()
        bid, addr = c.buffer_alloc(4096)
        assert bid > 0 and addr
        # The mapping is ours to write.
        ctypes.memset(addr, 7, 4096)
        assert (ctypes.c_uint8 * 4096).from_address(addr)[4095] == 7
        c.buffer_release(bid)
        with pytest.raises(dpclip.DpclipError) as ei:
            c.buffer_release(bid)
        assert ei.value.code == _lib.ENOTFOUND


def test_daemon_errors_carry_code_field_and_message(daemon):
    """A reference past the end of its buffer: the daemon's INVALID_ARGUMENT
    names the offending field."""
    with dpclip.Client(daemon.socket) as c:
        bid, _ = c.buffer_alloc(4096)
        step = dpclip.Step(2, max_grad_norm=1.0, reduction=_lib.SUM)
        t = lambda off, shape: _lib.Tensor(bid, off, _lib.F32, len(shape),  # noqa: E731
                                           (ctypes.c_int64 * 3)(*(list(shape) + [0] * 3)[:3]))
        step.add_linear(_lib.Linear(b"fc", t(0, (2, 4)), t(1 << 20, (2, 3)), 0, 0,
                                    _lib.Tensor(), _lib.Tensor(), 0.0))
        with pytest.raises(dpclip.DpclipError) as ei:
            step.run(c)
        e = ei.value
        assert e.code == _lib.EINVAL
        assert "output_grad" in e.field and e.message
        # The session goes on.
        c.ping()
        step.close()


def test_join_group_and_replicated_layers(daemon):
    """dpclip_join_group through the bindings: members of one name share
    its id, the daemon's refusals name the join_group field; and
    set_replicated reaches the daemon (refused outside a group, naming the
    field) and checks its layer index here."""
    with dpclip.Client(daemon.socket) as a, dpclip.Client(daemon.socket) as b:
        g0 = a.join_group("pytest-bind", 0, 2, timeout_ms=5000)
        g1 = b.join_group("pytest-bind", 1, 2, timeout_ms=5000)
        assert g0 > 0 and g0 == g1
        with dpclip.Client(daemon.socket) as c:
            with pytest.raises(dpclip.DpclipError) as ei:
                c.join_group("pytest-bind", 1, 2)
            assert ei.value.code == _lib.EINVAL and ei.value.field == "join_group.rank"
            with pytest.raises(dpclip.DpclipError) as ei:
                c.join_group("pytest-bind", 0, 2, group_wise=True)
            assert ei.value.field == "join_group.clipping"
            with pytest.raises(dpclip.DpclipError) as ei:
                c.join_group("pytest-other", 2, 2)
            assert ei.value.field == "join_group.rank"
    with dpclip.Client(daemon.socket) as c:
        bid, _ = c.buffer_alloc(4096)
        step = dpclip.Step(2, max_grad_norm=1.0, reduction=_lib.SUM)
        t = lambda off, shape: _lib.Tensor(bid, off, _lib.F32, len(shape),  # noqa: E731
                                           (ctypes.c_int64 * 3)(*(list(shape) + [0] * 3)[:3]))
        step.add_layernorm(_lib.NormLayer(b"ln", t(0, (2, 4)), t(64, (2, 4)), 1e-5, 0,
                                          t(128, (4,)), _lib.Tensor(), 0.0))
        with pytest.raises(dpclip.DpclipError) as ei:
            step.set_replicated(1)
        assert ei.value.code == _lib.EARG
        step.set_replicated(0)
        with pytest.raises(dpclip.DpclipError) as ei:
            step.run(c)
        assert ei.value.code == _lib.EINVAL and ei.value.field == "clip_step.layers.replicated"
        step.set_replicated(0, False)
        step.run(c)  # the same step, no longer replicated, runs outside a group
        step.close()


def test_set_tied_binding(daemon):
    """Step.set_tied reaches the daemon: an embedding [V=6, d=4] and a linear
    layer [6, 4] tied run, the owner's weight output written; the library
    checks the indices here, the daemon names tied_to for a bad pair."""
    with dpclip.Client(daemon.socket) as c:
        bid, addr = c.buffer_alloc(1 << 16)
        mem = (ctypes.c_float * (1 << 14)).from_address(addr)
        for i in range(1 << 14):
            mem[i] = ((i * 37) % 11 - 5) / 10.0
        idx = (ctypes.c_int64 * 6).from_address(addr + 8192)
        for i in range(6):
            idx[i] = (i * 5) % 6

        def t(off, shape, dt=_lib.F32):
            return _lib.Tensor(bid, off, dt, len(shape),
                               (ctypes.c_int64 * 3)(*(list(shape) + [0] * 3)[:3]))

        step = dpclip.Step(2, max_grad_norm=1e6, reduction=_lib.SUM)
        step.add_embedding(_lib.Embedding(b"wte", t(8192, (2, 3), _lib.I64), t(0, (2, 3, 4)),
                                          6, 0, 0, t(16384, (6, 4)), 0.0))
        with pytest.raises(dpclip.DpclipError) as ei:
            step.set_tied(0, 0)
        assert ei.value.code == _lib.EARG
        step.add_linear(_lib.Linear(b"head", t(1024, (2, 3, 4)), t(2048, (2, 3, 6)), 0,
                                    _lib.ALGO_AUTO, _lib.Tensor(), _lib.Tensor(), 0.0))
        step.set_tied(1, 0)
        mem[16384 // 4] = 1234.0
        res = step.run(c)
        assert len(res.norms) == 2 and all(n > 0 for n in res.norms)
        assert mem[16384 // 4] != 1234.0
        step.reset(2)
        step.add_embedding(_lib.Embedding(b"wte", t(8192, (2, 3), _lib.I64), t(0, (2, 3, 4)),
                                          7, 0, 0, t(16384, (7, 4)), 0.0))
        step.add_linear(_lib.Linear(b"head", t(1024, (2, 3, 4)), t(2048, (2, 3, 6)), 0,
                                    _lib.ALGO_AUTO, _lib.Tensor(), _lib.Tensor(), 0.0))
        step.set_tied(1, 0)
        with pytest.raises(dpclip.DpclipError) as ei:
            step.run(c)
        assert ei.value.code == _lib.EINVAL and ei.value.field == "clip_step.layers[1].tied_to"
        step.close()


def test_unchanged_step_settings_are_not_set_again():
    """Step.set_events, notify_enqueued and set_outputs() (none) call into
    libdpclip only where the setting changes (each call would have a steady
    step's message encoded again); a change, and set_outputs() after
    outputs were set, still reach it, and reset() drops the outputs."""
    step = dpclip.Step(2, max_grad_norm=1.0, reduction=_lib.SUM)
    calls = []
    real = step._L

    class Counting:
        def __getattr__(self, name):
            fn = getattr(real, name)

            def call(*a):
                calls.append(name)
                return fn(*a)
            return call
    step._L = Counting()
    try:
        step.set_events(3, 4)
        step.set_events(3, 4)
        step.set_events(3, 5)
        assert calls.count("dpclip_step_set_events") == 2
        step.notify_enqueued(True)
        step.notify_enqueued(True)
        step.notify_enqueued(False)
        assert calls.count("dpclip_step_notify_enqueued") == 2
        step.set_outputs()  # (none set yet: nothing to drop)
        assert "dpclip_step_set_outputs" not in calls
        coefs = _lib.Tensor(1, 0, _lib.F32, 1, (2,))
        step.set_outputs(coefs_out=coefs)
        step.set_outputs()  # drops it
        step.set_outputs()
        assert calls.count("dpclip_step_set_outputs") == 2
        step.set_outputs(coefs_out=coefs)
        step.reset(2)  # drops it too
        step.set_outputs()
        assert calls.count("dpclip_step_set_outputs") == 3
    finally:
        step._L = real
        step.close()
