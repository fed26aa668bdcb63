"""Norm groups in the PyTorch integration: make_private(..., norm_group=pg),
where pg is the torch.distributed process group of the ranks that together
hold one model replica (tensor-parallel shards as plain nn.Linears,
pipeline stages). Each member's engine joins one dpclip norm group (named
by a value rank 0 of pg makes and broadcasts) as its pg rank of pg's size:
with flat clipping the daemon sums each sample's squared norm over every
member's layers before clipping, so the split model is clipped exactly as
the whole one; group-wise clipping clips each member alone to
C / sqrt(size). Layers every member holds whole (a LayerNorm under tensor
parallelism) are named by replicated_modules: counted once, noised alike.

The members must agree on the step's terms and on the replicated layers,
and must train on the same samples; agree() checks what it can over pg
(every member sees the same gathered facts, so every member raises the same
error and none is left waiting in a collective). Data parallelism composes:
each replica's members form their own group (_parallel.replicas)."""
import secrets
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from . import _lib
from ._layers import _Layer

CLIPPINGS = ("flat", "group_wise")


class NormGroup:
    """This member's view of its norm group: the process group, its rank and
    size in it, the clipping, and (once agreed) the group's name, the seed
    its members' Poisson loaders share, and (once joined) the daemon's id."""

    def __init__(self, pg: Any, clipping: str, timeout_ms: int) -> None:
        dist = torch.distributed
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.clipping = clipping
        self.group_wise = clipping == "group_wise"
        self.timeout_ms = int(timeout_ms)
        get = getattr(dist, "get_global_rank", None) or \
            dist.distributed_c10d._get_global_rank  # torch < 1.13
        self.ranks: List[int] = [int(get(pg, i)) for i in range(self.size)]
        self.name = ""
        self.seed = 0
        self.id = 0


