"""The per-rank halves of the sharded data-parallel tests (spawned processes
import this module by name; it must not be a test module): plain models
with make_private(sharded_noise=True) on gloo, which torch 1.13 runs, and
FSDP2 (fully_shard) models on one GPU, two NCCL ranks told apart by
NCCL_HOSTID, which torch >= 2.4 runs."""
import datetime
import faulthandler
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dpclip import DpclipError, _cuda, _fsdp, _host, _shards
from dpclip.torch import PrivacyEngine, UnsupportedModuleError, reduce_loss
from models import GPT2Like, SeqModel, per_sample_losses


def _init(backend, rank, world, init_file):
    # A rank that hangs prints where, on stderr, before the test's timeout.
    faulthandler.dump_traceback_later(200, exit=True)
    # A timeout well past any step: ranks that fall out of step fail the
    # test instead of hanging it.
    dist.init_process_group(backend, init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))


def _error(e):
    return (getattr(e, "code", None), type(e).__name__, str(e))


def _sharded(model, socket_path, job, C, expected, sigma=0.0, lr=0.0, **kw):
    """(engine, model, optimizer) of make_private(sharded_noise=True) over
    SGD at lr."""
    engine = PrivacyEngine(socket_path, job_id=job, allow_insecure_seed=True)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=expected,
        sharded_noise=True, **kw)
    return engine, model, opt


def _mean_loss(model, data, mine):
    """The mean sequence loss of this rank's samples (indices mine)."""
    x, y = data
    return reduce_loss(per_sample_losses("seq", model(x[mine]), y[mine]), "mean")


