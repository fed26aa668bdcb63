"""What bench_fsdp.py and fsdp_check.py (its --check) both use: the
progress lines, a rank's setup (process group, model, fully_shard, dpclip),
the loss, the spawning of processes. A module of its own that imports
neither, so that the two need not import each other.
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from bench_torch_step import register_norms  # noqa: E402
from bench_torch_step import build as make_model  # noqa: E402
from dpclip import _shards  # noqa: E402
from dpclip.torch import PrivacyEngine  # noqa: E402

# the run's start, for the progress lines (spawned ranks inherit it)
T0 = float(os.environ.setdefault("BENCH_FSDP_T0", repr(time.time())))


def log(msg):
    print("bench_fsdp [%6.1f s] %s" % (time.time() - T0, msg), file=sys.stderr, flush=True)


def fsdp2_api():
    """(fully_shard, MixedPrecisionPolicy), or None before torch 2.4."""
    for mod in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            m = __import__(mod, fromlist=["fully_shard", "MixedPrecisionPolicy"])
            return m.fully_shard, m.MixedPrecisionPolicy
        except Exception:  # pylint: disable=broad-except
            continue
    return None


def policy(args):
    """The MixedPrecisionPolicy of --precision (None for fp32)."""
    if args.precision != "bf16":
        return None
    return fsdp2_api()[1](param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


# --- per process ---------------------------------------------------------------------

def init_rank(rank, world, init_file, args, timeout_s):
    """This rank's device and FSDP2 mesh (None without fully_shard or on
    the CPU), the process group initialized."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    device = torch.device("cpu")
    if args.device == "cuda":
        if torch.cuda.device_count() >= world:
            device = torch.device("cuda", rank)  # a GPU each: NCCL finds NVLink
        else:
            device = torch.device("cuda", 0)
            # NCCL refuses two ranks of one host on one GPU: a host id each
            os.environ["NCCL_HOSTID"] = "bench-fsdp-%d" % rank
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    mesh = None
    if device.type == "cuda" and fsdp2_api() is not None:
        # pylint: disable=import-outside-toplevel
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (world,))  # keeps the device set above
    return device, mesh


def prepare(args):
    """What every process does first: dpclip learns the Llama's RMSNorm
    (and takes --bucket's size); returns the model's initial state (seed 0,
    on the CPU)."""
    register_norms(args.model)
    if getattr(args, "bucket", None):
        _shards._BUCKET = args.bucket  # pylint: disable=protected-access
    torch.manual_seed(0)
    return make_model(args).state_dict()


def fresh_model(args, device, init):
    """A model on device holding init's weights."""
    if hasattr(torch.device, "__enter__"):  # torch >= 2.0: no second initialization
        with torch.device("meta"):
            model = make_model(args)
        model = model.to_empty(device=device)
    else:
        model = make_model(args).to(device)
    model.load_state_dict(init)
    return model


def shard(model, mesh, args):
    """fully_shard on each block, then the root (nothing without a mesh)."""
    if mesh is None:
        return model
    fully_shard = fsdp2_api()[0]
    kw = {"mesh": mesh}
    if policy(args) is not None:
        kw["mp_policy"] = policy(args)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def global_size(args, world):
    """Samples a (logical) step over every rank: --logical, else world x B."""
    return args.logical or world * args.batch


def private(args, model, world, sharded_noise, sigma, lr):
    """(engine, model, optimizer): dpclip's make_private over SGD at lr."""
    engine = PrivacyEngine(args.socket, client_name="bench_fsdp", job_id=args.job_id)
    model, opt, _ = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        noise_multiplier=sigma, max_grad_norm=1.0, loss_reduction="mean",
        expected_batch_size=global_size(args, world), sharded_noise=sharded_noise)
    return engine, model, opt


def seq_loss(logits, y):
    # every sample has T tokens: the token mean is the mean of per-sample means
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


# --- the main process ---------------------------------------------------------------

def spawn(fn, nprocs, args, deadline_s=None):
    """fn(i, *args) in nprocs spawned processes; None when every one exited
    0, else why not (the others are ended: join does, as does the deadline)."""
    ctx = mp.start_processes(fn, nprocs=nprocs, join=False, start_method="spawn", args=args)
    end = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=10):
            if end is not None and time.monotonic() > end:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                for p in ctx.processes:
                    p.join(10)
                    if p.is_alive():
                        p.kill()
                return "timed out after %d s" % deadline_s
    except Exception as e:  # pylint: disable=broad-except
        text = [line for line in str(e).strip().splitlines() if line.strip()]
        return "%s: %s" % (type(e).__name__, text[-1] if text else "")
    return None


def placement(args):
    """Where the ranks run, in words (init_rank decides alike)."""
    if args.device != "cuda":
        return "on the CPU (gloo)"
    if torch.cuda.device_count() >= args.world:
        return "a GPU each (cuda:0..%d)" % (args.world - 1)
    return "all on cuda:0 (a NCCL_HOSTID each)"
