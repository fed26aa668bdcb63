"""Gradient accumulation with sharded data parallelism (issue 39):
make_private(sharded_noise=True) on gloo, which Debian's torch 1.13 runs,
and FSDP2 (fully_shard) on a GPU. Several backwards, one optimizer.step():
each micro-batch's norm pass and sums steps accumulate in the rank's
daemon (nothing written, no collective); step() commits, reduce-scatters
once and gates once. Against the single-process per-sample f64 reference
of the union logical batch (sigma 0; the sums clip with the phased
margin); the noise once per logical step on the rows each rank owns; one
ledger charge per logical step; the collectives of one whole step per
logical step; failures applied on no rank. The FSDP2 test runs with both
ranks on one GPU ("one_gpu") and with rank r on cuda:r ("two_gpus"), one
dpclipd serving both; it skips, with the reason, without fully_shard
(torch < 2.4), a GPU (two for "two_gpus"), NCCL or a CUDA dpclipd:

    python3 -m pytest -q python/tests/test_fsdp_accumulate.py -k fsdp2
"""
import math
import os

import pytest
import torch
import torch.nn as nn

import dpclip
from dpclip import _cuda, _fsdp, _lib
from dpclip._layers import Out
from dpclip.torch import PrivacyEngine
from fsdp_accum_worker import (run_accumulate, run_accumulate_failures,
                               run_accumulate_logical_batches, run_accumulate_noise,
                               run_fsdp2_accumulate)
from fsdp_worker import GPT
from models import PHASED_MARGIN, SeqModel, reference, seq_data, spawn

# each rank's micro-batches of its samples x[rank::world] (24 in all):
# equal, and ragged (a rank of one micro-batch: a whole step beside the
# others' logical ones)
SPLITS = {
    (2, "equal"): [[3, 3, 3, 3], [3, 3, 3, 3]],
    (2, "ragged"): [[2, 7, 3], [5, 7]],
    (3, "equal"): [[2, 2, 2, 2]] * 3,
    (3, "ragged"): [[1, 4, 3], [5, 3], [8]],
}


def _spawn(fn, world, args, timeout=900):
    spawn(fn, (world,) + args, nprocs=world, timeout=timeout)


def _rel(got, want):
    return float((got.double() - want).abs().max()) / max(float(want.abs().max()), 1e-30)


@pytest.mark.parametrize("world,kind", list(SPLITS), ids=["%d-%s" % k for k in SPLITS])
def test_micro_batches_equal_the_union_reference(daemon, tmp_path, world, kind):
    """sigma 0, 24 samples over `world` ranks, each rank's in micro-batches
    (several reduce-scatter buckets): every rank's gradient equals the f64
    reference of the 24 together (phased margin), as one whole step's does;
    so does the next logical step (the sizes reversed) and one after a
    logical step dropped by zero_grad(), whose micro-batches count nowhere;
    the norms are each rank's samples', micro-batch by micro-batch. No
    collective runs before step(), and a logical step runs exactly the
    collectives of one whole step (one reduce-scatter per bucket, one gate,
    the gather): none per micro-batch."""
    (x,), y = seq_data(24, seed=31)
    torch.manual_seed(100)  # rank 0's weights: the ones make_private broadcasts
    _, norms, _ = reference(SeqModel(), "seq", (x,), y, 1e9, "sum", 1)
    C, E = float(norms.median()), 26
    torch.manual_seed(100)
    want, ref_norms, coefs = reference(SeqModel(), "seq", (x,), y, C, "mean", E,
                                       margin=PHASED_MARGIN)
    assert (coefs < 1).any() and (coefs == 1).any()
    splits = SPLITS[(world, kind)]
    _spawn(run_accumulate, world, (str(tmp_path / "init"), daemon.socket, (x, y), C, E, splits,
                                   str(tmp_path)))
    for r in range(world):
        got = torch.load(os.path.join(str(tmp_path), "acc%d.pt" % r))
        assert got["buckets"] > 2, got["buckets"]
        assert got["steps"] == [1, 2, 3, 4], got["steps"]  # the dropped one is no step
        for s, grads in enumerate(got["grads"]):
            for n, g in want.items():
                assert _rel(grads[n], g) < 1e-4, (r, s, n, _rel(grads[n], g))
        mine = ref_norms[r::world].float()
        for s in range(4):  # the micro-batches' samples, in order
            assert torch.allclose(got["norms"][s], mine, rtol=1e-4), (r, s, got["norms"][s])
        whole = got["total"][0]
        assert whole == got["buckets"] + 2, (r, whole)  # reduce-scatters, the gate, the gather
        assert got["before"] == [0, 0, 0, 0], (r, got["before"])
        assert got["total"] == [whole] * 4, (r, got["total"])


