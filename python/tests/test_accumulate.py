"""Gradient accumulation (issue 39): several backwards, one optimizer.step(),
one logical step. Against the per-sample f64 reference of the whole logical
batch (noise off); the noise drawn once per logical step (std sigma*C/E);
the ledger charged once per logical step, at the logical batch's rate; a
logical step that fails or is dropped in its middle releases and charges
nothing; engine.logical_batches() splits and steps as documented."""
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from dpclip import DpclipError
from dpclip._batches import split
from dpclip.data import DPDataLoader
from dpclip.torch import PrivacyEngine, reduce_loss
from conftest import REPO
from models import SeqModel, per_sample_losses, reference, seq_data
from models import between as _between, max_rel as _max_rel

SPLITS = {"8x8": [8] * 8, "5+27+32": [5, 27, 32]}


def _pieces(sizes):
    out, at = [], 0
    for n in sizes:
        out.append(slice(at, at + n))
        at += n
    return out


def _engine(socket, model, **kw):
    engine = PrivacyEngine(socket, allow_insecure_seed=True)
    terms = dict(noise_multiplier=0.0, max_grad_norm=1.0, loss_reduction="mean")
    terms.update(kw)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), **terms)
    return engine, model, opt


def _accumulate(model, opt, x, y, sizes, reduction="mean", autocast=None):
    opt.zero_grad()
    for sl in _pieces(sizes):
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            out = model(x[sl])
        reduce_loss(per_sample_losses("seq", out.float(), y[sl]), reduction).backward()
    opt.step()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("sizes", list(SPLITS.values()), ids=list(SPLITS))
