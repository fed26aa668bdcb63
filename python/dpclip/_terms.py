"""make_private's checks of its terms, and its sampling terms, apart from
the engine (dpclip.torch)."""
import math
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from . import _group, _lib, _parallel
from .data import DPDataLoader

__all__ = ["check_module", "check_terms", "loader_kind", "settle_sampling"]


def check_terms(loss_reduction: str, max_grad_norm: float, noise_multiplier: float,
                algorithm: str) -> int:
    """make_private's clipping terms, each refused by its name; returns the
    algorithm's wire value."""
    if loss_reduction not in ("mean", "sum"):
        raise ValueError("loss_reduction must be 'mean' or 'sum', got %r" % (loss_reduction,))
    if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
        raise ValueError("max_grad_norm must be a positive number")
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError("noise_multiplier must be >= 0")
    algos = {"auto": _lib.ALGO_AUTO, "direct": _lib.ALGO_DIRECT, "ghost": _lib.ALGO_GHOST}
    if algorithm not in algos:
        raise ValueError("algorithm must be one of %s, got %r" % (", ".join(algos), algorithm))
    return algos[algorithm]


def check_module(module: nn.Module) -> None:
    """Refuses, naming the first such parameter, a module whose trainable
    parameters the daemon cannot train: on the meta device (no data yet:
    the daemon would read nothing) or in float64 (its kernels take f32,
    bf16 and f16, and a silent cast would change what the model computes)."""
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if p.device.type == "meta":
            raise ValueError("parameter %r is on the meta device: materialize the model "
                             "(module.to_empty(device=...) and initialize it, or load its "
                             "weights) before make_private" % name)
        if p.dtype == torch.float64:
            raise ValueError("parameter %r is float64: dpclip trains float32, bfloat16 and "
                             "float16 parameters (the daemon has no float64 kernels); "
                             "module.float() before make_private" % name)


def loader_kind(loader: Optional[DataLoader], poisson_sampling: bool, secure_mode: bool) -> str:
    """How a norm group member's loader draws its batches, for the members
    to compare (dpclip._group.agree_terms): "" without one."""
    if loader is None:
        return ""
    if isinstance(loader, DPDataLoader):
        return "secure" if loader.secure_mode else \
            "generator %016x" % (_parallel.generator_digest(loader) & (2 ** 64 - 1))
    if not poisson_sampling:
        return "a loader of its own"
    return "secure" if secure_mode else "converted by make_private"


def settle_sampling(engine: Any, data_loader: Optional[DataLoader], poisson_sampling: bool,
                    secure_mode: bool, expected_batch_size: Optional[int],
                    sample_rate: Optional[float], loss_reduction: str, group: Any,
                    loader_fault: Any, digest: Any) -> Optional[DataLoader]:
    """make_private's sampling terms: sets the engine's expected_batch_size
    and sample_rate (a norm group's members agree on them) and returns the
    loader, Poisson-sampled where asked."""
    ebs_given = expected_batch_size is not None or isinstance(data_loader, DPDataLoader) \
        or (data_loader is not None and bool(data_loader.batch_size))
    rate_given = sample_rate is not None or isinstance(data_loader, DPDataLoader) or \
        (data_loader is not None and poisson_sampling)
    gen = None
    if group is not None and not secure_mode:
        # the members' loaders made here draw the same masks
        gen = torch.Generator().manual_seed(group.seed)
    if data_loader is not None and poisson_sampling and not isinstance(data_loader,
                                                                       DPDataLoader):
        replica = {"rank": engine.rank, "world_size": engine.world_size} if group else {}
        data_loader = DPDataLoader.from_data_loader(data_loader, distributed=engine.distributed,
                                                    secure_mode=secure_mode, generator=gen,
                                                    **replica)
    if sample_rate is not None and isinstance(data_loader, DPDataLoader) and not \
            math.isclose(float(sample_rate), data_loader.sample_rate, rel_tol=1e-9):
        # the ledger would account a q the batches are not drawn at
        raise ValueError(
            "sample_rate=%r disagrees with the data loader's: the DPDataLoader samples "
            "each record with probability %r, and the ledger must account the rate the "
            "batches are drawn at; leave sample_rate out (the loader's is taken) or make "
            "them agree" % (sample_rate, data_loader.sample_rate))
    if expected_batch_size is None:
        if isinstance(data_loader, DPDataLoader):
            expected_batch_size = data_loader.expected_batch_size
        elif data_loader is not None and data_loader.batch_size:
            expected_batch_size = data_loader.batch_size * engine.world_size
        else:
            expected_batch_size = 0
    engine.expected_batch_size = int(expected_batch_size)
    if sample_rate is None:
        sample_rate = data_loader.sample_rate if isinstance(data_loader, DPDataLoader) else 0.0
    if group is not None:
        # a member without them (a later pipeline stage) takes the loader's member's
        mates, parts = _group.agree(group, {
            "expected_batch_size": engine.expected_batch_size if ebs_given else None,
            "sample_rate": float(sample_rate) if rate_given else None, "digest": digest},
            loader_fault, engine.distributed, _group.judge_sampling)
        if engine.world_size > 1:  # the replicas' loaders, part by part
            for j in range(group.size):
                fault = _parallel.same_generators([(p[j]["ranks"][j], p[j]["digest"])
                                                   for p in parts.values()])
                if fault is not None:
                    raise fault
        engine.expected_batch_size = int(_group.first_given(mates, "expected_batch_size") or 0)
        sample_rate = _group.first_given(mates, "sample_rate") or 0.0
    if loss_reduction == "mean" and engine.expected_batch_size <= 0 and \
            0.0 < float(sample_rate) < 1.0:
        # Dividing by the drawn batch size would release it without noise.
        raise ValueError(
            "a mean loss under Poisson sampling (sample_rate %g) needs expected_batch_size "
            "(the daemon divides the noised sum by it, not by the drawn batch size)"
            % float(sample_rate))
    engine.sample_rate = float(sample_rate)
    return data_loader
