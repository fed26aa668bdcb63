"""The done flag of asynchronous GPU steps (dpclip._cuda.CudaIPC.done_flag),
on the CPU with CUDA stubbed: the step names the flag, the trainer's stream
waits on the value the notice gave (not on `done`), a daemon gone (or
one that abandoned a step's outputs) has them zeroed and then the flag
released from the host, a live one that hung up is waited for, and without
the driver's calls (or with DPCLIP_DONE_FLAG=0) the events serve as
before. The flag is the default."""
import contextlib
import ctypes
import socket
import warnings

import pytest
import torch

from dpclip import _cuda, _lib, _planner


class _Event:
    def __init__(self, **kw):
        pass

    def ipc_handle(self):
        return bytes(64)

    def record(self, stream):
        pass


class _Stream:
    cuda_stream = 1234
    made = 0  # how many were made

    def __init__(self):
        self.waited = []
        self.synced = 0
        _Stream.made += 1

    def wait_event(self, ev):
        self.waited.append(ev)

    def synchronize(self):
        self.synced += 1


class _Info:
    done_value = 7
    step_index = 1


class _Client:
    def __init__(self):
        self.words = {}
        self.released = []
        self.sock = socket.socketpair()  # the connection the flags' watcher polls

    def fileno(self):
        return self.sock[0].fileno()

    def register_event(self, handle, idx):
        return 1

    def buffer_alloc(self, size):
        buf = ctypes.create_string_buffer(size)
        self.words[41] = buf
        return 41, ctypes.addressof(buf)

    def word(self, i):
        """Word i of the flag's page (0: the flag, 1: its abandon word)."""
        return ctypes.c_uint32.from_address(ctypes.addressof(self.words[41]) + 4 * i)

    def buffer_release(self, bid):
        self.released.append(bid)

    def wait_enqueued(self, ticket):
        return _Info()

    def refs_cuda_at(self, n, ptrs_addr, refs_addr):
        """Each of n buffers (per-step outputs) at buffer 5, offset i."""
        refs = (ctypes.c_uint64 * (2 * n)).from_address(refs_addr)
        for i in range(n):
            refs[2 * i], refs[2 * i + 1] = 5, i
        return 0


class _Step:
    layout = 0

    def __init__(self):
        self.flags = []

    def reset(self, nb):
        pass

    def rebind_cuda(self, client, ptrs):
        pass

    def set_outputs(self, **kw):
        pass

    def set_events(self, rid, did):
        pass

    def notify_enqueued(self, on):
        self.notify = on

    def set_done_flag(self, flag):
        self.flags.append(flag)

    def submit(self, client):
        self.how = "submitted"
        return 1

    def run(self, client):  # a step waited for: its reply
        self.how = "ran"
        return _Info()


@pytest.fixture
def stubs(monkeypatch):
    stream = _Stream()
    waits, maps = [], []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: stream)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())

    def host_map(addr, size):
        maps.append((addr, size))
        return 0xDEAD0000

    monkeypatch.setattr(_lib, "cuda_host_map", host_map)
    monkeypatch.setattr(_lib, "cuda_wait_value", lambda s, d, v: waits.append((s, d, v)))
    monkeypatch.setattr(_lib, "cuda_host_unmap", lambda addr: None)
    monkeypatch.setenv("DPCLIP_DONE_FLAG", "1")
    return stream, waits, maps


def _run(io, step, asynchronous=True, gated=False):
    if gated:  # (the gate's coefficients: not under test here)
        io.coefs_out = lambda nb, device: torch.ones(nb)
        io._coefs_ref = (0, 0)
    return io.run(step, _planner.Plan([], []), 1, torch.device("cuda", 0), 0, gated,
                  asynchronous, write=False)


def test_async_step_waits_on_the_flag_not_the_event(stubs):
    stream, waits, maps = stubs
    client, step = _Client(), _Step()
    io = _cuda.CudaIPC(client)
    _run(io, step)
    ref = step.flags[-1]
    assert ref is not None and ref.buffer == 41 and ref.offset == 0
    # the flag and its abandon word
    assert ref.dtype == _lib.I32 and ref.ndim == 1 and tuple(ref.shape)[:1] == (2,)
    assert maps == [(ctypes.addressof(client.words[41]), _cuda._FLAG_BYTES)]
    assert waits == [(1234, 0xDEAD0000, 7)] and stream.waited == []
    # the daemon gave the step's outputs up: the host zeroes them and stores
    # the last value itself, so the stream goes on
    word = client.word(0)
    assert word.value == 0
    out = torch.ones(5)
    io._arenas.append(out)
    client.word(1).value = 7
    io.release_flags()
    assert word.value == 7 and not out.any()
    io.close()
    assert client.released == [41]


