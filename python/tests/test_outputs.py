"""The CUDA transport's output buffers (dpclip._outputs._out_buffers), on the
CPU with the client stubbed: every output without a buffer gets a slice of
one zeroed arena per dtype, in the outputs' order, each registered at its
own address, param.grad's alias a view of it; outputs that have one keep
it. Consecutive parameters' gradients then lie end to end, which the
data-parallel all-reduce sums in place (dpclip._gate.span)."""
import ctypes

import pytest
import torch

from dpclip import _gate, _outputs
from dpclip._gate import _storage_ptr
from dpclip._layers import Out


class _Client:
    def __init__(self):
        self.registered = []

    def register_cuda(self, ptr):
        self.registered.append(ptr)
        return 5, len(self.registered)


def _outs(*shapes, dtype=torch.float32):
    return [Out(torch.nn.Parameter(torch.ones(s, dtype=dtype))) for s in shapes]


def test_outputs_share_one_zeroed_arena_in_order():
    client = _Client()
    outs = _outs((3, 4), (8,), (5,), (2, 2))
    cpu = torch.device("cpu")
    assert _outputs._out_buffers(client, outs, cpu)
    base = _storage_ptr(outs[0].buf)
    at = 0
    for o in outs:
        assert _storage_ptr(o.buf) == base  # one arena
        assert o.buf.storage_offset() == at and o.buf.numel() == o.numel
        assert o.buf.storage_offset() % _outputs._OUT_ALIGN == 0  # vector stores stay possible
        assert float(o.buf.abs().sum()) == 0.0  # zeros, not leftovers
        assert o.alias is not None and o.alias.shape == o.param.shape
        assert o.alias.data_ptr() == o.buf.data_ptr()
        at += -(-o.numel // _outputs._OUT_ALIGN) * _outputs._OUT_ALIGN
    assert client.registered == [o.buf.data_ptr() for o in outs]  # each at its own address
    assert [o.ref for o in outs] == [(5, 1), (5, 2), (5, 3), (5, 4)]
    # made once: a later step keeps them
    kept = [o.buf for o in outs]
    assert not _outputs._out_buffers(client, outs, cpu)
    assert all(o.buf is b for o, b in zip(outs, kept)) and len(client.registered) == 4
    # the gradients of the aligned run lie end to end: one view for a collective
    grads = [o.alias for o in outs]
    flat = _gate.span(grads[:2])  # 12 and 8 elements: no padding between them
    assert flat is not None and flat.numel() == 20 and flat.data_ptr() == grads[0].data_ptr()
    flat += 1.0
    assert float(grads[0].sum()) == 12.0 and float(grads[1].sum()) == 8.0
    # (5,) is padded to 8: a gap follows it, which no collective may touch
    assert _gate.span(grads[2:]) is None


def test_each_dtype_its_own_arena_and_only_missing_buffers_made():
    client = _Client()
    f32 = _outs((4,), (4,))
    bf16 = _outs((4,), dtype=torch.bfloat16)
    outs = [f32[0], bf16[0], f32[1]]
    _outputs._out_buffers(client, outs, torch.device("cpu"))
    assert bf16[0].buf.dtype == torch.bfloat16 and f32[0].buf.dtype == torch.float32
    assert f32[1].buf.storage_offset() == 4  # its dtype's arena, after f32[0]
    assert _storage_ptr(f32[0].buf) == _storage_ptr(f32[1].buf)
    assert _storage_ptr(bf16[0].buf) != _storage_ptr(f32[0].buf)
    # one output losing its buffer (as on another device) gets a new one; the others keep theirs
    kept = f32[0].buf
    f32[1].buf = None
    assert _outputs._out_buffers(client, outs, torch.device("cpu"))
    assert f32[0].buf is kept and f32[1].buf is not None and f32[1].buf.storage_offset() == 0


def test_span_refuses_what_is_not_end_to_end():
    a = torch.zeros(16)
    assert _gate.span([a[0:4], a[4:10], a[10:16]]) is not None
    assert _gate.span([a[0:4], a[5:10]]) is None  # a gap: maybe another tensor's
    assert _gate.span([a[4:8], a[0:4]]) is None  # out of order
    assert _gate.span([a[0:4], torch.zeros(4)]) is None  # another storage
    m = torch.zeros(4, 4)
    assert _gate.span([m[:, :2], m[:, 2:]]) is None  # not contiguous


def test_arenas_hold_at_most_their_bytes(monkeypatch):
    """_ARENA_BYTES caps an arena (one allocation of a whole model's
    gradients may find no room where pieces would): the outputs fill one
    arena in order until the next does not fit, which opens the next; an
    output larger than the cap has one of its own."""
    monkeypatch.setattr(_outputs, "_ARENA_BYTES", 64)  # 16 f32
    outs = _outs((8,), (8,), (4,), (40,), (4,), (4,))
    _outputs._out_buffers(_Client(), outs, torch.device("cpu"))
    arenas = [_storage_ptr(o.buf) for o in outs]
    # [8, 8] | [4] (8 + 8 + 4 > 16) | [40] alone | [4, 4]
    assert arenas[0] == arenas[1] and len({arenas[0], arenas[2], arenas[3], arenas[4]}) == 4
    assert arenas[4] == arenas[5]
    assert [o.buf.storage_offset() for o in outs] == [0, 8, 0, 0, 0, 4]
    assert _gate.span([o.alias for o in outs[:2]]) is not None
    assert _gate.span([o.alias for o in outs[1:3]]) is None  # across arenas: gathered


def test_arena_bytes_count_device_arenas_only():
    """What engine.output_buffer_bytes reports: the bytes of the arenas on
    a GPU (here none: the CPU's are left out), each arena whole."""
    outs = _outs((3, 4), (8,), (5,))
    arenas = []
    _outputs._out_buffers(_Client(), outs, torch.device("cpu"), arenas)
    assert len(arenas) == 1 and arenas[0].numel() == 12 + 8 + 8  # widths to _OUT_ALIGN
    assert _outputs.arena_bytes(arenas) == 0

    class _OnGpu:  # an arena as arena_bytes reads it
        def __init__(self, n, esize):
            self.device = torch.device("cuda", 0)
            self._n, self._e = n, esize

        def numel(self):
            return self._n

        def element_size(self):
            return self._e

    assert _outputs.arena_bytes([_OnGpu(28, 4), _OnGpu(10, 2)] + arenas) == 28 * 4 + 10 * 2


class _RefsClient:
    """refs_cuda_at as libdpclip answers it: each pointer's (buffer id,
    offset), here (7, the pointer) or a fixed id per call when `moved`."""
    def __init__(self):
        self.calls = 0
        self.shift = 0

    def refs_cuda_at(self, n, ptrs_addr, refs_addr):
        self.calls += 1
        ptrs = (ctypes.c_uint64 * n).from_address(ptrs_addr)
        assert all(ptrs)  # every buffer's address
        refs = (ctypes.c_uint64 * (2 * n)).from_address(refs_addr)
        for i in range(n):
            refs[2 * i], refs[2 * i + 1] = 7, i * 1000 + self.shift
        return 0

    def check(self, rc):
        raise AssertionError("refs_cuda_at failed: %d" % rc)


def test_step_buffers_live_as_long_as_param_grad(monkeypatch):
    """DPCLIP_GRAD_BUFFERS=step (dpclip._outputs.step_buffers): each output
    a buffer of its own, zeros (torch.empty is made to return leftovers
    here: the daemon may fail without writing them), resolved in one call,
    param.grad's alias a view of it; the step's layers are built again only
    where a reference moved; once released the transport holds none that
    param.grad aliases, and such a buffer lives exactly as long as that
    param.grad; one that param.grad copies stays until the next step's."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(3.0))
    client = _RefsClient()
    outs = _outs((3, 4), (5,))
    outs.append(Out(torch.nn.Parameter(torch.ones(2, 3, dtype=torch.float64))))  # f32 on the wire
    cpu = torch.device("cpu")
    assert _outputs.step_buffers(client, outs, cpu)  # new references
    assert client.calls == 1
    assert [o.ref for o in outs] == [(7, 0), (7, 1000), (7, 2000)]
    for o in outs:
        assert o.buf.numel() == o.numel and o.buf.dtype == o.dtype and not o.buf.any()
    assert outs[0].alias.data_ptr() == outs[0].buf.data_ptr()
    assert outs[2].alias is None  # its param.grad is a copy (another dtype)
    assert not _outputs.step_buffers(client, outs, cpu)  # the same references: no rebuild
    client.shift = 4
    assert _outputs.step_buffers(client, outs, cpu)  # one moved
    outs[0].param.grad = outs[0].alias
    held = _outputs.held_weakly(outs)
    _outputs.release_step_buffers(outs)
    # the copied one's buffer stays (the copy waits behind the daemon's done)
    assert [o.buf is None for o in outs] == [True, True, False]
    assert all(o.alias is None for o in outs)
    assert [o.ref for o in outs] == [(7, 4), (7, 1004), (7, 2004)]  # kept, to compare
    alive = [w() is not None for w in held]
    assert alive == [True, False, True]  # param.grad's alias keeps its buffer
    outs[0].param.grad = None  # zero_grad(set_to_none=True)
    assert held[0]() is None


def test_out_refs_name_each_parts_outputs():
    """What Step.rebind_outputs gets once per-step buffers moved
    (dpclip._cuda._out_refs): 4 values a part, the weight's (buffer id,
    offset) then the bias's, the slice's element offset in bytes added,
    buffer 0 where the part has no such output."""
    from types import SimpleNamespace
    from dpclip._cuda import _out_refs
    outs = _outs((4, 2), (3,))
    _outputs.step_buffers(_RefsClient(), outs, torch.device("cpu"))
    parts = [SimpleNamespace(w=(outs[0], 0, (2, 2)), b=None),
             SimpleNamespace(w=(outs[0], 4, (2, 2)), b=(outs[1], 1, (2,)))]
    refs = list(_out_refs(SimpleNamespace(parts=parts)))
    assert refs == [7, 0, 0, 0, 7, 16, 7, 1004]


def test_grad_buffers_setting_named(monkeypatch):
    """DPCLIP_GRAD_BUFFERS: "step" where unset or empty, "engine" taken,
    anything else refused by name before the engine connects (no daemon
    at the socket: the setting's error, not the connection's)."""
    from dpclip._cuda import grad_buffers
    from dpclip.torch import PrivacyEngine
    for value, want in (("", "step"), ("step", "step"), ("engine", "engine")):
        monkeypatch.setenv("DPCLIP_GRAD_BUFFERS", value)
        assert grad_buffers() == want
    monkeypatch.delenv("DPCLIP_GRAD_BUFFERS")
    assert grad_buffers() == "step"
    monkeypatch.setenv("DPCLIP_GRAD_BUFFERS", "arena")
    with pytest.raises(ValueError, match="DPCLIP_GRAD_BUFFERS='arena'"):
        PrivacyEngine("/nonexistent/dpclip.sock")
