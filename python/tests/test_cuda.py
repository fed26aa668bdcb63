"""The CUDA data plane (CUDA IPC tensors, interprocess events): the same
checks as the host path against the per-sample reference. Skipped, with the
reason, where there is no GPU or the daemon has no CUDA backend."""
import math
import os
import time

import pytest
import torch

import dpclip
from dpclip import _lib
from dpclip.torch import PrivacyEngine, reduce_loss
from dp_worker import run_rank_cuda_failure
from group_worker import run_pipeline
from models import SeqModel, per_sample_losses, pipeline_model, reference, seq_data, spawn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture
def cuda_daemon(daemon):
    with dpclip.Client(daemon.socket) as c:
        if not c.info.has_cuda:
            pytest.skip("this dpclipd has no CUDA backend")
    return daemon


def _private_seq(socket, seed, **kw):
    """SeqModel on the GPU made private against `socket` (C 0.8, MEAN over 11,
    no noise, lr 0), with a batch of 9 and its f64 per-sample reference:
    engine, model, optimizer, x, y, (grads, norms, coefficients)."""
    torch.manual_seed(seed)
    model = SeqModel()
    (x,), y = seq_data(9, seed=seed)
    C, expected = 0.8, 11
    ref = reference(model, "seq", (x,), y, C, "mean", expected)
    engine = PrivacyEngine(socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model.cuda(), optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=C,
        expected_batch_size=expected, **kw)
    return engine, model, opt, x, y, ref


def _rel(got, want):
    return float((got.double().cpu() - want).abs().max()) / float(want.abs().max())