def test_micro_batches_equal_the_whole_logical_batch(daemon, sizes, reduction):
    """A logical batch of 64 in micro-batches (8 x 8; ragged 5 + 27 + 32),
    each loss its micro-batch's own mean: every parameter's gradient is the
    per-sample f64 reference's of the 64 together, divided by the expected
    LOGICAL batch size; the norms are the 64 samples', in order; one step."""
    torch.manual_seed(11)
    model = SeqModel()
    (x,), y = seq_data(64, seed=12)
    _, norms, _ = reference(model, "seq", (x,), y, 1e9, "sum", 1)
    C, E = _between(norms), 70  # E: the logical batch's expected size, not 64
    want, ref_norms, coefs = reference(model, "seq", (x,), y, C, reduction, E)
    assert (coefs < 1).any() and (coefs == 1).any()
    engine, model, opt = _engine(daemon.socket, model, max_grad_norm=C,
                                 loss_reduction=reduction, expected_batch_size=E)
    _accumulate(model, opt, x, y, sizes, reduction)
    assert engine.steps == 1
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        assert _max_rel(p.grad, want[n]) < 2e-4, (n, _max_rel(p.grad, want[n]))
    assert engine.last_norms.shape == (64,)
    assert _max_rel(engine.last_norms, ref_norms) < 1e-4
    assert torch.allclose(engine.last_coefs.double(), coefs, rtol=1e-4, atol=1e-6)
    # outside a norm group a host micro-batch's reply is awaited at the next
    # one: two staging arenas held at most
    assert 1 <= engine.micro_batches_held_peak <= 2, engine.micro_batches_held_peak
    # the next logical step starts afresh: the same batch gives the same gradient
    _accumulate(model, opt, x, y, sizes[::-1], reduction)
    for n, p in model.named_parameters():
        assert _max_rel(p.grad, want[n]) < 2e-4, n
    assert engine.steps == 2
    engine.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_micro_batches_of_one_template_are_staged_and_let_go(daemon, monkeypatch, device):
    """A model every module of which runs once a pass (SteadyModel: its
    steps have a plan template): micro-batches of one shape are planned as
    they are captured (dpclip._planner.Replanner.stage), and once a
    micro-batch is sent nothing staged holds its tensors (a logical batch is
    split to save memory). Every logical step against its f64 reference
    (on CUDA the staged tensors are named at each backward's end, and the
    daemon's f32 is TF32's)."""
    import gc
    import weakref

    from dpclip import _lib, _planner
    from models import SteadyModel
    torch.manual_seed(13)
    model = SteadyModel()
    model.use_extra = True
    batches = [seq_data(24, seed=30 + k) for k in range(3)]
    refs = [reference(model, "seq", (x,), y, 0.5, "sum", 0) for (x,), y in batches]
    hits = []
    staged_plan = _planner.Replanner._staged_plan
    monkeypatch.setattr(_planner.Replanner, "_staged_plan", lambda rp, layers: (
        lambda p: (hits.append(p is not None), p)[1])(staged_plan(rp, layers)))
    tol = 2e-4 if device == "cpu" else 5e-3
    rebound = []
    rebind = _lib.Step.rebind  # (CUDA: a staged plan's step rebinds from refs named earlier)
    monkeypatch.setattr(_lib.Step, "rebind", lambda st, r: (rebound.append(1), rebind(st, r))[1])
    engine, model, opt = _engine(daemon.socket, model.to(device), max_grad_norm=0.5,
                                 loss_reduction="sum")
    rp = engine._replanner
    for k, (((x,), y), (want, _, coefs)) in enumerate(zip(batches, refs)):
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        held = []
        for sl in _pieces([8, 8, 8]):
            out = model(x[sl])  # (sends the micro-batch before it)
            if held:
                gc.collect()
                assert held[-1]() is None and rp.n_staged == 0, k
            reduce_loss(per_sample_losses("seq", out, y[sl]), "sum").backward()
            held.append(weakref.ref(engine._layers[0].records[-1][0]))
        opt.step()
        for n, p in model.named_parameters():
            assert _max_rel(p.grad.cpu(), want[n]) < tol, (k, n)
        assert torch.allclose(engine.last_coefs.double().cpu(), coefs, rtol=tol, atol=1e-6)
    engine.close()
    # the micro-batches after the first logical step's first ones came staged
    assert hits[-6:] == [True] * 6, hits
    assert len(rebound) >= (6 if device == "cuda" else 0), rebound


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sizes", list(SPLITS.values()), ids=list(SPLITS))
def test_micro_batches_equal_the_whole_logical_batch_cuda(daemon, sizes, dtype):
    """The same on the GPU: f32, and bf16 under autocast (to bf16 accuracy)."""
    if not PrivacyEngine(daemon.socket, allow_insecure_seed=True).client.info.has_cuda:
        pytest.skip("dpclipd was built without CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(11)
    model = SeqModel()
    (x,), y = seq_data(64, seed=12)
    _, norms, _ = reference(model, "seq", (x,), y, 1e9, "sum", 1)
    C, E = _between(norms), 70
    want, ref_norms, _ = reference(model, "seq", (x,), y, C, "mean", E)
    engine, model, opt = _engine(daemon.socket, model.cuda(), max_grad_norm=C,
                                 expected_batch_size=E)
    bf16 = dtype == "bfloat16"
    _accumulate(model, opt, x.cuda(), y.cuda(), sizes,
                autocast=torch.bfloat16 if bf16 else None)
    engine.synchronize()
    # f32: the daemon's GPU kernels multiply f32 on TF32 tensor cores and
    # clip by the certified bound of that path (e about 2.2e-3,
    # docs/design.md "Certified sensitivity"), whatever the trainer's TF32
    tol = 0.05 if bf16 else 5e-3
    for n, p in model.named_parameters():
        assert _max_rel(p.grad.cpu(), want[n]) < tol, n
    assert _max_rel(engine.last_norms, ref_norms) < (0.02 if bf16 else 5e-3)
    engine.close()


def test_noise_is_drawn_once_per_logical_step(daemon):
    """Zero gradients in 4 micro-batches: param.grad is the noise alone,
    std sigma*C/E (E the logical batch's expected size; 4 draws would give
    twice that), over 1e5 values, fresh at each logical step."""
    sigma, C, E = 1.5, 2.0, 32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(320, 320), nn.LayerNorm(320))
    engine, model, opt = _engine(daemon.socket, model, noise_multiplier=sigma,
                                 max_grad_norm=C, expected_batch_size=E)
    vals = []
    for _ in range(2):
        opt.zero_grad()
        for _ in range(4):
            (model(torch.randn(8, 320)) * 0.0).sum().backward()
        opt.step()
        vals.append(torch.cat([p.grad.reshape(-1).double() for p in model.parameters()]))
    assert not torch.equal(vals[0], vals[1])
    for v in vals:
        n, want = v.numel(), sigma * C / E
        assert n >= 100000
        assert abs(float(v.std()) - want) < 6 * want / math.sqrt(2 * n), (float(v.std()), want)
        assert abs(float(v.mean())) < 6 * want / math.sqrt(n)
    assert engine.steps == 2 and engine.last_norms.shape == (32,)
    engine.close()