@pytest.mark.parametrize("world", [2, 3])
def test_noise_once_per_logical_step_on_the_owned_rows_and_one_charge(daemon, tmp_path,
                                                                      world):
    """sigma > 0 on a zero loss, 3 logical steps of 3 micro-batches each:
    the commit's sums outputs hold the noise on exactly the rows of each
    parameter the rank owns and zeros elsewhere, the micro-batches before
    it wrote nothing there; every rank's gradient is, bit for bit, the
    owners' outputs; the noise's std is sigma*C/E (noise drawn per
    micro-batch would show sqrt(3) times that), fresh each logical step;
    the job's epsilon after 3 logical steps is one process's after 3
    steps: charged once per logical step, not per micro-batch."""
    (x,), y = seq_data(9 * world, seed=6)
    C, E, sigma, q, steps, sizes = 0.9, 9 * world, 1.7, 0.05, 3, [2, 4, 3]
    _spawn(run_accumulate_noise, world, (str(tmp_path / "init"), daemon.socket, (x, y), C, E,
                                         sigma, q, steps, sizes, str(tmp_path)))
    got = [torch.load(os.path.join(str(tmp_path), "accnoise%d.pt" % r)) for r in range(world)]
    values = []
    for s in range(steps):
        for r in range(world):
            assert len(got[r]["recorded"][s]) == got[r]["buckets"]  # the commit's sums steps
            for pc in got[r]["pieces"]:
                shape, n = pc["shape"], math.prod(pc["shape"])
                base, full = next((b, f) for b, f in got[r]["recorded"][s]
                                  if b <= pc["full_off"] < b + f.numel())
                wire = full[pc["full_off"] - base:pc["full_off"] - base + n].view(shape[0], -1)
                r0 = min(r * pc["chunk"], shape[0])
                owned = wire[r0:r0 + pc["mine"]]
                other = torch.cat([wire[:r0], wire[r0 + pc["mine"]:]])
                assert bool((other == 0).all()), (s, r, pc["name"], "noise outside its rows")
                assert bool((owned != 0).all()), (s, r, pc["name"], "owned rows unnoised")
                for q_ in range(world):  # applied as the owner's daemon wrote it
                    g = got[q_]["grads"][s][pc["name"]].reshape(shape[0], -1)[r0:r0 + pc["mine"]]
                    assert torch.equal(g, owned), (s, q_, r, pc["name"])
        values.append(torch.cat([g.double().reshape(-1) for g in got[0]["grads"][s].values()]))
    for r in range(world):  # the two micro-batches before each commit: every bucket's sums
        assert got[r]["scratch"] == [steps * 2 * got[r]["buckets"]] * 2, got[r]["scratch"]
        assert got[r]["last_norms"].shape == (9,)
    assert not torch.equal(values[0], values[1])
    noise = torch.cat(values)
    want = sigma * C / E
    assert abs(float(noise.std()) - want) < 6 * want / math.sqrt(2 * noise.numel()), \
        (float(noise.std()), want)
    assert abs(float(noise.mean())) < 6 * want / math.sqrt(noise.numel())

    single = PrivacyEngine(daemon.socket, job_id="fsdp-acc-noise-single-%d" % world,
                           allow_insecure_seed=True)
    model = nn.Linear(3, 2)
    _, opt, _ = single.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=sigma, max_grad_norm=C,
        expected_batch_size=E, sample_rate=q, target_delta=1e-5, distributed=False)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    assert 0 < single.last_epsilon < math.inf
    for r in range(world):
        assert got[r]["epsilon"] == pytest.approx(single.last_epsilon, rel=1e-9), r
    single.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["waiting", "asynchronous"])
