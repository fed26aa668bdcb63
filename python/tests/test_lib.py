"""The ctypes bindings: struct layouts against the C header, errors, buffers."""
import ctypes
import os
import shutil
import subprocess

import pytest

from conftest import REPO
import dpclip
from dpclip import _lib

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
                      "step_index", "compute_ns", "epsilon", "delta"],
}


def test_struct_layouts_match_the_header(tmp_path):
    """Compile a program that prints sizeof/offsetof of every struct the
    bindings mirror, and compare with ctypes."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert cc, "a C compiler is needed to check the bindings against dpclip.h"
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