def _ledger(socket, micro, steps, q=0.02):
    """epsilon after each of `steps` steps of `micro` micro-batches each."""
    model = nn.Linear(6, 3)
    engine, model, opt = _engine(socket, model, noise_multiplier=1.0, sample_rate=q,
                                 expected_batch_size=12, target_delta=1e-5)
    eps = []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro):
            model(torch.randn(4, 6)).sum().backward()
        opt.step()
        eps.append(engine.last_epsilon)
    engine.close()
    return eps


def test_the_ledger_charges_once_per_logical_step(daemon):
    """epsilon after k logical steps of 3 micro-batches equals epsilon after
    k whole steps at the logical batch's q (fresh jobs): charged once each."""
    whole = _ledger(daemon.socket, 1, 3)
    accumulated = _ledger(daemon.socket, 3, 3)
    assert 0 < whole[0] < whole[1] < whole[2] < math.inf
    for a, w in zip(accumulated, whole):
        assert a == pytest.approx(w, rel=1e-9), (accumulated, whole)


def test_a_failing_micro_batch_releases_and_charges_nothing(daemon):
    """Micro-batch 1 of 3 has a non-finite gradient: step() raises, no
    parameter moves, param.grad is untouched, and the job is charged
    nothing (its next logical step costs what a fresh job's first does)."""
    torch.manual_seed(5)
    model = nn.Linear(6, 3)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.02, expected_batch_size=12,
        target_delta=1e-5)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    for k in range(3):
        loss = model(torch.randn(4, 6)).sum()
        (loss * float("nan") if k == 1 else loss).backward()
    with pytest.raises(DpclipError) as ei:
        opt.step()
    assert "micro-batch 1" in str(ei.value) and "nothing charged" in str(ei.value), ei.value
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p.detach())
        assert p.grad is None
    assert engine.steps == 0 and engine.last_epsilon == 0.0
    # the next logical step works and is the job's first charge
    opt.zero_grad()
    for _ in range(3):
        model(torch.randn(4, 6)).sum().backward()
    opt.step()
    first = _ledger(daemon.socket, 3, 1)[0]
    assert engine.last_epsilon == pytest.approx(first, rel=1e-9)
    engine.close()


def test_zero_grad_in_the_middle_drops_the_logical_step(daemon):
    """zero_grad() after two micro-batches (one already sent) warns, naming
    what it dropped; the step after it is the third micro-batch's alone
    (against the reference), charged once."""
    torch.manual_seed(6)
    model = SeqModel()
    (x,), y = seq_data(24, seed=7)
    C, E = 0.8, 24
    engine, model, opt = _engine(daemon.socket, model, max_grad_norm=C, expected_batch_size=E)
    ref_model = SeqModel()
    ref_model.load_state_dict(model.state_dict())
    want, _, _ = reference(ref_model, "seq", (x[16:],), y[16:], C, "mean", E)
    opt.zero_grad()
    for sl in _pieces([8, 8]):
        reduce_loss(per_sample_losses("seq", model(x[sl]), y[sl]), "mean").backward()
    model(x[:1])  # the next forward sends both (nothing released)
    with pytest.warns(UserWarning, match=r"zero_grad\(\) in the middle of a logical step "
                      r"dropped it: 2 micro-batches \(16 samples, 2 sent"):
        opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    reduce_loss(per_sample_losses("seq", model(x[16:]), y[16:]), "mean").backward()
    opt.step()
    for n, p in model.named_parameters():
        assert _max_rel(p.grad, want[n]) < 2e-4, n
    assert engine.last_norms.shape == (8,)
    engine.close()
    # with noise: the dropped logical step was charged nothing
    engine, model, opt = _engine(daemon.socket, nn.Linear(6, 3), noise_multiplier=1.0,
                                 sample_rate=0.02, expected_batch_size=12, target_delta=1e-5)
    for _ in range(2):
        model(torch.randn(4, 6)).sum().backward()
    model(torch.randn(4, 6))
    with pytest.warns(UserWarning, match="2 sent to the daemon"):
        opt.zero_grad()
    for _ in range(3):
        model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert engine.last_epsilon == pytest.approx(_ledger(daemon.socket, 3, 1)[0], rel=1e-9)
    engine.close()