def setup(pg: Any, clipping: str, replicated_modules: Iterable[Union[nn.Module, str]],
          timeout_ms: int, module: nn.Module, layers: Sequence[_Layer],
          device: torch.device) -> NormGroup:
    """make_private's local checks (no collective: each member raises on
    its own arguments) and the layers marked replicated."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("norm_group: torch.distributed is not initialized; call "
                         "init_process_group first and pass the process group of this rank's "
                         "model-parallel peers (torch.distributed.new_group, or group.WORLD)")
    if not isinstance(pg, dist.ProcessGroup):
        raise ValueError("norm_group: expected a torch.distributed process group (new_group's, "
                         "or group.WORLD), got %s" % type(pg).__name__)
    if dist.get_rank(pg) < 0:
        raise ValueError("norm_group: this rank (%d) is not a member of the process group given"
                         % dist.get_rank())
    if clipping not in CLIPPINGS:
        raise ValueError("norm_group_clipping must be 'flat' or 'group_wise', got %r"
                         % (clipping,))
    if timeout_ms < 0:
        raise ValueError("norm_group_timeout_ms must be >= 0 (0: the daemon's "
                         "groups.timeout_ms), got %r" % (timeout_ms,))
    group = NormGroup(pg, clipping, timeout_ms)
    names = {id(m): n for n, m in module.named_modules()}
    for entry in replicated_modules:
        if isinstance(entry, str):
            found = dict(module.named_modules()).get(entry)
            if found is None:
                raise ValueError("replicated_modules: %r is not a submodule of the module given "
                                 "to make_private" % (entry,))
            entry = found
        elif not isinstance(entry, nn.Module) or id(entry) not in names:
            raise ValueError("replicated_modules: %s is not a submodule of the module given to "
                             "make_private (pass this rank's own modules, or their names)"
                             % (type(entry).__name__,))
        inside = {id(m) for m in entry.modules()}
        marked = [l for l in layers if id(l.module) in inside]
        if not marked:
            raise ValueError("replicated_modules: %r holds no layer dpclip trains (Linear, "
                             "Embedding, LayerNorm, RMSNorm with a trainable weight)"
                             % (names[id(entry)] or type(entry).__name__,))
        for l in marked:
            l.replicated = True
    if group.group_wise and any(l.replicated for l in layers):
        raise ValueError(
            "replicated_modules: a norm group with norm_group_clipping='group_wise' cannot "
            "share replicated layers (each member clips its own layers to its own threshold, "
            "C / sqrt(size)); use 'flat', or hold each such module on one member only")
    if device.type == "cuda" and not group.group_wise:
        raise NotImplementedError(
            "norm_group: flat clipping across a norm group (norm_group_clipping='flat') is not "
            "implemented for GPU tensors yet: dpclipd sums a group's per-sample norms on "
            "host-memory steps only for now. Train this model on the CPU, or clip group-wise "
            "(norm_group_clipping='group_wise': each member to C / sqrt(size), no reduction)")
    return group


def _gather(group: NormGroup, mine: Dict[str, Any]) -> List[Dict[str, Any]]:
    every: List[Optional[Dict[str, Any]]] = [None] * group.size
    torch.distributed.all_gather_object(every, mine, group=group.pg)
    return every  # type: ignore[return-value]


def _differ(what: str, every: Sequence[Dict[str, Any]], key: str, hint: str = "") -> None:
    vals = [m[key] for m in every]
    if any(v != vals[0] for v in vals):
        raise ValueError("%s: the members of a norm group must agree (%s)%s" % (
            what, ", ".join("member %d: %r" % (k, v) for k, v in enumerate(vals)), hint))


def agree_terms(group: NormGroup, layers: Sequence[_Layer], terms: Dict[str, Any],
                loader: str) -> None:
    """The first agreement (before the data loader is made): rank 0's group
    name and loader seed, and that every member clips alike, marks the same
    replicated layers in the same order, and will draw the same batches.
    loader: "" (none), "seed:<digest>" (a DPDataLoader's generator state),
    "secure" (masks from os.urandom), "make" (make_private makes one)."""
    mine = dict(terms, name="dpclip-" + secrets.token_hex(8), seed=secrets.randbits(63),
                replicated=[l.name for l in layers if l.replicated], loader=loader)
    every = _gather(group, mine)
    group.name, group.seed = every[0]["name"], every[0]["seed"]
    _differ("norm_group_clipping", every, "clipping")
    for key in ("max_grad_norm", "noise_multiplier", "loss_reduction"):
        _differ(key, every, key)
    _differ("replicated_modules", every, "replicated",
            ": mark the same layers (by name) on every member, in the same order")
    kinds = [m["loader"] for m in every if m["loader"]]
    if len(kinds) > 1 and ("secure" in kinds or len(set(kinds)) > 1):
        raise ValueError(
            "data_loader: %d members of the norm group pass data loaders (%s), which would "
            "draw different batches; every member must train on the same samples: load each "
            "batch on one member and send it to the others, or give every member a "
            "DPDataLoader whose generator is seeded alike (not secure_mode), or the same plain "
            "loader for make_private to convert" % (len(kinds), ", ".join(
                "member %d: %s" % (k, m["loader"]) for k, m in enumerate(every) if m["loader"])))


def agree_sampling(group: NormGroup, expected: Optional[int],
                   sample_rate: Optional[float]) -> Dict[str, Any]:
    """The second agreement (once the loader is made): the expected batch
    size and sample rate the members give (None: not given), checked
    alike; a member that gives none takes the first given (in rank order:
    the member that loads the data). Returns the group's values."""
    every = _gather(group, {"expected_batch_size": expected, "sample_rate": sample_rate})
    out = {}
    for key in ("expected_batch_size", "sample_rate"):
        given = [(k, m[key]) for k, m in enumerate(every) if m[key] is not None]
        if any(v != given[0][1] for _, v in given):
            raise ValueError("%s: the members of a norm group that give it must agree (%s); "
                             "give it on one member (the one that loads the data) or the "
                             "same on all" % (key, ", ".join("member %d: %r" % kv
                                                             for kv in given)))
        out[key] = given[0][1] if given else None
    return out


def join(group: NormGroup, client: _lib.Client) -> None:
    """Joins the daemon's norm group (after the connection is final)."""
    group.id = client.join_group(group.name, group.rank, group.size, group.timeout_ms,
                                 group.group_wise)