class _DeviceOutput:
    """An output arena on cuda:0, as release_flags sees it."""
    device = torch.device("cuda", 0)

    def __init__(self, addr, n):
        self.addr, self.n = addr, n

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return self.addr

    def numel(self):
        return self.n

    def element_size(self):
        return 2


def test_release_zeroes_device_outputs_on_the_stream_made_with_the_flag(stubs, monkeypatch):
    """A dead daemon's outputs on the device: zeroed by the driver's memset
    on the stream made when the flag was (after the device's last ready),
    with no stream made on the watcher's thread: there, with the trainer's
    thread blocked in a device synchronisation behind the flag, making one
    waits for that synchronisation (seen on an H200), so nothing would ever
    release the flag."""
    stream, waits, maps = stubs
    zeroed = []
    monkeypatch.setattr(_lib, "cuda_zero_async", lambda s, d, n: zeroed.append((s, d, n)))
    client, step = _Client(), _Step()
    io = _cuda.CudaIPC(client)
    _run(io, step)
    zs = io._zero_streams[0]
    made = _Stream.made
    io._arenas += [_DeviceOutput(0x1000, 300), _DeviceOutput(0x9000, 8)]
    client.word(1).value = 7  # abandoned
    io.release_flags()
    assert _Stream.made == made  # none made while releasing
    assert zeroed == [(_Stream.cuda_stream, 0x1000, 600), (_Stream.cuda_stream, 0x9000, 16)]
    assert len(zs.waited) == 1 and zs.waited[0] is io._events[0][0]  # after the last ready
    assert zs.synced == 1
    assert client.word(0).value == 7
    io.close()


def test_outputs_that_cannot_be_zeroed_are_never_released(stubs, monkeypatch):
    """Fail closed: where the zeroing fails, the flag stays unreleased (the
    stream waits for good) and a warning says why."""
    _, _, _ = stubs

    def fail(s, d, n):
        raise _lib.DpclipError(_lib.EUNAVAIL, "", "no memset")

    monkeypatch.setattr(_lib, "cuda_zero_async", fail)
    client, step = _Client(), _Step()
    io = _cuda.CudaIPC(client)
    _run(io, step)
    io._arenas.append(_DeviceOutput(0x1000, 4))
    client.word(1).value = 7  # abandoned
    with pytest.warns(RuntimeWarning, match="could not be zeroed .*no memset"):
        io.release_flags()
    assert client.word(0).value == 0
    io.close()


def test_switched_off_steps_wait_for_their_replies(stubs, monkeypatch):
    """DPCLIP_DONE_FLAG=0: no flag, and an asynchronous step waits for its
    reply (no early notice) before the stream waits on `done`: a stream
    let go behind the notice could apply the outputs of a daemon that died
    before its noise. A gated (data-parallel) step stays asynchronous on the
    event: its coefficients gate it."""
    stream, waits, maps = stubs
    monkeypatch.setenv("DPCLIP_DONE_FLAG", "0")
    step = _Step()
    run = _run(_cuda.CudaIPC(_Client()), step)
    assert step.flags == [None] and waits == [] and maps == [] and len(stream.waited) == 1
    assert step.how == "ran" and step.notify is False and run.res is not None
    gated = _Step()
    run = _run(_cuda.CudaIPC(_Client()), gated, gated=True)
    assert gated.how == "submitted" and gated.notify is True and run.res is None


def test_the_flag_is_the_default(stubs, monkeypatch):
    """Unset, an asynchronous CUDA step waits on the flag."""
    stream, waits, _ = stubs
    monkeypatch.delenv("DPCLIP_DONE_FLAG")
    step = _Step()
    _run(_cuda.CudaIPC(_Client()), step)
    assert step.flags[-1] is not None and len(waits) == 1 and stream.waited == []


