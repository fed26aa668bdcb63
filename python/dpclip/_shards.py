"""The sharded layout of dpclip._fsdp's sums: one piece per trainable
parameter, a padded [world * chunk, ...] region each in a rank's local
sums and a [chunk, ...] shard in its shards (fully_shard's dim-0 chunks),
and the buckets, runs of pieces reduce-scattered (and summed by the
daemon) together."""
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _gate, _planner
from ._layers import Out, _Layer

_EALIGN = 32  # element alignment of each region (64 bytes and more)


class Piece(NamedTuple):
    """One parameter in the sharded layout: its whole shape, the elements
    of one dim-0 row, the rows of each rank's padded shard (chunk), the
    rows this rank owns (mine: chunk or fewer, maybe 0), and the element
    offsets of its padded [world * chunk, ...] region in the sums and of
    its [chunk, ...] shard in this rank's shards."""
    param: torch.Tensor
    out: Out
    shape: Tuple[int, ...]
    inner: int
    chunk: int
    mine: int
    full_off: int
    shard_off: int


def _al(n: int) -> int:
    return (n + _EALIGN - 1) // _EALIGN * _EALIGN


def layout(layers: Sequence[_Layer], world: int, rank: int
           ) -> Tuple[List[Piece], int, int]:
    """The pieces of the layers' outputs (one per trainable parameter, a
    tied weight once, in the layers' order), the sums' length and this
    rank's shards' length, in elements. Rank r owns rows [r * chunk,
    (r + 1) * chunk) of each parameter (those that exist): torch.chunk's
    split, which fully_shard uses."""
    pieces, full, shard = [], 0, 0
    for o in _planner.outputs(layers):
        p = o.param
        shape = tuple(p.shape)
        rows = shape[0]
        inner = math.prod(shape[1:])
        chunk = -(-rows // world)
        mine = max(0, min(chunk, rows - rank * chunk))
        pieces.append(Piece(p, o, shape, inner, chunk, mine, full, shard))
        full += _al(world * chunk * inner)
        shard += _al(chunk * inner)
    return pieces, full, shard


def _out_view(pc: Piece) -> torch.Tensor:
    """Out.grad's view of piece pc's flat output (on the meta device: no
    memory): the layout the daemon writes its parameter in."""
    return pc.out.grad(torch.empty(math.prod(pc.shape), device="meta"))


def _own_layout(g: torch.Tensor, pc: Piece) -> bool:
    return tuple(g.shape) == pc.shape and g.is_contiguous()


def _relaid(pc: Piece) -> bool:
    """Whether the daemon writes piece pc's parameter in another layout
    than the parameter's."""
    return not _own_layout(_out_view(pc), pc)


def _transposed(pc: Piece) -> bool:
    """Whether the daemon writes piece pc's parameter transposed (a weight
    kept [in, out], such as transformers' Conv1D, written [out, in]): its
    dim-0 rows, which fully_shard shards, are then the output's columns.
    Read from the layout Out.grad gives the flat output (on the meta
    device: no memory); any layout other than the parameter's own or that
    transpose is refused, as no range of the output would hold its rows."""
    g = _out_view(pc)
    if _own_layout(g, pc):
        return False
    if g.dim() == 2 and tuple(g.shape) == pc.shape and tuple(g.stride()) == (1, pc.shape[0]):
        return True
    raise NotImplementedError(
        "a parameter of shape %s is written by the daemon in a layout (strides %s) whose "
        "dim-0 rows are neither its rows nor its columns: sharded noise cannot name this "
        "rank's rows of it" % (pc.shape, tuple(g.stride())))


# elements per rank in one reduce-scatter bucket, and so in one sums step
# (None: bucket_size()'s rule; set to override it): each step costs the
# daemon and the trainer a round trip and fixed work. A 1B model's 21
# buckets of 16M took 1.45x the plain FSDP2 step on 4 H200s against 1.38x
# for 5 of 64M; on 2 H200s, 64M / 256M / one bucket took 1.22 / 1.18 /
# 1.15x (after the sums steps' early notice), the trainer's peak 1.11 /
# 1.13 / 1.16x the plain one.
_BUCKET: Optional[int] = None
_BUCKET_MAX = 1 << 28  # elements per rank
_SLOT_MAX = 1 << 29  # elements in one bucket's sums over every rank: 1 GiB of bf16 a slot


def bucket_size(world: int) -> int:
    """Elements per rank in one bucket: _BUCKET where set, else 256M, less
    where the bucket's sums over `world` ranks (a slot: the GPU transport
    holds three) would pass 512M elements, so that the slots' memory does
    not grow with the world (64M a rank on 8)."""
    if _BUCKET is not None:
        return _BUCKET
    return max(1 << 20, min(_BUCKET_MAX, _SLOT_MAX // max(world, 1)))


def buckets(pieces: Sequence[Piece], per_rank: int,
            spans: Sequence[Tuple[int, int]] = ()) -> List[Tuple[int, int]]:
    """[first, last) ranges of consecutive pieces whose shards span about
    per_rank elements (a larger piece alone): one collective each, and one
    sums step of the layer group writing them (dpclip._gate.buckets' rule).
    spans: [lo, hi] piece ranges never cut (the pieces one part writes: a
    layer's weight and bias, a tied weight's uses), so that each part is
    summed in one bucket."""
    joined = [False] * len(pieces)  # joined[i]: pieces i - 1 and i go together
    for lo, hi in spans:
        for i in range(lo + 1, hi + 1):
            joined[i] = True
    return _gate.buckets([_al(pc.chunk * pc.inner) for pc in pieces], per_rank,
                         joined=joined.__getitem__)