def test_a_failed_micro_batch_is_applied_on_no_rank(daemon, tmp_path, asynchronous):
    """Logical step 0: the last rank's micro-batch 1 is not finite (its
    norm pass fails): no rank moves, every rank holds zero gradients and
    raises (that rank its error, the others DPCLIP_EUNAVAIL). Steps 2 and
    4: that rank's micro-batch 1, then its commit, changes between its
    norm pass and its sums (the daemon refuses the first sums step, in the
    middle of the pass): the same. Steps 1, 3 and 5, clean, are applied on
    both ranks: the daemon dropped what the failed logical steps held, and
    the rest of a failed pass's sums were sent, since the daemon takes no
    other step of the session while a micro-batch's pass has layers to
    sum. Sent without waiting (asynchronous, the default), micro-batch 1's
    failure is learnt at a later one or at step(), and nothing runs
    between a micro-batch's norm pass and its sums: step 2 is clean."""
    (x,), y = seq_data(12, seed=2)
    _spawn(run_accumulate_failures, 2, (str(tmp_path / "init"), daemon.socket, (x, y), 0.9, 12,
                                        [2, 2, 2], str(tmp_path), asynchronous))
    got = [torch.load(os.path.join(str(tmp_path), "accfail%d%s.pt" % (r, "a" * asynchronous)))
           for r in range(2)]
    changed = (4,) if asynchronous else (2, 4)
    assert got[1]["tampered"] == ["micro", "commit"][-len(changed):] and \
        got[0]["tampered"] == []
    assert got[1]["errors"][0][0] == _lib.ENONFINITE and "micro-batch 1" in \
        got[1]["errors"][0][2], got[1]["errors"][0]
    for s in changed:
        assert got[1]["errors"][s][0] == _lib.EINVAL and "[clip_step.layers]" in \
            got[1]["errors"][s][2] and "changed" in got[1]["errors"][s][2], got[1]["errors"][s]
    failed = (0,) + changed
    for s in failed:
        assert got[0]["errors"][s][0] == _lib.EUNAVAIL and \
            "applied on no rank" in got[0]["errors"][s][2], (s, got[0]["errors"][s])
    for r in range(2):
        assert [got[r]["errors"][s] for s in range(6) if s not in failed] == \
            [None] * (6 - len(failed)), got[r]["errors"]
        prev = got[r]["before"]
        for s in range(6):
            for n, p in prev.items():
                now = got[r]["after"][s][n]
                if s in failed:
                    assert torch.equal(now, p), (r, s, n)
                    assert float(got[r]["grads"][s][n].abs().max()) == 0.0, (r, s, n)
                else:
                    assert not torch.equal(now, p), (r, s, n)
                    assert torch.equal(got[0]["grads"][s][n], got[1]["grads"][s][n]), (s, n)
            prev = got[r]["after"][s]


def test_logical_batches_per_rank_equal_the_union_reference(daemon, tmp_path):
    """engine.logical_batches over each rank's DPDataLoader (its shard,
    its own draws) under sharded_noise: each rank splits its logical batch
    into micro-batches of at most 3, so the ranks' counts differ; each
    logical step's gradient, on both ranks, is the f64 reference's of the
    union of the ranks' samples (phased margin), divided by the global
    expected batch size."""
    (x,), y = seq_data(40, seed=13)
    C, q, steps = 0.8, 0.3, 4
    _spawn(run_accumulate_logical_batches, 2, (str(tmp_path / "init"), daemon.socket, (x, y),
                                               C, q, steps, 3, str(tmp_path)))
    got = [torch.load(os.path.join(str(tmp_path), "accbatches%d.pt" % r)) for r in range(2)]
    assert got[0]["E"] == got[1]["E"] == 12
    assert any(a != b for a, b in zip(got[0]["micro"], got[1]["micro"])), \
        (got[0]["micro"], got[1]["micro"])
    assert max(got[0]["micro"] + got[1]["micro"]) > 1
    for s in range(steps):
        union = sorted(got[0]["idx"][s] + got[1]["idx"][s])
        assert all(i % 2 == r for r in range(2) for i in got[r]["idx"][s])  # its shard
        torch.manual_seed(100)
        want, _, _ = reference(SeqModel(), "seq", (x[union],), y[union], C, "mean", 12,
                               margin=PHASED_MARGIN)
        for r in range(2):
            for n, g in want.items():
                assert _rel(got[r]["grads"][s][n], g) < 1e-4, (s, r, n)