def test_no_driver_support_falls_back_to_replies(stubs, monkeypatch):
    stream, waits, _ = stubs

    def refuse(addr, size):
        raise _lib.DpclipError(_lib.EUNAVAIL, "", "no stream memory operations")

    monkeypatch.setattr(_lib, "cuda_host_map", refuse)
    client, step = _Client(), _Step()
    io = _cuda.CudaIPC(client)
    with pytest.warns(_lib.PerformanceWarning, match=r"no done flag on cuda:0 \(no stream "
                      r"memory operations\)"):
        _run(io, step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: not tried again
        _run(io, step)
    assert step.flags == [None, None] and waits == [] and len(stream.waited) == 2
    assert step.how == "ran" and step.notify is False  # its reply, not an early notice
    assert client.released == [41]  # its page released at once, and not tried again


def test_daemon_gone_releases_the_flag(fresh_daemon, stubs, monkeypatch):
    """The daemon killed while a step is in flight: the flag's watcher sees
    its socket hang up and, once its process is gone, zeroes the outputs
    (it may have died between a step's clipped sums and their noise) and
    stores the last value from this host, so that a stream waiting on it
    (and a host blocked behind that stream) goes on. A real daemon and
    shared page; CUDA stubbed."""
    import time

    client = _lib.Client(fresh_daemon.socket, "flag-watch")
    io = _cuda.CudaIPC(client)
    f = io.done_flag(torch.device("cuda", 0))
    assert f is not None and io._watcher is not None
    f.last = 5  # the notice's value of the step in flight
    word = ctypes.c_uint32.from_address(f.addr)
    out = torch.full((7,), 3.0)  # an output the killed daemon may have half written
    io._arenas.append(out)
    time.sleep(0.2)
    assert word.value == 0  # nothing stored while the daemon lives
    fresh_daemon.kill()
    deadline = time.monotonic() + 5
    while word.value != 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert word.value == 5
    assert not out.any()  # zeroed before the stream was let go
    io.close()  # the watcher gone, then the page
    assert io._watcher is None
    client.close()


def test_close_stops_the_watcher(daemon, stubs, monkeypatch):
    client = _lib.Client(daemon.socket, "flag-close")
    io = _cuda.CudaIPC(client)
    f = io.done_flag(torch.device("cuda", 0))
    f.last = 9
    t = io._watcher[0]
    assert t.is_alive()
    io.close()  # (the page is unmapped after: not read again)
    assert not t.is_alive() and io._watcher is None and io._flags == {}
    client.close()


def test_norm_group_members_use_the_event(stubs, monkeypatch):
    """A norm group's steps complete through their replies: the daemon
    refuses a done flag there, so a member's engine asks for none."""
    from types import SimpleNamespace

    from dpclip import _group, _modes
    stream, waits, maps = stubs
    io = _cuda.CudaIPC(_Client())
    engine = SimpleNamespace(_cuda=io, client=io.client)
    monkeypatch.setattr(_group, "join", lambda group, client: None)
    _modes.Grouped(_modes.Local(engine), SimpleNamespace(id=0)).open(1e-5, 0.0,
                                                                     torch.device("cuda", 0))
    step = _Step()
    _run(io, step)
    assert step.flags == [None] and waits == [] and maps == [] and len(stream.waited) == 1


@pytest.mark.parametrize("buffers", ["step", "engine"])
def test_output_buffers_start_as_zeros(stubs, monkeypatch, buffers):
    """An output buffer is zeros when made, a step's own as an engine's
    arena: a step whose outputs the daemon cannot zero (a broken CUDA
    context) still lets the stream apply the buffer, which must not hold
    the allocator's leftovers (this process's data). torch.empty is made to
    return such leftovers here."""
    from dpclip._layers import Out
    monkeypatch.setenv("DPCLIP_GRAD_BUFFERS", buffers)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(3.0))
    client = _Client()
    client.register_cuda = lambda ptr: (5, 0)
    param = torch.nn.Parameter(torch.ones(2, 3))
    out = Out(param)
    io = _cuda.CudaIPC(client)
    io.run(_Step(), _planner.Plan([], [out]), 1, torch.device("cpu"), 0, False, True)
    if buffers == "engine":
        assert out.buf is not None and out.buf.numel() == 6 and not out.buf.any()
        assert param.grad is out.alias
    else:  # (let go once the stream waits: param.grad alone holds it)
        assert out.buf is None and out.ref == (5, 0)
        assert [w().data_ptr() for w in io._step_bufs] == [param.grad.data_ptr()]
    assert param.grad.shape == (2, 3) and not param.grad.any()