def run_sharded(rank, world, init_file, socket_path, data, C, expected, sigma, q, steps,
                out_dir):
    """sharded_noise=True on SeqModel: (1) sigma 0, this rank's samples of
    the union batch (uneven shards); (2) sigma > 0 on a zero loss, `steps`
    steps at sample rate q: the gradients are the noise alone. Saves both,
    the engine's rank and world size, this rank's norms and the ledger's
    epsilon."""
    _init("gloo", rank, world, init_file)
    try:
        torch.manual_seed(100 + rank)  # make_private broadcasts rank 0's weights
        engine, model, opt = _sharded(SeqModel(), socket_path, "fsdp-cpu-exact", C, expected)
        x = data[0]
        mine = torch.arange(rank, x.shape[0], world)
        opt.zero_grad()
        _mean_loss(model, data, mine).backward()
        opt.step()
        out = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
               "world": engine.world_size, "rank": engine.rank, "B": len(mine),
               "norms": engine.last_norms.clone()}
        engine.close()

        engine, model, opt = _sharded(SeqModel(), socket_path, "fsdp-cpu-noise", C, expected,
                                      sigma, sample_rate=q, target_delta=1e-5)
        out["noise"] = []
        for _ in range(steps):
            opt.zero_grad()
            (model(x[mine]) * 0.0).sum().backward()
            opt.step()
            out["noise"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["epsilon"] = engine.last_epsilon
        engine.close()
        torch.save(out, os.path.join(out_dir, "sharded%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def run_sharded_hf(rank, world, init_file, socket_path, data, V, C, expected, out_dir):
    """sharded_noise=True at sigma 0 on GPT2Like (Conv1D weights kept
    [in, out], an lm_head tied to wte): this rank's samples of the union
    batch; saves the gradients."""
    _init("gloo", rank, world, init_file)
    try:
        _shards._BUCKET = 256  # several reduce-scatter buckets, some of one large piece
        torch.manual_seed(7)
        engine, model, opt = _sharded(GPT2Like(V, T=data[0].shape[1]), socket_path,
                                      "fsdp-cpu-hf", C, expected)
        opt.zero_grad()
        _mean_loss(model, data, torch.arange(rank, data[0].shape[0], world)).backward()
        opt.step()
        torch.save({n: p.grad.clone() for n, p in model.named_parameters()},
                   os.path.join(out_dir, "hf%d.pt" % rank))
        sh = engine.mode.shards
        torch.save({"buckets": len(sh._buckets),  # pylint: disable=protected-access
                    "sums_steps": sh.sums_steps, "widest": sh.widest, "full": sh.full_n},
                   os.path.join(out_dir, "hfmeta%d.pt" % rank))
        engine.close()
    finally:
        dist.destroy_process_group()


def run_sharded_owned_noise(rank, world, init_file, socket_path, model_name, data, V, C,
                            expected, sigma, out_dir):
    """sharded_noise=True at sigma > 0 on a zero loss (every clipped sum is
    exactly 0): records each sums step's output as the daemon wrote it
    (before anything else touches it), this rank's layout of the pieces and
    the gradients it applies. model_name: "seq" (SeqModel) or "gpt2"
    (GPT2Like: Conv1D weights written transposed, a tied head)."""
    _init("gloo", rank, world, init_file)
    try:
        _shards._BUCKET = 256  # several sums steps
        recorded = []
        orig = _host.HostPhases.sums

        def sums(io, k, which, base, n):
            full = orig(io, k, which, base, n)
            recorded.append((base, full.detach().clone()))
            return full

        _host.HostPhases.sums = sums
        torch.manual_seed(9)
        model = SeqModel() if model_name == "seq" else GPT2Like(V, T=data[0].shape[1])
        engine, model, opt = _sharded(model, socket_path, "fsdp-cpu-owned-" + model_name, C,
                                      expected, sigma, sample_rate=0.1, target_delta=1e-5)
        x = data[0]
        mine = torch.arange(rank, x.shape[0], world)
        opt.zero_grad()
        (model(x[mine]) * 0.0).sum().backward()
        opt.step()
        sh = engine.mode.shards
        names = {id(p): n for n, p in model.named_parameters()}
        pieces = [{"name": names[id(pc.param)], "full_off": pc.full_off, "chunk": pc.chunk,
                   "inner": pc.inner, "mine": pc.mine, "shape": pc.shape,
                   "cols": id(pc.out) in sh._cols}  # pylint: disable=protected-access
                  for pc in sh.pieces]
        torch.save({"recorded": recorded, "pieces": pieces, "epsilon": engine.last_epsilon,
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()}},
                   os.path.join(out_dir, "owned_%s%d.pt" % (model_name, rank)))
        engine.close()
    finally:
        dist.destroy_process_group()


def run_sharded_failures(rank, world, init_file, socket_path, data, C, expected, out_dir):
    """Step 1's clipping fails on the last rank only (a non-finite
    gradient); step 2 is clean; then, in a job whose budget its first step
    exceeds, the norm passes are refused. Saves each step's error, the
    gradients and the parameters before and after."""
    _init("gloo", rank, world, init_file)
    try:
        torch.manual_seed(5)
        engine, model, opt = _sharded(SeqModel(), socket_path, "fsdp-cpu-fail", C, expected,
                                      1.0, lr=0.5)
        mine = torch.arange(rank, data[0].shape[0], world)
        out = {"before": _params(model), "errors": [], "grads": [], "after": []}
        for i in range(2):
            opt.zero_grad()
            loss = _mean_loss(model, data, mine)
            if i == 0 and rank == world - 1:
                loss = loss * float("nan")
            loss.backward()
            try:
                opt.step()
                out["errors"].append(None)
            except DpclipError as e:
                out["errors"].append(_error(e))
            out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
            out["after"].append(_params(model))
        engine.close()

        engine, model, opt = _sharded(SeqModel(), socket_path, "fsdp-cpu-budget", C, expected,
                                      1.0, lr=0.5, sample_rate=0.5, target_delta=1e-5,
                                      target_epsilon=1e-3)
        before = _params(model)
        opt.zero_grad()
        _mean_loss(model, data, mine).backward()
        try:
            opt.step()
            out["budget"] = None
        except DpclipError as e:
            out["budget"] = _error(e)
        out["budget_moved"] = [n for n, p in model.named_parameters()
                               if not torch.equal(p.detach(), before[n])]
        out["budget_grads"] = [n for n, p in model.named_parameters()
                               if p.grad is None or float(p.grad.abs().max()) != 0.0]
        engine.close()
        torch.save(out, os.path.join(out_dir, "shfail%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def run_sharded_refusals(rank, world, init_file, socket_path, out_dir):
    """What make_private(sharded_noise=True) raises for a mean loss without
    an expected batch size (None: accepted)."""
    _init("gloo", rank, world, init_file)
    try:
        out = {}
        engine = PrivacyEngine(socket_path, job_id="fsdp-cpu-refusals", allow_insecure_seed=True)
        m = nn.Linear(4, 2)
        try:
            engine.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                noise_multiplier=1.0, max_grad_norm=1.0, sharded_noise=True)
            out["no_ebs"] = None
        except ValueError as e:
            out["no_ebs"] = str(e)
        finally:
            engine.close()
        torch.save(out, os.path.join(out_dir, "refusals%d.pt" % rank))
    finally:
        dist.destroy_process_group()


def _owned_noise(sh, recorded, model, rank):
    """FSDP2 on a zero loss: for each parameter, whether the daemon's sums
    output (recorded: (base, sums) per sums step) holds noise on exactly
    the rows this rank owns (nonzero there, zero elsewhere), and whether
    this rank's gradient shard is exactly those rows: nothing added."""
    names = {id(p): n for n, p in model.named_parameters()}
    res = {}
    for pc in sh.pieces:
        n = math.prod(pc.shape)
        base, full = next((b, f) for b, f in recorded if b <= pc.full_off < b + f.numel())
        wire = full[pc.full_off - base:pc.full_off - base + n].view(pc.shape[0], -1).float().cpu()
        r0 = min(rank * pc.chunk, pc.shape[0])
        owned = wire[r0:r0 + pc.mine]
        other = torch.cat([wire[:r0], wire[r0 + pc.mine:]])
        local = pc.param.grad.to_local().float().cpu().reshape(owned.shape)
        res[names[id(pc.param)]] = (bool((other == 0).all()), bool((owned != 0).all()),
                                    torch.equal(local, owned))
    return res


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --- FSDP2 on a GPU ----------------------------------------------------------------------

class Block(nn.Module):
    """A GPT-2 block (pre-LayerNorm attention and MLP) of plain modules."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-small's shape, scaled down: token and position embeddings,
    blocks, a final LayerNorm and an untied head (test_fsdp_sharded.py
    covers a tied one). A vocabulary not divisible by 2 gives uneven shards."""

    def __init__(self, vocab=67, seq=12, d=32, blocks=2, heads=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        B, T = x.shape
        pos = torch.arange(T, device=x.device).unsqueeze(0).expand(B, T)
        h = self.tok(x) + self.pos(pos)
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def fsdp2_api():
    """(fully_shard, MixedPrecisionPolicy): public in torch.distributed.fsdp
    from torch 2.6, in torch.distributed._composable.fsdp in 2.4 and 2.5."""
    try:
        from torch.distributed.fsdp import (  # pylint: disable=import-outside-toplevel
            MixedPrecisionPolicy, fully_shard)
    except ImportError:
        from torch.distributed._composable.fsdp import (  # pylint: disable=import-outside-toplevel
            MixedPrecisionPolicy, fully_shard)
    return fully_shard, MixedPrecisionPolicy


def _shard(model, mesh, mp):
    """fully_shard each block, then the root: the documented order."""
    fully_shard = fsdp2_api()[0]
    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def run_fsdp2(rank, world, init_file, socket_path, data, C, expected, seed, out_dir,
              dev="cuda"):
    """Two ranks on one GPU (NCCL, a host id each), or (dev "cpu") on the
    CPU over gloo. Cases, each with a fresh engine: f32 and bf16
    MixedPrecisionPolicy at sigma 0 (this rank's gradient shards and the
    gathered whole); the noise alone (sigma 1, zero loss); training (sigma
    0, 8 steps, the loss before and after); the ledger after 3 steps at
    sigma 1; make_private before fully_shard; FSDP1 with
    use_orig_params=False (on the GPU)."""
    if dev == "cuda":
        os.environ["NCCL_HOSTID"] = "dpclip-fsdp-test-%d" % rank
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(0)
    _init("nccl" if dev == "cuda" else "gloo", rank, world, init_file)
    try:
        # pylint: disable=import-outside-toplevel
        from torch.distributed.device_mesh import init_device_mesh
        MixedPrecisionPolicy = fsdp2_api()[1]  # pylint: disable=invalid-name
        Shard = _fsdp._classes()[1]  # pylint: disable=invalid-name,protected-access
        mesh = init_device_mesh(dev, (world,))  # keeps the device set above
        x, y = (t.to(dev) for t in data)
        mine = torch.arange(rank, x.shape[0], world, device=dev)
        out = {}
        # the transport whose sums steps the noise case records
        phases = _cuda.CudaPhases if dev == "cuda" else _host.HostPhases

        def fresh(mp=None):
            torch.manual_seed(seed)  # the same weights on every rank, as fully_shard needs
            return _shard(GPT().to(dev), mesh, mp)

        def private(model, job, sigma, lr=0.0, **kw):
            engine = PrivacyEngine(socket_path, job_id="%s-%s" % (job, dev),
                                   allow_insecure_seed=True)
            model, opt, _ = engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=expected, **kw)
            return engine, model, opt

        def loss_of(model, rows=mine):
            return reduce_loss(per_sample_losses("seq", model(x[rows]).float(), y[rows]), "mean")

        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for case, mp in (("f32", None), ("bf16", bf16)):
            engine, model, opt = private(fresh(mp), "fsdp2-" + case, 0.0)
            # a first step on other samples (lr 0: the weights stay), its
            # gradients zeroed in place: the gradients the engine keeps from
            # step to step are written whole again by the second
            opt.zero_grad()
            loss_of(model, mine.flip(0)[:1]).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            loss_of(model).backward()
            opt.step()
            out[case] = {
                "local": {n: p.grad.to_local().cpu().clone()
                          for n, p in model.named_parameters()},
                "whole": {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()},
                "sharded": {n: tuple(p.grad.placements) == (Shard(0),)
                            for n, p in model.named_parameters()},
                "dtypes": {n: p.grad.dtype for n, p in model.named_parameters()},
                "sharded_dtype": engine.mode.shards.dtype}
            engine.close()

        recorded = []  # each sums step's output as the daemon wrote it
        submit, wait, bases = phases.sums_submit, phases.sums_wait, {}

        def record_submit(io, k, which, base, n):  # (queued one bucket ahead)
            bases[k] = base
            return submit(io, k, which, base, n)

        def record_wait(io, k, sent):
            full = wait(io, k, sent)
            recorded.append((bases[k], full.detach().clone()))
            return full

        phases.sums_submit = record_submit
        phases.sums_wait = record_wait
        engine, model, opt = private(fresh(bf16), "fsdp2-noise", 1.0)
        opt.zero_grad()
        (model(x[mine]).float() * 0.0).sum().backward()
        opt.step()
        if phases is _host.HostPhases:  # (inherited: the base class's back)
            del phases.sums_submit, phases.sums_wait
        else:
            phases.sums_submit, phases.sums_wait = submit, wait
        assert len(recorded) == len(engine.mode.shards._buckets), recorded
        out["noise"] = {n: p.grad.to_local().cpu().clone() for n, p in model.named_parameters()}
        sh = engine.mode.shards
        out["owned"] = _owned_noise(sh, recorded, model, rank)
        engine.close()

        engine, model, opt = private(fresh(bf16), "fsdp2-train", 0.0, lr=0.5)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            loss = loss_of(model)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        out["losses"] = losses
        engine.close()

        engine, model, opt = private(fresh(bf16), "fsdp2-ledger", 1.0, lr=0.1, sample_rate=0.01,
                                     target_delta=1e-5)
        for _ in range(3):
            opt.zero_grad()
            loss_of(model).backward()
            opt.step()
        out["epsilon"] = engine.last_epsilon
        engine.close()

        torch.manual_seed(seed)
        late = GPT().to(dev)
        engine, late, opt = private(late, "fsdp2-late", 0.0)
        _shard(late, mesh, None)
        opt.zero_grad()
        loss_of(late).backward()
        try:
            opt.step()
            out["late"] = None
        except RuntimeError as e:
            out["late"] = str(e)
        engine.close()

        try:
            from torch.distributed.fsdp import (  # pylint: disable=import-outside-toplevel
                FullyShardedDataParallel)
        except ImportError:
            FullyShardedDataParallel = None  # pylint: disable=invalid-name
        out["fsdp1"] = "skipped"
        if FullyShardedDataParallel is not None and dev == "cuda":
            torch.manual_seed(seed)
            flat = FullyShardedDataParallel(GPT().cuda(), use_orig_params=False)
            engine = PrivacyEngine(socket_path, job_id="fsdp2-fsdp1", allow_insecure_seed=True)
            try:
                engine.make_private(module=flat, optimizer=torch.optim.SGD(
                    flat.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=C,
                    expected_batch_size=expected)
                out["fsdp1"] = None
            except UnsupportedModuleError as e:
                out["fsdp1"] = str(e)
            finally:
                engine.close()
        torch.save(out, os.path.join(out_dir, "fsdp2_%d.pt" % rank))
    finally:
        dist.destroy_process_group()
