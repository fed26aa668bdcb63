"""make_private's checks of its terms, apart from the engine (dpclip.torch)."""
import math
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from . import _lib, _parallel
from .data import DPDataLoader

__all__ = ["check_module", "check_terms", "loader_kind"]


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