def test_asynchronous_false_sends_each_micro_batch_and_waits(daemon, tmp_path, monkeypatch):
    """make_private(asynchronous=...) on a sharded engine (one gloo rank):
    by default a micro-batch that does not commit goes through
    Sharded.micro_submit (sent without waiting, collected at the next);
    asynchronous=False never there, each is sent and waited for. Both
    give the f64 reference's gradient."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    offered = []
    submit = _fsdp.Sharded.micro_submit

    def spy(sh, plan, B, logical_id, index):
        offered.append(index)
        return submit(sh, plan, B, logical_id, index)

    monkeypatch.setattr(_fsdp.Sharded, "micro_submit", spy)
    (x,), y = seq_data(12, seed=4)
    torch.manual_seed(6)
    want, _, _ = reference(SeqModel(), "seq", (x,), y, 0.7, "mean", 12, margin=PHASED_MARGIN)
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "init"), rank=0,
                            world_size=1)
    try:
        for asynchronous, expect in ((True, [0, 1]), (False, [])):
            offered.clear()
            torch.manual_seed(6)
            model = SeqModel()
            engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
            model, opt, _ = engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                noise_multiplier=0.0, max_grad_norm=0.7, expected_batch_size=12,
                sharded_noise=True, asynchronous=asynchronous)
            opt.zero_grad()
            for sl in (slice(0, 4), slice(4, 9), slice(9, 12)):
                out = model(x[sl])
                nn.functional.cross_entropy(out.flatten(0, 1), y[sl].flatten(),
                                            reduction="none").view(out.shape[:2]).mean(1) \
                    .mean().backward()
            opt.step()
            assert offered == expect, (asynchronous, offered)
            for n, p in model.named_parameters():
                assert _rel(p.grad, want[n]) < 1e-4, (asynchronous, n, _rel(p.grad, want[n]))
            engine.close()
    finally:
        dist.destroy_process_group()


def test_cuda_micro_batch_sums_name_one_slot_and_drain_nothing(monkeypatch):
    """The GPU transport's sharded steps (_cuda.CudaPhases) of a micro-batch that does not commit,
    on the CPU with the CUDA calls stubbed: every bucket's sums step names
    its outputs in one slot of the widest bucket's size (the daemon writes
    none of them), taken once, and the trainer's stream is never drained
    for it (a commit drains it once, before the daemon writes a slot)."""
    import contextlib

    class L:
        def __init__(self, w):
            self.w_out, self.b_out = Out(w), None
            self.outs = [self.w_out]

    layers = [L(torch.empty(r, 32)) for r in (64, 32, 16, 8)]
    pieces, full_n, shard_n = _fsdp.layout(layers, 1, 0)
    bks = _fsdp.buckets(pieces, 48 * 32)
    assert len(bks) == 3
    drained, ptrs, log = [], [], []  # log: the notice path's calls, in order

    class Stream:
        def synchronize(self):
            drained.append(1)

        def wait_event(self, ev):
            log.append(("stream waits", ev))

    class Client:
        def __init__(self):
            self.tickets = 0

        def register_cuda(self, ptr):
            ptrs.append(ptr)
            return 7, 0

        def wait_enqueued(self, ticket):
            log.append(("notice", ticket))

        def wait(self, ticket):
            log.append(("reply", ticket))

    class Step:
        events, notify = (0, 0), False

        def reset(self, nb):
            pass

        def set_phase(self, phase):
            pass

        def set_events(self, wait, signal):
            self.events = (wait, signal)

        def notify_enqueued(self, yes):
            self.notify = yes

        def run(self, client):
            assert self.events == (0, 0) and not self.notify  # (blocking: nothing to signal)

        def submit(self, client):
            client.tickets += 1
            log.append(("sent", client.tickets, self.events, self.notify))
            return client.tickets

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    sh = _fsdp.Sharded.__new__(_fsdp.Sharded)
    sh.engine = type("E", (), {"client": Client(), "algorithm": 0,
                               "noise_multiplier": 0.0})()
    sh.pieces, sh.full_n, sh.shard_n, sh._buckets = pieces, full_n, shard_n, bks
    sh.world, sh.rank, sh.group, sh.dtype, sh._clip = 1, 0, None, torch.float32, Step()
    sh.widths = [sh._span(f, l)[1] - sh._span(f, l)[0] for f, l in bks]
    sh.widest = max(sh.widths)
    assert len(set(sh.widths)) == 3  # (so that the slots' own sizes show)
    plan = _fsdp._planner.Plan([], [])
    monkeypatch.setattr(_cuda.CudaIPC, "slot_done",
                        lambda self, device, slot: ("done%d" % slot, 100 + slot))
    for scratch, slots, drains in ((True, 1, 0), (False, 3, 1)):
        drained.clear()
        ptrs.clear()
        io = _cuda.CudaIPC(sh.engine.client).phases(sh, plan, 1, torch.device("cpu"), scratch)
        for k, (first, last) in enumerate(bks):
            base, end = sh._span(first, last)[:2]
            got = io.sums(k, [], base, end - base)
            assert got.numel() == end - base
            if not scratch:
                io.copied_ev[k % 3] = None  # (copied() records a CUDA event)
        assert len(set(ptrs)) == slots and len(ptrs) == len(bks), (scratch, ptrs)
        assert sum(t is not None for t in io.slots) == slots
        # a micro-batch's one slot fits every bucket; a commit's three, one
        # bucket each here, its own size (together the whole local sum)
        assert [t.numel() for t in io.slots if t is not None] == (
            [sh.widest] if scratch else sh.widths), (scratch, io.slots)
        assert len(drained) == drains, (scratch, drained)
    # queued one ahead (sums_submit before the previous bucket's
    # sums_wait): a bucket's slot is never the next one's, nor the one
    # before it, still being copied out
    # Each sums step of a commit is sent with an early notice, signalling
    # its slot's own `done`, and waits on no event of the trainer's; the
    # trainer's stream waits on that `done` at the notice, and the final
    # replies are taken by sums_done(), all of them.
    ptrs.clear()
    log.clear()
    io = _cuda.CudaIPC(sh.engine.client).phases(sh, plan, 1, torch.device("cpu"), False)
    spans = [sh._span(f, l)[:2] for f, l in bks]
    sent = {0: io.sums_submit(0, [], spans[0][0], spans[0][1] - spans[0][0])}
    for k in range(len(bks)):
        if k + 1 < len(bks):
            b, e = spans[k + 1]
            sent[k + 1] = io.sums_submit(k + 1, [], b, e - b)
        got = io.sums_wait(k, sent.pop(k))
        assert got.numel() == spans[k][1] - spans[k][0]
        assert got.data_ptr() == io.slots[k % 3].data_ptr()
    assert len(set(ptrs[:3])) == 3 and ptrs[3:] == ptrs[:len(bks) - 3], ptrs
    t0 = sh.engine.client.tickets - len(bks)
    assert [x for x in log if x[0] == "sent"] == [
        ("sent", t0 + k + 1, (0, 100 + k % 3), True) for k in range(len(bks))], log
    assert [x for x in log if x[0] != "sent"] == [
        y for k in range(len(bks)) for y in (("notice", t0 + k + 1), ("stream waits",
                                                                      "done%d" % (k % 3)))], log
    assert io.open == [t0 + k + 1 for k in range(len(bks))]
    log.clear()
    io.sums_done()
    assert log == [("reply", t0 + k + 1) for k in range(len(bks))] and not io.open, log
    assert sh._clip.events == (0, 0) and not sh._clip.notify  # (put back for the next pass)
    # a step failing after its notice: every reply is still taken, the first error raised
    fails = {t0 + 2: RuntimeError("second"), t0 + 3: RuntimeError("third")}

    def wait(ticket):
        log.append(("reply", ticket))
        if ticket in fails:
            raise fails[ticket]
    sh.engine.client.wait = wait
    io.open = [t0 + 1, t0 + 2, t0 + 3]
    log.clear()
    with pytest.raises(RuntimeError, match="second"):
        io.sums_done()
    assert log == [("reply", t0 + k) for k in (1, 2, 3)] and not io.open, log


# --- FSDP2 -------------------------------------------------------------------------------

_ON_GPU = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
           pytest.mark.skipif(not (torch.distributed.is_available() and
                                   torch.distributed.is_nccl_available()), reason="no NCCL")]


@pytest.mark.skipif(_fsdp._classes()[2] is None,  # pylint: disable=protected-access
                    reason="torch %s has no fully_shard (FSDP2: torch >= 2.4)"
                    % torch.__version__)
@pytest.mark.parametrize("layout", [pytest.param("one_gpu", marks=_ON_GPU),
                                    pytest.param("two_gpus", marks=_ON_GPU), "cpu"])
def test_fsdp2_micro_batches_equal_the_union_reference(daemon, tmp_path, layout):
    """Two NCCL ranks on one GPU, or rank r on cuda:r, or two gloo ranks on
    the CPU (the host transport), GPT sharded per
    block and at the root, 16 samples, each rank's 8 in micro-batches
    (equal 4 + 4, ragged 1 + 5 + 2 and 3 + 3 + 2; bf16
    MixedPrecisionPolicy 2 + 6 and 5 + 3): each rank's DTensor shard,
    and the gathered whole, equal the f64
    reference of the 16 together; the reduce-scatters and all-reduces of a
    logical step are one whole step's, none before step(); the noise alone
    (sigma 1, zero loss) has std sigma*C/E, and 3 logical steps cost one
    process's 3 steps of epsilon. engine.logical_batches is refused (each
    rank would split its own batch: counts of forwards fully_shard could
    not pair). A micro-batch whose norm pass fails in the daemon (a loss
    not finite), sent without waiting: every rank raises at step() and
    holds zeros, and the next logical step is applied."""
    if layout == "two_gpus" and torch.cuda.device_count() < 2:
        pytest.skip("two_gpus needs 2 CUDA devices, this machine has %d"
                    % torch.cuda.device_count())
    with dpclip.Client(daemon.socket) as c:
        if layout != "cpu" and not c.info.has_cuda:
            pytest.skip("this dpclipd has no CUDA backend")
    world, B, seed, C = 2, 16, 11, 1.86
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 67, (B, 12), generator=g)
    y = torch.randint(0, 67, (B, 12), generator=g)
    torch.manual_seed(seed)
    want, _, _ = reference(GPT(), "seq", (x,), y, C, "mean", B, margin=PHASED_MARGIN)
    splits = [("f32-equal", [[4, 4], [4, 4]]), ("f32-ragged", [[1, 5, 2], [3, 3, 2]]),
              ("bf16-ragged", [[2, 6], [5, 3]])]
    _spawn(run_fsdp2_accumulate, world, (str(tmp_path / "init"), daemon.socket, (x, y), C, B,
                                         seed, splits, str(tmp_path), layout), timeout=300)
    got = [torch.load(os.path.join(str(tmp_path), "fsdp2acc_%d.pt" % r)) for r in range(world)]
    for case, _ in splits:
        tol = 0.1 if case.startswith("bf16") else 3e-3  # TF32 GEMMs; a bf16 forward
        for r in range(world):
            res = got[r][case]
            whole, acc = res["collectives"]
            assert acc == (0, whole[1]), (case, r, whole, acc)
            for n, w in want.items():
                chunk = -(-w.shape[0] // world)
                start, stop = min(r * chunk, w.shape[0]), min((r + 1) * chunk, w.shape[0])
                scale = float(w.abs().max())
                assert res["dtypes"][n] == torch.float32, (case, n)
                assert float((res["local"][n].double() - w[start:stop]).abs().max()) < \
                    tol * scale, (case, r, n)
                assert float((res["whole"][n].double() - w).abs().max()) < tol * scale, \
                    (case, r, n)
            assert res["norms"].shape == (B // world,), (case, r)
    # the failed micro-batch (collected after the trainer went on): no
    # rank applies that logical step, and the next one is the reference's
    for r in range(world):
        errs, grads = got[r]["fail"]["errors"], got[r]["fail"]["grads"]
        if r == world - 1:
            assert errs[0][0] == _lib.ENONFINITE and "micro-batch 0" in errs[0][2], errs[0]
        else:
            assert errs[0][0] == _lib.EUNAVAIL and "applied on no rank" in errs[0][2], errs[0]
        assert errs[1] is None, errs
        assert all(float(g.abs().max()) == 0.0 for g in grads[0].values()), r
        for n, w in want.items():
            chunk = -(-w.shape[0] // world)
            start, stop = min(r * chunk, w.shape[0]), min((r + 1) * chunk, w.shape[0])
            assert float((grads[1][n].double() - w[start:stop]).abs().max()) < \
                3e-3 * float(w.abs().max()), (r, n)
    noise = torch.cat([torch.cat([got[r]["noise"][n] for r in range(world)]).double().reshape(-1)
                       for n in want])
    want_std = 1.0 * C / B
    assert abs(float(noise.std()) - want_std) < 6 * want_std / math.sqrt(2 * noise.numel()), \
        (float(noise.std()), want_std)

    single = PrivacyEngine(daemon.socket, job_id="fsdp2-acc-ledger-single-" + layout,
                           allow_insecure_seed=True)
    model = nn.Linear(3, 2)
    _, opt, _ = single.make_private(module=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.0), noise_multiplier=1.0, max_grad_norm=C,
        expected_batch_size=B, sample_rate=0.01, target_delta=1e-5, distributed=False)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
    assert got[0]["epsilon"] == pytest.approx(single.last_epsilon, rel=1e-9)
    single.close()
    for r in range(world):
        msg = got[r]["logical_batches"]
        assert msg is not None and "fully_shard" in msg and "same number" in msg, msg