@pytest.mark.parametrize("buffers", ["", "step", "engine"])
@pytest.mark.parametrize("asynchronous", [True, False])
def test_cuda_grad_buffers_match_reference(cuda_daemon, asynchronous, buffers, monkeypatch):
    """DPCLIP_GRAD_BUFFERS: the same gradients either way. "step" (unset:
    the default) puts each step's in buffers of its own, which only
    param.grad holds once step() returns: zero_grad(set_to_none=True)
    gives their memory back; "engine" writes them into arenas the engine
    keeps, each f32 parameter's end to end, each rounded up to 4 elements."""
    monkeypatch.setenv("DPCLIP_GRAD_BUFFERS", buffers)
    engine, model, opt, x, y, (want, _, ref_coefs) = _private_seq(
        cuda_daemon.socket, 3, asynchronous=asynchronous)
    params = list(model.parameters())
    widths = [-(-p.numel() // 4) * 4 for p in params]
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        out = model(x.cuda())
        reduce_loss(per_sample_losses("seq", out.float(), y.cuda()), "mean").backward()
        opt.step()
        for n, p in model.named_parameters():
            assert p.grad.is_cuda and _rel(p.grad, want[n]) < 3e-3, n
        assert torch.allclose(engine.last_coefs.double(), ref_coefs, rtol=3e-3, atol=1e-6)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        opt.zero_grad(set_to_none=True)
        freed = held - torch.cuda.memory_allocated()
        if buffers == "engine":
            assert engine.output_buffer_bytes == 4 * sum(widths)
            assert freed == 0  # the arenas stay
        else:
            assert engine.output_buffer_bytes == 0
            assert freed >= 4 * sum(p.numel() for p in params)
    engine.close()


@pytest.mark.parametrize("done_flag", ["0", "1"])
@pytest.mark.parametrize("amp,asynchronous", [(False, True), (True, True), (False, False)])
def test_cuda_step_matches_reference(cuda_daemon, amp, asynchronous, done_flag, monkeypatch):
    """(done_flag "1": asynchronous steps complete through the done flag,
    docs/protocol.md, instead of the `done` event)"""
    monkeypatch.setenv("DPCLIP_DONE_FLAG", done_flag)
    engine, model, opt, x, y, (want, ref_norms, ref_coefs) = _private_seq(
        cuda_daemon.socket, 3, asynchronous=asynchronous)
    for _ in range(2):  # the second step reuses registrations and events
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            out = model(x.cuda())
        reduce_loss(per_sample_losses("seq", out.float(), y.cuda()), "mean").backward()
        opt.step()
        # f32 inputs: the daemon's GPU backend uses TF32 tensor cores by default
        # (10-bit mantissa products; DPCLIP_CUDA_TF32=0 for exact f32), so the
        # bound is TF32's, not f32's.
        tol = 0.05 if amp else 3e-3
        for n, p in model.named_parameters():
            assert p.grad.is_cuda and _rel(p.grad, want[n]) < tol, n
        if not amp:
            assert torch.allclose(engine.last_coefs.double(), ref_coefs, rtol=3e-3, atol=1e-6)
    # the flag served (not the events' fallback) exactly where asked
    assert bool(engine._cuda._flags) == (done_flag == "1" and asynchronous)
    engine.close()


def test_cuda_steps_rebind_their_inputs(cuda_daemon, monkeypatch):
    """A step of the last step's layout (the same parts and batch) is not
    built again: its layers' inputs are pointed at the new tensors
    (Step.rebind_cuda). Each step's own data must be what the daemon reads:
    every step (new data each time, a batch of another size between) is
    checked against its own reference; the steps of a new layout build."""
    torch.manual_seed(4)
    model = SeqModel()
    C = 0.8
    batches = [seq_data(B, seed=10 + i) for i, B in enumerate((9, 9, 9, 5, 9))]
    wants = [reference(model, "seq", (x,), y, C, "sum", 0) for (x,), y in batches]
    model = model.cuda()
    built, rebound = [], []
    reset, rebind = _lib.Step.reset, _lib.Step.rebind_cuda
    monkeypatch.setattr(_lib.Step, "reset", lambda st, b: (built.append(b), reset(st, b))[1])
    monkeypatch.setattr(_lib.Step, "rebind_cuda",
                        lambda st, c, ptrs: (rebound.append(len(ptrs)), rebind(st, c, ptrs))[1])
    engine = PrivacyEngine(cuda_daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=C,
        loss_reduction="sum")
    for ((x,), y), (want, _, ref_coefs) in zip(batches, wants):
        opt.zero_grad()
        reduce_loss(per_sample_losses("seq", model(x.cuda()), y.cuda()), "sum").backward()
        opt.step()
        for n, p in model.named_parameters():
            assert _rel(p.grad, want[n]) < 3e-3, n
        assert torch.allclose(engine.last_coefs.double(), ref_coefs, rtol=3e-3, atol=1e-6)
    engine.close()
    # built at the first step, at the batch of 5 and back at 9; rebound twice
    assert built[-3:] == [9, 5, 9] and len(rebound) == 2, (built, rebound)


def test_cuda_steady_steps_are_staged(cuda_daemon, monkeypatch):
    """Steps of one template (every module used once: dpclip._planner's
    Replanner) are planned as the layers capture, their pointers staged
    for the rebind; a template with a module left unused sends it zeros
    (its parts have no capture: the comparison's plan at step()). Every
    step (new data, the unused module's template in the middle) is checked
    against its own per-sample reference, and the path each took."""
    from dpclip import _cuda
    from models import SteadyModel
    torch.manual_seed(6)
    model = SteadyModel()
    C = 0.8
    uses = [True, True, True, False, False, False, True, True]
    batches = [seq_data(7, seed=20 + i) for i in range(len(uses))]
    wants = []
    for ((x,), y), extra in zip(batches, uses):
        model.use_extra = extra
        wants.append(reference(model, "seq", (x,), y, C, "sum", 0))
    model = model.cuda()
    staged = []
    run = _cuda.CudaIPC.run
    monkeypatch.setattr(_cuda.CudaIPC, "run", lambda io, st, plan, *a, **k: (
        staged.append((plan.serial > 0, plan.ptrs is not None)), run(io, st, plan, *a, **k))[1])
    engine = PrivacyEngine(cuda_daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=C,
        loss_reduction="sum")
    # (TF32's bound, as in test_cuda_step_matches_reference: a tensor read
    # at a wrong or stale pointer would be off by far more)
    tol = 5e-3
    for k, (((x,), y), extra, (want, _, ref_coefs)) in enumerate(zip(batches, uses, wants)):
        model.use_extra = extra
        opt.zero_grad()
        reduce_loss(per_sample_losses("seq", model(x.cuda()), y.cuda()), "sum").backward()
        opt.step()
        for n, p in model.named_parameters():
            if n.startswith("extra.") and not extra:
                assert p.grad is not None and not p.grad.any(), (k, n)  # zeros, no noise
            else:
                assert _rel(p.grad, want[n]) < tol, (k, n)
        assert torch.allclose(engine.last_coefs.double(), ref_coefs, rtol=tol, atol=1e-6), k
    engine.close()
    # (from a template, staged): the first step checks, the second keeps the
    # template, the next are staged; the unused module's template is never
    # staged; back to the first layout, a new template
    assert staged == [(False, False), (False, False), (True, True), (False, False),
                      (True, False), (True, False), (False, False), (True, True)], staged


def test_cuda_noise_std(cuda_daemon):
    sigma, C, expected = 1.5, 2.0, 8
    model = torch.nn.Linear(256, 256).cuda()
    engine = PrivacyEngine(cuda_daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=sigma, max_grad_norm=C,
        expected_batch_size=expected)
    (model(torch.randn(expected, 256, device="cuda")) * 0.0).sum().backward()
    opt.step()
    v = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    want = sigma * C / expected
    assert abs(float(v.std()) - want) < 6 * want / math.sqrt(2 * v.numel())
    engine.close()


@pytest.mark.parametrize("done_flag", ["0", "1"])
def test_cuda_async_failure_surfaces(cuda_daemon, done_flag, monkeypatch):
    """An asynchronous step whose gradient is not finite passes its notice,
    leaves zero gradients (the daemon writes zeros) and raises at the next
    step with the daemon's message; the engine goes on working after. With
    the done flag too, whose value the daemon stores after the zeros.
    Without the flag (DPCLIP_DONE_FLAG=0) a step waits for its reply, so
    the error comes from that step() itself."""
    monkeypatch.setenv("DPCLIP_DONE_FLAG", done_flag)
    torch.manual_seed(5)
    model = torch.nn.Linear(32, 16).cuda()
    engine = PrivacyEngine(cuda_daemon.socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=1.0,
        expected_batch_size=4)
    x = torch.randn(4, 32, device="cuda")
    model(x).sum().backward()
    opt.step()
    assert engine.last_norms.shape == (4,)  # collected: a good step
    assert all(float(p.grad.abs().sum()) > 0 for p in model.parameters())
    (model(x).sum() * float("nan")).backward()
    if done_flag == "1":
        opt.step()  # the notice came: no error yet
        assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
        with pytest.raises(dpclip.DpclipError) as ei:
            engine.synchronize()
        assert "after it was queued" in str(ei.value) and "finite" in str(ei.value)
    else:
        with pytest.raises(dpclip.DpclipError) as ei:
            opt.step()  # its reply, waited for
        assert "finite" in str(ei.value)
    model(x).sum().backward()
    opt.step()
    assert engine.last_norms.shape == (4,)
    engine.close()


def test_cuda_async_failure_on_rank_0_is_applied_nowhere(cuda_daemon, tmp_path):
    """Data parallel, asynchronous steps: rank 0's step fails on the device
    after its update was queued on every rank. The update must be applied on
    no rank (rank 1's clipped sum alone has no noise), and both ranks raise
    at the next step, whether or not rank 0 met its error earlier (reading
    last_coefs); the step after works on both."""
    spawn(run_rank_cuda_failure, (2, str(tmp_path / "init"), cuda_daemon.socket, str(tmp_path)))
    got = [torch.load(os.path.join(str(tmp_path), "cudafail%d.pt" % r)) for r in range(2)]
    for r in range(2):
        errors = got[r]["errors"]
        # nobody knew at steps 1 and 3; both raised at 2 and 4; 5 worked
        assert errors[0] is None and errors[2] is None and errors[4] is None, (r, errors)
        for i in range(4):
            for n, p in got[r]["before"].items():
                assert torch.equal(got[r]["after"][i][n], p), (r, i, n)  # nothing moved
        for n, p in got[r]["before"].items():
            assert not torch.equal(got[r]["after"][4][n], p), (r, n)
            assert torch.equal(got[r]["after"][4][n], got[1 - r]["after"][4][n]), (r, n)
    peek = got[0]["peek"]
    assert peek is not None and "after it was queued" in peek[1], peek
    for r in range(2):
        assert got[r]["errors"][1][0] == _lib.EUNAVAIL, (r, got[r]["errors"])
    assert "after it was queued" in got[0]["errors"][3][1], got[0]["errors"]
    assert got[1]["errors"][3][0] == _lib.EUNAVAIL, got[1]["errors"]


def test_norm_groups_on_cuda(cuda_daemon, tmp_path):
    """Norm groups with a CUDA model, group-wise: two pipeline stages on one
    GPU, each clipped alone to C / sqrt(2), against the reference. Flat
    clipping: test_norm_group_flat_on_cuda and
    test_norm_group_across_two_daemons."""
    torch.manual_seed(3)
    whole = pipeline_model()
    (x,), y = seq_data(7, seed=8)
    expected = 9
    # C / sqrt(2) at stage 0's median norm: both stages clip some samples
    # (stage 1's norms are larger); a fixed C clipped none of stage 0's here
    stage0 = {n for n, _ in whole.named_parameters() if n.startswith("0.")}
    _, norms0, _ = reference(whole, "seq", (x,), y, 1e9, "sum", 1, only=stage0)
    C = math.sqrt(2) * float(norms0.median())
    spawn(run_pipeline, (2, str(tmp_path / "init"), cuda_daemon.socket, (x, y), C, expected,
                         "group_wise", str(tmp_path), "cuda"))
    for r in range(2):
        got = torch.load(str(tmp_path / ("pp%d.pt" % r)))
        only = {n for n, _ in whole.named_parameters() if n.startswith("%d." % r)}
        want, norms, coefs = reference(whole, "seq", (x,), y, C / math.sqrt(2), "mean", expected,
                                       only=only)
        assert (coefs < 1).any(), r
        for n, g in got["grads"].items():
            assert _rel(g, want[n]) < 3e-3, (r, n)  # TF32 (test_cuda_step_matches_reference)


def _flat_pipeline(tmp_path, sockets):
    """Two pipeline stages on the GPU, one rank each, flat clipping across
    the group: every stage's gradients equal the whole model's per-sample
    reference (TF32 tolerance). sockets: one daemon, or one per rank."""
    torch.manual_seed(3)
    whole = pipeline_model()
    (x,), y = seq_data(7, seed=8)
    expected = 9
    _, norms, _ = reference(whole, "seq", (x,), y, 1e9, "sum", 1)
    C = float(norms.median())  # clips about half of the whole model's samples
    spawn(run_pipeline, (2, str(tmp_path / "init"), sockets, (x, y), C, expected, "flat",
                         str(tmp_path), "cuda"), timeout=180)
    want, norms, coefs = reference(whole, "seq", (x,), y, C, "mean", expected)
    assert (coefs < 1).any() and (coefs == 1).any()
    got = [torch.load(str(tmp_path / ("pp%d.pt" % r))) for r in range(2)]
    for r in range(2):
        assert torch.allclose(got[r]["norms"].double().cpu(), norms, rtol=3e-3), r
        for n, g in got[r]["grads"].items():
            assert _rel(g, want[n]) < 3e-3, (r, n)
    # the noisy steps (host tensors) ran and charged rank 0's job
    assert got[0]["epsilon"] > 0 and got[0]["job"] == got[1]["job"]
    return got


def test_norm_group_flat_on_cuda(cuda_daemon, tmp_path):
    got = _flat_pipeline(tmp_path, cuda_daemon.socket)
    assert got[0]["daemons"] == 1


# Two daemons on one GPU (a test setting): each its own NCCL_HOSTID, so NCCL
# takes them for two hosts and links them over its socket transport.
NCCL_TEST_ENV = {"NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo"}


def test_norm_group_across_two_daemons(cuda_daemon, tmp_path):
    """The same model with each stage on its own daemon: the daemons
    exchange their norm totals through NCCL, and the result is the one
    daemon's (the reference)."""
    from conftest import Daemon
    daemons = [Daemon(env=dict(NCCL_TEST_ENV, NCCL_HOSTID="dpclip-pytest-%d" % k))
               for k in range(2)]
    try:
        got = _flat_pipeline(tmp_path, [d.socket for d in daemons])
        assert got[0]["daemons"] == 2 and got[1]["daemons"] == 2
    finally:
        for d in daemons:
            d.kill()


def _kill_model():
    """Layers large enough that the daemon's step takes a few milliseconds."""
    torch.manual_seed(11)
    blocks = []
    for _ in range(4):
        blocks += [torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)]
    return torch.nn.Sequential(*blocks).cuda()


def _kill_step(socket, x, delay, kill):
    """Two asynchronous steps (the first one's check, on x / 2, then a
    steady one on x) of _kill_model, noise off; where kill, the daemon is
    killed `delay` seconds after the second step's notice. Returns each
    gradient once the trainer's stream has gone on (a host copy). The
    steps' gradients differ, so that a second step written in part over
    the first one's (the engine's arenas hold it) shows as a part."""
    import time

    model = _kill_model()
    engine = PrivacyEngine(socket, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=1.0,
        expected_batch_size=x.shape[0])
    for k in range(2):
        opt.zero_grad()
        model(x if k == 1 else x / 2).pow(2).mean(dim=(1, 2)).mean().backward()
        opt.step()  # returns at the notice: the daemon's work may still be running
        if kill is not None and k == 1:
            time.sleep(delay)
            kill()
    torch.cuda.synchronize()  # the stream waits on the flag until it is released
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
    try:
        engine.close()
    except Exception:  # pylint: disable=broad-except
        pass  # (the daemon is gone: the step's error)
    return grads


@pytest.mark.parametrize("buffers", ["step", "engine"])
def test_daemon_killed_mid_step_leaves_the_whole_step_or_zeros(cuda_daemon, buffers,
                                                               monkeypatch):
    """The daemon killed while an asynchronous step may still be on the
    device (the done flag): once the trainer's stream goes on, its
    gradients are the whole step's or zeros, never part of a step. A daemon
    killed between a step's clipped sums and their noise used to leave sums
    without noise there, which the stream applied (dpclip._cuda
    release_flags). Noise off, so the whole step is a live daemon's result;
    the kill comes at several delays after the notice. Per-step buffers
    and the engine's arenas alike."""
    from conftest import Daemon
    monkeypatch.setenv("DPCLIP_GRAD_BUFFERS", buffers)
    x = torch.randn(16, 256, 512, generator=torch.Generator().manual_seed(5)).cuda()
    want = _kill_step(cuda_daemon.socket, x, 0.0, None)
    seen = set()
    for delay in (0.0, 0.0005, 0.002, 0.005):
        d = Daemon()
        try:
            got = _kill_step(d.socket, x, delay, d.proc.kill)
        finally:
            d.kill()
        zero = all(not g.any() for g in got.values())
        whole = all(_rel(got[n], want[n]) < 1e-3 for n in want)
        assert zero or whole, (delay, {n: (_rel(got[n], want[n]), float(got[n].abs().max()))
                                       for n in want})
        seen.add("zeros" if zero else "whole")
    print("outcomes seen: %s" % sorted(seen))


def test_idle_gpu_gives_memory_back():
    """gpu.idle_release_s: a GPU without work for that long gives back the
    workspace its steps grew (here from gpu.workspace = 0), which /metrics
    then shows; the next step grows it again and is still right."""
    import sys
    from conftest import REPO, Daemon
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import daemon_phases
    d = Daemon(extra=["--gpu-idle-release-s", "1", "--gpu-workspace", "0"])
    try:
        with dpclip.Client(d.socket) as c:
            if not c.info.has_cuda:
                pytest.skip("this dpclipd has no CUDA backend")
        engine, model, opt, x, y, (want, _, _) = _private_seq(d.socket, 4)
        held = []
        for k in range(2):  # a step, idle, then a step on the memory grown again
            opt.zero_grad()
            reduce_loss(per_sample_losses("seq", model(x.cuda()), y.cuda()), "mean").backward()
            opt.step()
            torch.cuda.synchronize()
            for n, p in model.named_parameters():
                assert _rel(p.grad, want[n]) < 3e-3, n
            # the worker publishes what it holds as its task ends (a 1 s
            # idle period before it gives it back)
            deadline = time.monotonic() + 5
            while (grown := daemon_phases.held_bytes(d.socket))[0] == 0 and \
                    time.monotonic() < deadline:
                time.sleep(0.01)
            deadline = time.monotonic() + 15
            while daemon_phases.held_bytes(d.socket) != (0, 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            held.append((grown, daemon_phases.held_bytes(d.socket)))
        print("held after a step, then idle: %s" % held)
        for grown, idle in held:
            assert grown[0] > 0 and idle == (0, 0)
        engine.close()
    finally:
        assert d.stop() == 0