def test_a_second_backward_after_the_next_forward_is_refused(daemon):
    """A backward through a forward whose micro-batch was sent (retain_graph,
    after the next forward began) would put its samples in two micro-batches:
    step() refuses, naming the module."""
    model = nn.Sequential(nn.Linear(5, 3))
    engine, model, opt = _engine(daemon.socket, model, expected_batch_size=4)
    loss = model(torch.randn(4, 5)).sum()
    loss.backward(retain_graph=True)
    model(torch.randn(4, 5)).sum().backward()  # its forward sent the first
    loss.backward()
    with pytest.raises(RuntimeError, match=r"module 0 captured a backward of forward pass 1 "
                       r"after that pass was sent"):
        opt.step()
    assert model[0].weight.grad is None
    # two backwards through one forward before the next: one micro-batch, as always
    opt.zero_grad()
    loss = model(torch.randn(4, 5)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    opt.step()
    assert model[0].weight.grad is not None
    engine.close()


def test_split_sizes():
    assert [len(p) for p in split(list(range(50)), 16)] == [16, 16, 16, 2]
    assert [len(p) for p in split(list(range(32)), 16)] == [16, 16]
    assert split([], 16) == [[]]
    assert split([3, 1, 2], 5) == [[3, 1, 2]]
    assert sum(split(list(range(37)), 4), []) == list(range(37))  # in order, each once


def test_logical_batches_split_step_and_equal_the_reference(daemon):
    """engine.logical_batches(loader, max_physical_batch_size=5): each
    Poisson logical batch comes as ceil(B / 5) micro-batches in the drawn
    order (an empty one as one empty micro-batch), the optimizer steps once
    per logical batch, and each step's gradient is the reference's of its
    logical batch; zero_grad() between micro-batches drops nothing."""
    torch.manual_seed(8)
    (x,), y = seq_data(40, seed=9)
    ds = TensorDataset(torch.arange(40), x, y)
    q, steps = 0.3, 6
    drawn = DPDataLoader(ds, q, steps=steps, generator=torch.Generator().manual_seed(4))
    logical = [list(b) for b in drawn.batch_sampler]
    loader = DPDataLoader(ds, q, steps=steps, generator=torch.Generator().manual_seed(4))
    model = SeqModel()
    plain = SeqModel()
    plain.load_state_dict(model.state_dict())  # the reference's (lr 0: it stays the model)
    C = 0.9
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=C)
    E = engine.expected_batch_size
    assert E == 12
    seen, grads = [], []
    with engine.logical_batches(loader, max_physical_batch_size=5) as batches:
        assert len(batches) == steps * 3  # expected: ceil(12 / 5) per logical batch
        for idx, xb, yb in batches:
            opt.zero_grad()
            seen.append(idx.tolist())
            reduce_loss(per_sample_losses("seq", model(xb), yb), "mean").backward()
            before = engine.steps
            opt.step()
            if engine.steps > before:
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert seen == [piece for b in logical for piece in split(b, 5)]
    assert engine.steps == steps == len(grads)
    for b, g in zip(logical, grads):
        if not b:
            assert all(float(t.abs().max()) == 0 for t in g.values())  # noise off: zeros
            continue
        want, _, _ = reference(plain, "seq", (x[b],), y[b], C, "mean", E)
        for n in want:
            assert _max_rel(g[n], want[n]) < 2e-4, n
    engine.close()


def test_leaving_logical_batches_midway_drops_the_logical_step(daemon):
    ds = TensorDataset(torch.randn(30, 4))
    model = nn.Linear(4, 2)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DPDataLoader(ds, 1.0, steps=1), noise_multiplier=0.0, max_grad_norm=1.0)
    with pytest.warns(UserWarning, match="dropped it: 1 micro-batch"):
        with engine.logical_batches(loader, max_physical_batch_size=8) as batches:
            for (xb,) in batches:
                opt.zero_grad()
                model(xb).sum().backward()
                opt.step()
                break
    assert engine.steps == 0 and model.weight.grad is None
    with pytest.raises(ValueError, match="max_physical_batch_size"):
        engine.logical_batches(loader, max_physical_batch_size=0)
    engine.close()


_KILLED = r"""
import os, sys, torch
sys.path.insert(0, %(python)r)
from dpclip.torch import PrivacyEngine
engine = PrivacyEngine(%(socket)r, job_id=%(job)r, allow_insecure_seed=True)
model = torch.nn.Linear(64, 64)
model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
    model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.02,
    expected_batch_size=8, target_delta=1e-5)
for _ in range(3):  # micro-batches 0 and 1 sent by the forwards after them
    model(torch.randn(4, 64)).sum().backward()
engine._acc._drain()
print("SENT", engine._acc.sent, flush=True)
sys.stdin.read()  # killed here, in the middle of its logical step
"""


