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
and must train on the same samples; agree() checks what it can (every
member, and with data parallelism every rank, sees the same gathered facts
and so raises the same error: none is left waiting in a collective). Data
parallelism composes: each replica is a norm group, and the members
holding one part of the model in every replica are its data-parallel
ranks (_parallel.replica_groups)."""
import os
import secrets
import socket
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

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
        self.daemons = 1


def open_group(pg: Any, clipping: str, timeout_ms: int) -> NormGroup:
    """This member's NormGroup, from make_private's arguments. Raises at
    once where pg cannot be used to tell the others (no collective)."""
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
    return NormGroup(pg, clipping, timeout_ms)


def check(group: NormGroup, replicated_modules: Iterable[Union[nn.Module, str]],
          module: nn.Module, layers: Sequence[_Layer], device: torch.device) -> None:
    """make_private's local checks of this member's arguments, and the
    layers marked replicated. The caller hands what it raises to agree(),
    so that every member raises, not this one alone."""
    if group.clipping not in CLIPPINGS:
        raise ValueError("norm_group_clipping must be 'flat' or 'group_wise', got %r"
                         % (group.clipping,))
    if group.timeout_ms < 0:
        raise ValueError("norm_group_timeout_ms must be >= 0 (0: the daemon's "
                         "groups.timeout_ms), got %r" % (group.timeout_ms,))
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


Judge = Callable[[List[Dict[str, Any]]], Optional[Exception]]
Parts = Dict[Tuple[int, ...], List[Dict[str, Any]]]  # each norm group's facts, by its ranks


def agree(group: NormGroup, mine: Dict[str, Any], failure: Optional[Exception], everyone: bool,
          judge: Judge) -> Tuple[List[Dict[str, Any]], Parts]:
    """One exchange of make_private's facts (`mine`, a dict) among the
    members of this norm group, or among every rank (`everyone`: data
    parallelism, where each replica is a norm group). Every rank then
    judges every group alike and raises the first fault found anywhere: a
    member's own local failure (that member raises it as it was, the others
    name it), then judge(members' dicts, in group rank order). Returns
    (this group's dicts, every group's by its global ranks)."""
    dist = torch.distributed
    mine = dict(mine, ranks=tuple(group.ranks), rank=group.rank,
                failure=None if failure is None else (type(failure).__name__, str(failure)))
    every: List[Any] = [None] * (dist.get_world_size() if everyone else group.size)
    dist.all_gather_object(every, mine, group=None if everyone else group.pg)
    parts: Parts = {}
    for d in every:
        parts.setdefault(d["ranks"], []).append(d)
    for members in parts.values():
        members.sort(key=lambda d: d["rank"])
    if failure is not None:
        raise failure
    order = [mine["ranks"]] + sorted(k for k in parts if k != mine["ranks"])
    for key in order:
        members = parts[key]
        where = "" if key == mine["ranks"] else "the norm group of ranks %s: " % list(key)
        for d in members:
            if d["failure"] is not None:
                kind, msg = d["failure"]
                raise (NotImplementedError if kind == "NotImplementedError" else ValueError)(
                    "%smake_private failed on member %d (rank %d) of the norm group: %s"
                    % (where, d["rank"], d["ranks"][d["rank"]], msg))
        err = judge(members)
        if err is not None:
            raise type(err)(where + str(err))
    return parts[mine["ranks"]], parts


def _differ(what: str, members: Sequence[Dict[str, Any]], key: str,
            hint: str = "") -> Optional[Exception]:
    vals = [m[key] for m in members]
    if any(v != vals[0] for v in vals):
        return ValueError("%s: the members of a norm group must agree (%s)%s" % (
            what, ", ".join("member %d: %r" % (k, v) for k, v in enumerate(vals)), hint))
    return None


def judge_terms(members: List[Dict[str, Any]]) -> Optional[Exception]:
    """The first agreement's faults: members that clip differently, mark
    other replicated layers, or would draw different batches."""
    same_order = ": mark the same layers (by name) on every member, in the same order"
    for what, key, hint in (("norm_group_clipping", "clipping", ""),
                            ("max_grad_norm", "max_grad_norm", ""),
                            ("noise_multiplier", "noise_multiplier", ""),
                            ("loss_reduction", "loss_reduction", ""),
                            ("replicated_modules", "replicated", same_order)):
        err = _differ(what, members, key, hint)
        if err is not None:
            return err
    kinds = [m["loader"] for m in members if m["loader"]]
    if len(kinds) > 1 and ("secure" in kinds or len(set(kinds)) > 1):
        return ValueError(
            "data_loader: %d members of the norm group pass data loaders (%s), which would "
            "draw different batches; every member must train on the same samples: load each "
            "batch on one member and send it to the others, or give every member a "
            "DPDataLoader whose generator is seeded alike (not secure_mode), or the same plain "
            "loader for make_private to convert" % (len(kinds), ", ".join(
                "member %d: %s" % (k, m["loader"]) for k, m in enumerate(members)
                if m["loader"])))
    return None


def terms(group: NormGroup, layers: Sequence[_Layer], values: Dict[str, Any],
          loader: str) -> Dict[str, Any]:
    """This member's facts for the first agreement: its terms, replicated
    layers and loader (loader: "" without one, else how it draws: see
    dpclip._terms.loader_kind), and a candidate group name and loader seed
    (rank 0's are taken)."""
    return dict(values, clipping=group.clipping, name="dpclip-" + secrets.token_hex(8),
                seed=secrets.randbits(63), replicated=[l.name for l in layers if l.replicated],
                loader=loader)


def judge_sampling(members: List[Dict[str, Any]]) -> Optional[Exception]:
    """The second agreement's faults: members that give different expected
    batch sizes or sample rates (None: not given)."""
    for key in ("expected_batch_size", "sample_rate"):
        given = [(k, m[key]) for k, m in enumerate(members) if m[key] is not None]
        if any(v != given[0][1] for _, v in given):
            return ValueError("%s: the members of a norm group that give it must agree (%s); "
                              "give it on one member (the one that loads the data) or the "
                              "same on all" % (key, ", ".join("member %d: %r" % kv
                                                              for kv in given)))
    return None


def first_given(members: List[Dict[str, Any]], key: str) -> Any:
    """The first member's value of key that is not None (in rank order:
    the member that loads the data gives it), or None."""
    return next((m[key] for m in members if m[key] is not None), None)


def judge_layout(world: int, parts: List[Tuple[int, ...]]) -> None:
    """With data parallelism: the norm groups must split the ranks into
    replicas of one size (every rank sees the same parts: raises alike)."""
    if sorted(r for p in parts for r in p) != list(range(world)) or \
            any(len(p) != len(parts[0]) for p in parts):
        raise ValueError(
            "norm_group: with data parallelism (distributed) the norm groups must split the %d "
            "ranks into replicas of one size, each rank in exactly one; they are %s (pass "
            "distributed=False if the groups train apart)"
            % (world, ", ".join(str(list(p)) for p in parts)))


def daemon_key(client: _lib.Client) -> str:
    """Which daemon this member uses: members with the same key share one."""
    return "%s:%s" % (socket.gethostname(), os.path.realpath(client.socket_path))


def daemon_layout(keys: Sequence[str], rank: int) -> Tuple[int, int, int]:
    """(daemons, this member's daemon rank, members on its daemon), from
    every member's daemon_key in rank order; daemons are numbered by their
    lowest member, so rank 0's daemon is daemon 0 (it makes the NCCL id)."""
    order: List[str] = []
    for k in keys:
        if k not in order:
            order.append(k)
    mine = keys[rank]
    return len(order), order.index(mine), sum(1 for k in keys if k == mine)


def join(group: NormGroup, client: _lib.Client) -> None:
    """Joins the daemon's norm group (after the connection is final). When
    the members use several daemons, rank 0 joins first; its daemon makes
    the group's NCCL id, which is broadcast over pg to the other members
    (dpclipd opens no port: the trainers are the rendezvous). Every member
    raises the same error if any member's join failed."""
    dist = torch.distributed
    keys: List[Any] = [None] * group.size
    dist.all_gather_object(keys, daemon_key(client), group=group.pg)
    daemons, daemon_rank, local = daemon_layout(keys, group.rank)
    group.daemons = daemons
    if daemons == 1 or group.group_wise:
        group.id = client.join_group(group.name, group.rank, group.size, group.timeout_ms,
                                     group.group_wise)
        return
    failure = ""
    box: List[Any] = [None]
    if group.rank == 0:
        try:
            group.id, nccl_id, version = client.join_group_linked(
                group.name, 0, group.size, daemons, 0, local, timeout_ms=group.timeout_ms)
            box = [(nccl_id, version, "")]
        except _lib.DpclipError as e:
            box = [(b"", 0, "rank 0: %s" % e)]
    dist.broadcast_object_list(box, src=group.ranks[0], group=group.pg)
    nccl_id, version, failure = box[0]
    if group.rank != 0:
        if failure:  # rank 0 reports it
            failure = ""
            nccl_id = b""
        else:
            try:
                group.id = client.join_group_linked(
                    group.name, group.rank, group.size, daemons, daemon_rank, local, nccl_id,
                    version, timeout_ms=group.timeout_ms)[0]
            except _lib.DpclipError as e:
                failure = "rank %d: %s" % (group.rank, e)
    outcomes: List[Any] = [None] * group.size
    dist.all_gather_object(outcomes, failure, group=group.pg)
    bad = [o for o in outcomes if o]
    if bad:
        raise RuntimeError("norm_group: joining the group across %d daemons failed: %s"
                           % (daemons, "; ".join(bad)))