@pytest.mark.parametrize("buffers", ["step", "engine"])
def test_grads_alias_the_outputs_while_the_notice_is_awaited(stubs, monkeypatch, buffers):
    """An asynchronous step is sent first, then param.grad aliases its
    outputs while the daemon accepts it (the host's wait is not idle), and
    a refusal at the notice puts param.grad back."""
    from dpclip._layers import Out
    monkeypatch.setenv("DPCLIP_GRAD_BUFFERS", buffers)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    client = _Client()
    client.register_cuda = lambda ptr: (5, 0)
    param = torch.nn.Parameter(torch.ones(2, 3))
    before = torch.full((2, 3), 9.0)
    param.grad = before
    out = Out(param)
    seen = []

    class Sending(_Step):
        def submit(self, client):
            seen.append(param.grad is before)
            return 1

    io = _cuda.CudaIPC(client)
    io.run(Sending(), _planner.Plan([], [out]), 1, torch.device("cpu"), 0, False, True)
    assert seen == [True] and param.grad is not before
    if buffers == "engine":
        assert param.grad is out.alias

    def refuse(ticket):
        assert param.grad is out.alias  # aliased while the notice was awaited
        raise _lib.DpclipError(_lib.EINVAL, "clip_step", "refused")

    param.grad = before
    client.wait_enqueued = refuse
    with pytest.raises(_lib.DpclipError):
        io.run(Sending(), _planner.Plan([], [out]), 1, torch.device("cpu"), 0, False, True)
    assert param.grad is before


def test_a_template_plan_rebinds_without_comparing_parts(monkeypatch):
    """CudaIPC._layers: a plan made again from the template of the one the
    step holds rebinds (its parts are that plan's); a plan of another
    serial rebinds where its parts' signature is the same, and takes the
    serial over; other parts build the step again."""
    from dpclip._layers import Part
    built, rebound = [], []

    class Layout(_Step):
        layout = 3

        def reset(self, nb):
            built.append(nb)

        def rebind_cuda(self, client, ptrs):
            rebound.append(list(ptrs))

    monkeypatch.setattr(_cuda, "add_layers", lambda step, parts, algorithm, refs: None)
    signatures = []
    real = _cuda._signature
    monkeypatch.setattr(_cuda, "_signature", lambda plan: signatures.append(1) or real(plan))

    def plan(width, serial):
        pt = Part(None, "linear", "fc", None, None, (2, 3, width), torch.float32, (2, 3, 5),
                  torch.float32, None, None, False)
        return _planner.Plan([pt], [], bool(serial), serial)

    io, step = _cuda.CudaIPC(_Client()), Layout()
    assert io._layers(step, plan(4, 7), 2, 0, None, [1, 2], False) is False  # built
    assert io._layers(step, plan(4, 7), 2, 0, None, [3, 4], False) is True   # its template
    assert len(signatures) == 1 and rebound == [[3, 4]]
    assert io._layers(step, plan(4, 9), 2, 0, None, [5, 6], False) is True   # same parts
    assert len(signatures) == 2 and io._bound[5] == 9
    assert io._layers(step, plan(4, 9), 2, 0, None, [7, 8], False) is True
    assert len(signatures) == 2  # serial 9 taken over: no comparison
    assert io._layers(step, plan(6, 0), 2, 0, None, [9, 9], False) is False  # other parts
    assert built == [2, 2] and rebound == [[3, 4], [5, 6], [7, 8]]


def _hung_up(stubs):
    """A transport whose flag (the notice's value 7) has its watcher, and
    whose 'daemon' (the other end of a socketpair: this very process, so
    alive) has just hung up; one output of ones."""
    client = _Client()
    io = _cuda.CudaIPC(client)
    f = io.done_flag(torch.device("cuda", 0))
    f.last = 7
    out = torch.ones(4)
    io._arenas.append(out)
    client.sock[1].close()
    return io, f, out