def _logical_step(socket, job, width):
    """One logical step of 3 micro-batches of a Linear(width, width): its
    epsilon, or the DpclipError it raised."""
    engine = PrivacyEngine(socket, job_id=job, allow_insecure_seed=True)
    model = nn.Linear(width, width)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.02, expected_batch_size=12,
        target_delta=1e-5)
    try:
        for _ in range(3):
            model(torch.randn(4, width)).sum().backward()
        opt.step()
        return engine.last_epsilon
    except DpclipError as e:
        return e
    finally:
        engine.close()


def test_a_session_killed_mid_step_leaves_nothing_behind(tmp_path):
    """A trainer killed in the middle of a logical step (two micro-batches
    accumulated): the daemon frees its accumulators (a user limit that fits
    one logical step's refuses a second session's while the first lives,
    and takes it once the first is killed) and charges its job nothing."""
    from conftest import Daemon
    acc = (64 * 64 + 64) * 4
    d = Daemon(extra=["--set", "limits.max_accumulator_memory_per_uid=%d" % (acc + acc // 4)])
    job = "pytest-killed-%d" % os.getpid()
    p = subprocess.Popen([sys.executable, "-c", _KILLED % {
        "python": os.path.join(REPO, "python"), "socket": d.socket, "job": job}],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "SENT 2\n"
        held = _logical_step(d.socket, job + "-other", 64)
        assert isinstance(held, DpclipError) and \
            held.field == "limits.max_accumulator_memory_per_uid", held
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while True:
            got = _logical_step(d.socket, job, 64)
            if not isinstance(got, DpclipError) or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # the daemon frees them once it has seen the connection close
        assert not isinstance(got, DpclipError), got
        # the killed session's logical step was not charged: the job's first
        # logical step costs what a fresh job's does
        assert got == pytest.approx(_logical_step(d.socket, job + "-fresh", 64), rel=1e-9)
    finally:
        p.kill()
        p.wait()
        d.kill()


def test_detached_micro_batches_each_wait_on_their_own_ready_event(monkeypatch):
    """A flat norm group's GPU micro-batches are sent detached and queued in
    the daemon only once every member's is in. Each must name a `ready`
    event of its own, kept until its reply is collected: the daemon waits
    on an event's record as of when it queues the step, and a shared one,
    re-recorded by later micro-batches, made it wait for a later point of
    the trainer's stream, which under 1F1B on two GPUs waits for the other
    stage (a deadlock seen on 2 H200s). On the CPU with CUDA stubbed."""
    import contextlib

    from dpclip import _cuda, _planner

    registered, recorded = [], []

    class Event:
        def __init__(self, **kw):
            self.n = len(registered)

        def ipc_handle(self):
            return bytes(64)

        def record(self, stream):
            recorded.append(self.n)

    class Client:
        def register_event(self, handle, idx):
            registered.append(idx)
            return 100 + len(registered) - 1

    class Stream:
        cuda_stream = 0

        def wait_event(self, ev):
            pass

    class Step:
        layout = 0

        def reset(self, nb):
            pass

        def rebind_cuda(self, client, ptrs):
            pass

        def set_outputs(self, **kw):
            pass

        def set_events(self, rid, did):
            self.ready_id = rid

        def notify_enqueued(self, on):
            assert not on  # a detached step has no early notice

        def set_done_flag(self, flag):
            assert flag is None  # ... nor a done flag

        def submit(self, client):
            return 1

        def run(self, client):
            return None

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    io, step, dev = _cuda.CudaIPC(Client()), Step(), torch.device("cuda", 0)
    plan = _planner.Plan([], [])
    runs, ids = [], []
    for _ in range(3):  # three in flight at once: three events
        runs.append(io.run(step, plan, 1, dev, 0, False, False, detached=True, write=False))
        ids.append(step.ready_id)
    shared = io.events(dev)[2]
    assert len(set(ids)) == 3 and shared not in ids, (ids, shared)
    io.settle(dev, runs[0].ready)  # its reply is in: its event may serve again
    io.run(step, plan, 1, dev, 0, False, False, detached=True, write=False)
    assert step.ready_id == ids[0]
    before = len(registered)
    io.run(step, plan, 1, dev, 0, False, False, detached=False, write=False)
    assert step.ready_id == shared and len(registered) == before  # waited on: the shared one