def test_hang_up_waits_for_a_live_daemon(stubs, monkeypatch):
    """A daemon alive stores its flag itself once the step's work ends (its
    session closed meanwhile): the watcher waits for that, saying once why
    when it waits long, and zeroes nothing, as the outputs are the step's,
    noise and all."""
    import os
    import time

    said = []
    monkeypatch.setattr(_cuda, "_UNKNOWN_PEER_S", 0.1)
    monkeypatch.setattr(_cuda.warnings, "warn", lambda msg, *a, **k: said.append(msg))
    io, f, out = _hung_up(stubs)
    time.sleep(0.3)
    assert f.word(0) == 0 and out.all()  # still waiting: the daemon lives
    assert len(said) == 1 and "pid %d" % os.getpid() in said[0], said
    ctypes.c_uint32.from_address(f.addr).value = 7  # the daemon stores it
    io._watcher[0].join(5)
    assert not io._watcher[0].is_alive() and f.word(0) == 7 and out.all()
    io.close()


def test_hang_up_after_an_abandoned_step(stubs):
    """The daemon could not zero a failed step's outputs (its abandon word):
    the watcher zeroes them, then releases the stream."""
    io, f, out = _hung_up(stubs)
    ctypes.c_uint32.from_address(f.addr + 4).value = 7
    io._watcher[0].join(5)
    assert not io._watcher[0].is_alive() and f.word(0) == 7 and not out.any()
    io.close()


def test_hidden_daemon_taken_for_gone_after_a_while(stubs, monkeypatch):
    """A daemon whose pid this process cannot see (another pid namespace)
    is taken for gone once _UNKNOWN_PEER_S has passed without its flag."""
    import time

    monkeypatch.setattr(_cuda, "_peer", lambda fd: None)
    monkeypatch.setattr(_cuda, "_UNKNOWN_PEER_S", 0.3)
    t0 = time.monotonic()
    io, f, out = _hung_up(stubs)
    io._watcher[0].join(5)
    assert time.monotonic() - t0 >= 0.3
    assert f.word(0) == 7 and not out.any()
    io.close()


def test_the_peer_and_its_end():
    """_peer names the process at the socket's other end (with its start
    time, so that a reused pid is not taken for it); _gone sees a process
    ended, or another one under its pid."""
    import os
    import subprocess

    from dpclip import _flags
    a, b = socket.socketpair()
    me = _flags._peer(a.fileno())
    assert me is not None and me[0] == os.getpid() and not _flags._gone(me)
    assert _flags._gone((me[0], "not its start time"))
    p = subprocess.Popen(["true"])
    p.wait()
    assert _flags._gone((p.pid, me[1]))
    a.close()
    b.close()


def test_the_current_streams_object_is_made_once_per_stream(monkeypatch):
    """CudaIPC._current_stream: torch's current stream, its Stream object
    made once per (device, stream handle) and reused while that stream is
    current; another stream gets its own; one whose object does not carry
    the handle read is not kept; and at most _STREAMS_KEPT are kept."""
    made = []

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

    current = {"handle": 7, "object": None}

    def current_stream(device=None):
        made.append(current["handle"])
        return Stream(current["handle"] if current["object"] is None else current["object"])

    monkeypatch.setattr(_cuda, "_RAW_STREAM", lambda idx: current["handle"])
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    io, dev = _cuda.CudaIPC(_Client()), torch.device("cuda", 0)
    a = io._current_stream(dev)
    assert io._current_stream(dev) is a and a.cuda_stream == 7 and made == [7]
    current["handle"] = 9  # (torch.cuda.stream(s): another stream is current)
    b = io._current_stream(dev)
    assert b is not a and b.cuda_stream == 9 and io._current_stream(dev) is b
    current["handle"] = 7
    assert io._current_stream(dev) is a and made == [7, 9]
    current["handle"], current["object"] = 11, 12  # the object's handle is not the one read
    io._current_stream(dev)
    io._current_stream(dev)
    assert made == [7, 9, 11, 11]
    current["object"] = None
    for h in range(100, 100 + 2 * _cuda._STREAMS_KEPT):  # a new stream each step
        current["handle"] = h
        io._current_stream(dev)
        assert len(io._streams) <= _cuda._STREAMS_KEPT
