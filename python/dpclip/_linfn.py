"""Raw weights a module passes to F.linear itself: a mixture-of-experts
router's weight [E, d] (transformers 5's MixtralTopKRouter), and experts
kept as one 3-D parameter [E, p, d] whose forward calls
F.linear(rows, W[e]) for the rows routed to expert e (MixtralExperts,
Qwen2MoeExperts). transformers 5's default kernel for them, grouped_mm,
instead sorts the (token, choice) rows by expert and calls one grouped
product per projection, fn(rows, W.transpose(-2, -1), offs=ends of each
expert's rows).

Each (parameter, expert) pair is a Linear over the rows it was called on,
so its per-sample gradient is the Linear's rule over those rows: the sum,
over the sample's rows, of g_r x_r^T. The module's own forward runs as
written (transformers' eager experts code where its config asks for a
kernel other than these) under a TorchFunctionMode that sees each call:
- F.linear whose weight is a trained parameter, or W[e], the view of one
  expert of a 3-D one (and no bias), runs through the Linear's own
  autograd Function (_layers._LinearFn): the same product with autocast's
  casts, whose backward captures the rows and their output gradient for
  the pair and gives autograd no weight gradient;
- a grouped product against a 3-D parameter's transpose runs as it is
  through GroupedLinFn, which captures its rows likewise;
- any other use of a trained parameter, of a view of one or of a copy
  made of one refuses the module, naming the function: dpclip would not
  know the per-sample rule.
The rows' samples are proved from the autograd graph (dpclip._rows: a
reshape of the batch-first hidden states, then the rows an index picked),
and each pair's rows are placed zero-padded in [B, Tmax, d] (a zero row
adds nothing). A pair no row reached sends zeros. The squared norms of the
pairs sum to the parameter's (the experts' slices are disjoint), which the
daemon adds with every other layer's before the clip. The first step
checks the placement against autograd through F.linear on each sample's
own rows (LinFnLayer.self_check says why not through the whole module).

Which modules are tried is chosen at make_private: a module that is not
torch's, with trainable parameters of two or three dimensions only, whose
forward's source calls linear( or a grouped product. Whether it uses them
only that way is checked at each forward, as above."""
import inspect
import re
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _rows
from ._layers import Part, UnsupportedModuleError, _label, _Layer, _LinearFn, _part

__all__ = ["layers_for", "LinFnLayer"]

# the first-step check: how many captures, and samples of each, it compares
_PROBE_RECORDS = 256
_PROBE_SAMPLES = 4

# Tensor attribute reads and shape queries, harmless on a trained parameter,
# and views of it (one expert's W[e], the transpose a grouped product
# takes), each of whose uses is checked in turn (_Uses)
_READS = {"__get__", "size", "dim", "numel", "stride", "__len__", "is_contiguous",
          "storage_offset", "data_ptr", "is_floating_point", "__getitem__", "select",
          "transpose", "t", "permute", "view", "unsqueeze", "squeeze"}


class _Pair:
    """One (parameter, expert) pair as the layer _LinearFn captures for:
    the same product with autocast's casts, the input gradient alone, and
    the rows with their output gradient handed to LinFnLayer.take."""
    __slots__ = ("engine", "layer", "key", "sid")

    def __init__(self, layer: "LinFnLayer", key: Tuple[int, int],
                 sid: Optional[torch.Tensor]) -> None:
        self.engine, self.layer, self.key, self.sid = layer.engine, layer, key, sid

    def capture(self, inp: torch.Tensor, g: torch.Tensor, pass_id: int) -> None:
        self.layer.take(inp, g, self.key, self.sid, pass_id)


def _linear(x: torch.Tensor, w: torch.Tensor, layer: "LinFnLayer", key: Tuple[int, int],
            sid: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear(x, w) for one pair through _LinearFn; its output marked
    with its rows' samples (x's) for dpclip._rows."""
    y = _LinearFn.apply(x, w, None, _Pair(layer, key, sid))
    if sid is not None and y.grad_fn is not None:
        y.grad_fn.dpclip_sid = sid.cpu()
    return y


class Placement(NamedTuple):
    """Where a grouped product's first n rows go: row rows[r] (a device
    tensor) of one buffer of `total` rows that holds each expert k's
    [B, most[k]] block from row base[k], sample-major; and each expert's
    end row in the product (host lists)."""
    n: int
    total: int
    most: List[int]
    base: List[int]
    ends: List[int]
    rows: torch.Tensor


class GroupedLinFn(torch.autograd.Function):
    """A grouped product fn(x, w, offs=offs) (transformers 5's grouped_mm
    experts: rows sorted by expert, w the 3-D parameter transposed,
    [E, d, p]); backward captures the rows and their output gradients for
    the layer's experts and returns x's gradient only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, call: Any,
                layer: "LinFnLayer", i: int, sid: torch.Tensor) -> torch.Tensor:
        ctx.call, ctx.layer, ctx.i, ctx.sid = call, layer, i, sid
        ctx.placed = layer.placement(offs, sid, i)
        ctx.pass_id = layer.engine._pass  # pylint: disable=protected-access
        ctx.dpclip_sid = sid  # the output's rows are x's (dpclip._rows reads this)
        ctx.save_for_backward(x, w, offs)
        return call(x, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None,
                                                     None, None, None]:
        x, w, offs = ctx.saved_tensors
        ctx.layer.take_grouped(x, g, ctx.placed, ctx.i, ctx.sid, ctx.pass_id)
        gx = None
        if ctx.needs_input_grad[0]:
            # the same grouped product against the parameter's own layout [E, p, d]
            gx = ctx.call(g.to(w.dtype), w.transpose(-2, -1))
            if gx.dtype != x.dtype:
                gx = gx.to(x.dtype)
        return gx, None, None, None, None, None, None


def _grouped_fns() -> Tuple[Any, ...]:
    """torch's grouped products where it has them (2.8 and later), and
    transformers 5's fallback op: called as fn(x, w, offs=offs)."""
    fns = [f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
           if f is not None]
    try:
        fns.append(torch.ops.transformers.grouped_mm_fallback)
    except (AttributeError, RuntimeError):
        pass
    return tuple(fns)


def _tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


class _Uses(TorchFunctionMode):
    """The mode the module's forward runs under (see the module docstring)."""

    def __init__(self, layer: "LinFnLayer") -> None:
        super().__init__()
        self.layer = layer
        self.grouped = _grouped_fns()

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        layer = self.layer
        if func is F.linear:
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            key = layer.key_of(w)
            if key is not None:
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                if bias is not None:
                    raise layer.refusal("F.linear with a bias")
                x = args[0] if args else kwargs["input"]
                return _linear(x, w, layer, key, layer.samples(x))
        if func in self.grouped and len(args) >= 2:
            # fn(rows, weight, offs, [bias, out_dtype]), offs maybe by keyword
            x, w, rest = args[0], args[1], args[2:]
            i = layer.grouped_of(w)
            offs = rest[0] if rest else kwargs.get("offs")
            extra = list(rest[1:]) + [v for k, v in kwargs.items() if k != "offs"]
            if i is not None and isinstance(offs, torch.Tensor) and \
                    all(v is None for v in extra):
                def call(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                    return func(a, b, *rest, **kwargs)
                return GroupedLinFn.apply(x, w, offs, call, layer, i, layer.rows_of(x))
        name = getattr(func, "__name__", str(func))
        owned = any(layer.owns(t) for t in _tensors((args, kwargs)))
        if owned and name not in _READS:
            raise layer.refusal(name)
        out = func(*args, **kwargs)
        if owned and isinstance(out, torch.Tensor) and out.requires_grad and \
                not layer.owns(out):
            # a copy made of it (W[idx] with a tensor of indices: a bias
            # gathered per row), whose gradient no rule here forms
            raise layer.refusal("%s (a copy of them)" % name)
        return out


class LinFnLayer(_Layer):
    """A module's raw weights used through F.linear (the module docstring).
    Records are batch-first ([B, Tmax, d], [B, Tmax, p]), each input tagged
    with its (parameter, expert) pair as dpclip_key."""
    rowwise = False
    kind = "linear"

    def __init__(self, engine: Any, name: str, module: nn.Module,
                 own: List[Tuple[str, torch.Tensor]]) -> None:
        self.pnames = [pn for pn, _ in own]
        self.params = [p for _, p in own]
        super().__init__(engine, name, module, weight=self.params[0], bias=False)
        self.what = "raw weights used through F.linear (%s)" % ", ".join(self.pnames)
        self.hint = ("its forward uses them otherwise: freeze them, or hold them in "
                     "nn.Linear modules")
        fwd = type(module).forward
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        # transformers 5's experts: a config may pick a fused kernel
        # (grouped_mm), which calls no F.linear; the eager code it wraps does
        # (grouped_mm's products are captured as they are: GroupedLinFn)
        self._eager = getattr(fwd, "__wrapped__", fwd) \
            if impl not in (None, "eager", "grouped_mm") else None
        # the last grouped product's placement: (offs, sid, Placement)
        self._placed: Optional[Tuple[torch.Tensor, torch.Tensor, Placement]] = None
        # the first step's captures, for self_check
        self._probe: List[Tuple[Tuple[int, int], torch.Tensor, torch.Tensor,
                                Optional[torch.Tensor], torch.Tensor, torch.Tensor]] = []

    def _setup(self) -> None:
        self.d, self.p = self.params[0].shape[-1], self.params[0].shape[-2]

    def outputs(self) -> List[Tuple[torch.Tensor, Optional[Any]]]:
        return [(p, None) for p in self.params]

    def trains(self) -> bool:
        return any(p.requires_grad for p in self.params)

    def _forward(self, mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with _Uses(self):
            return self.reference(mod, *args, **kwargs)

    def reference(self, mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self._eager is not None:
            return self._eager(mod, *args, **kwargs)
        return self._orig_forward(*args, **kwargs)

    # --- what the mode asks ---

    def key_of(self, w: Any) -> Optional[Tuple[int, int]]:
        """(parameter index, expert) of a weight that is a trained parameter
        (expert 0) or one expert's view W[e] of a 3-D one, else None."""
        if not isinstance(w, torch.Tensor):
            return None
        for i, p in enumerate(self.params):
            if w is p and p.dim() == 2:
                return i, 0
            if p.dim() == 3 and w._base is p and tuple(w.shape) == tuple(p.shape[1:]) and \
                    tuple(w.stride()) == tuple(p.stride()[1:]):
                off = w.storage_offset() - p.storage_offset()
                if off % p.stride(0) == 0 and 0 <= off // p.stride(0) < p.shape[0]:
                    return i, off // p.stride(0)
        return None

    def grouped_of(self, w: Any) -> Optional[int]:
        """The index of the 3-D parameter w is the transpose of ([E, d, p]
        from [E, p, d]: a grouped product's weight), else None."""
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            return None
        for i, p in enumerate(self.params):
            if p.dim() == 3 and w._base is p and \
                    tuple(w.shape) == (p.shape[0], p.shape[2], p.shape[1]) and \
                    tuple(w.stride()) == (p.stride(0), p.stride(2), p.stride(1)) and \
                    w.storage_offset() == p.storage_offset():
                return i
        return None

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """The sample of each row of x [S, d], rows a grouped product takes
        (sorted by expert), or refuses."""
        sid = _rows.row_samples(x, _rows.pass_batch(self.engine)) if x.dim() == 2 else None
        if sid is None:
            raise self.refusal("a grouped product on rows %s whose samples dpclip cannot prove"
                               % (tuple(x.shape),))
        return sid

    def owns(self, t: torch.Tensor) -> bool:
        return any(t is p or t._base is p for p in self.params)

    def refusal(self, how: str) -> UnsupportedModuleError:
        return UnsupportedModuleError(
            "module %s uses its parameters (%s) through %s: dpclip trains raw weights a "
            "module passes to F.linear (whole, or one expert W[e] of a 3-D one) without a "
            "bias; %s" % (_label(self.name, self.module), ", ".join(self.pnames), how,
                          self.hint))

    def samples(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The sample of each row of x [N, d] (None: x is batch-first
        [B, T, d], or rows that are the batch), or refuses."""
        B = _rows.pass_batch(self.engine)
        if x.dim() >= 3:
            return None
        if x.dim() == 2 and x.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long)
        sid = _rows.row_samples(x, B) if x.dim() == 2 else None
        if sid is not None and _rows.is_batch(sid, B):
            return None
        if sid is None and x.dim() == 2 and B is not None and x.shape[0] == B:
            return None  # unproved [B, d]: batch-first, as for every module
        if sid is None:
            raise self.refusal("F.linear on rows %s whose samples dpclip cannot prove (a "
                               "reshape of batch-first hidden states, rows picked by one "
                               "index, elementwise functions of such)" % (tuple(x.shape),))
        return sid

    # --- what backward captures, and what a step sends ---

    def take(self, x: torch.Tensor, g: torch.Tensor, key: Tuple[int, int],
             sid: Optional[torch.Tensor], pass_id: int) -> None:
        x, g = x.detach(), g.detach()
        if sid is None:
            xb = x.reshape(x.shape[0], -1, x.shape[-1])
            gb = g.reshape(g.shape[0], -1, g.shape[-1])
        else:
            B = _rows.pass_batch(self.engine) or 1
            xb, at = _rows.to_batch(x, sid, B)
            if at is None:
                gb = g.reshape(B, -1, g.shape[-1])
            else:
                gb = g.new_zeros((B, xb.shape[1], g.shape[-1])).index_put(at, g)
        xb.dpclip_key = key  # type: ignore[attr-defined]
        if self.verify is not None and len(self._probe) < _PROBE_RECORDS:
            self._probe.append((key, x, g, sid, xb, gb))
        self.record(xb, gb, pass_id)

    def placement(self, offs: torch.Tensor, sid: torch.Tensor, i: int) -> Placement:
        """Where a grouped product's rows go for the step, computed at the
        forward, on the host, from its sample map and the groups' ends
        (one read from the device, which the forward's proof of the rows
        has just waited for anyway); the backward then only scatters. The
        next product on the same rows and groups (the down projection)
        reuses it."""
        if self._placed is not None and self._placed[0] is offs and self._placed[1] is sid:
            return self._placed[2]
        E, B = self.params[i].shape[0], _rows.pass_batch(self.engine) or 1
        ends = offs.long().cpu()
        n = int(ends[-1]) if ends.numel() else 0  # rows past the last group: none's
        r = torch.arange(n)
        e = torch.searchsorted(ends, r, right=True)
        s = sid[:n]
        counts, pos = _rows.ranks(e * B + s, E * B)
        # each expert padded to its own most rows a sample (an expert
        # with none: no block), its block [B, most_k] from row base_k
        most = counts.view(E, B).max(1).values
        base = torch.cumsum(B * most, 0) - B * most
        rows = base[e] + s * most[e] + pos
        placed = Placement(n, int((B * most).sum()), most.tolist(), base.tolist(),
                           ends.tolist(), rows.to(offs.device))
        self._placed = (offs, sid, placed)
        return placed

    def take_grouped(self, x: torch.Tensor, g: torch.Tensor, at: Placement, i: int,
                     sid: torch.Tensor, pass_id: int) -> None:
        """A grouped product's capture: rows [S, d] sorted by expert, placed
        per expert and sample in [B, Tmax_k, d] blocks of one buffer (zeros
        elsewhere) as the forward planned: one scatter each for the rows
        and their gradients."""
        x, g = x.detach(), g.detach()
        E = self.params[i].shape[0]
        B = _rows.pass_batch(self.engine) or 1
        bx = x.new_zeros((at.total, x.shape[1])).index_copy_(0, at.rows, x[:at.n])
        bg = g.new_zeros((at.total, g.shape[1])).index_copy_(0, at.rows, g[:at.n])
        for k in range(E):
            if not at.most[k]:
                continue  # no row: the step sends this expert zeros
            lo, hi = at.base[k], at.base[k] + B * at.most[k]
            xb = bx[lo:hi].view(B, at.most[k], x.shape[1])
            gb = bg[lo:hi].view(B, at.most[k], g.shape[1])
            xb.dpclip_key = (i, k)  # type: ignore[attr-defined]
            if self.verify is not None and len(self._probe) < _PROBE_RECORDS:
                a, z = at.ends[k - 1] if k else 0, at.ends[k]
                self._probe.append(((i, k), x[a:z], g[a:z], sid[a:z], xb, gb))
            self.record(xb, gb, pass_id)

    def self_check(self, tol: float) -> None:
        """The first step's check (dpclip._verify.check_step calls it): for
        the first samples, the per-sample gradient each pair's step tensors
        give (rows placed per sample, zero-padded) against autograd's
        through F.linear on that sample's own rows, in f64. Rather than
        against the module's whole forward, as other layers are checked:
        that forward is the module's own code with only F.linear replaced
        by the same product, every other autograd path to the parameters
        leaves them a gradient the step refuses, and under bf16 a
        router's top-k can pick other experts in f64 than it did (near
        ties), which would refuse an exact layer."""
        if not self._probe:  # not called yet: checked at a later step
            return
        for key, x, g, sid, xb, gb in self._probe:
            for b in range(min(xb.shape[0], _PROBE_SAMPLES)):
                rows = slice(b, b + 1) if sid is None else (sid == b).to(x.device)
                xr = x[rows].double().reshape(-1, x.shape[-1])
                gr = g[rows].double().reshape(-1, g.shape[-1])
                w = torch.zeros((g.shape[-1], x.shape[-1]), dtype=torch.float64,
                                device=x.device, requires_grad=True)
                (want,) = torch.autograd.grad(F.linear(xr, w), w, gr, allow_unused=True)
                want = want if want is not None else torch.zeros_like(w)
                got = torch.einsum("tp,td->pd", gb[b].double(), xb[b].double())
                err = float((got - want).norm())
                if not err <= tol * max(float(want.norm()), 1e-30):
                    raise UnsupportedModuleError(
                        "first-step check: module %s (trained as %s), %s expert %d: its "
                        "per-sample gradient differs from autograd's through F.linear on "
                        "sample %d's rows by %.3g: the rows were placed for the wrong samples, "
                        "a bug in dpclip (please report it). Nothing was sent or updated"
                        % (_label(self.name, self.module), self.what, self.pnames[key[0]],
                           key[1], b, err))
        self._probe = []
        self.verify = None

    def parts(self, B: int, nb: int) -> List[Part]:
        out = []
        for i, (p, o) in enumerate(zip(self.params, self.outs)):
            rows, d = p.shape[-2], p.shape[-1]
            experts = p.shape[0] if p.dim() == 3 else 1
            for e in range(experts):
                recs = [(x, g) for x, g, _ in self.records
                        if getattr(x, "dpclip_key", None) == (i, e)] if B else []
                inp = torch.cat([x for x, _ in recs], 1) if recs else None
                g = torch.cat([g for _, g in recs], 1) if recs else None
                T = inp.shape[1] if inp is not None else 1
                name = "%s.%s" % (self.name, self.pnames[i])
                if experts > 1:
                    name += "[%d]" % e
                out.append(_part(self, "linear", name, inp, g, (nb, T, d), (nb, T, rows),
                                 (o, e * rows * d, (rows, d)), None, False))
        return out


def _calls_linear(m: nn.Module) -> bool:
    fwd = type(m).forward
    try:
        src = inspect.getsource(getattr(fwd, "__wrapped__", fwd))
    except (OSError, TypeError):
        return False
    return re.search(r"linear\(|grouped\w*\(|grouped_mm", src) is not None


def layers_for(engine: Any, name: str, m: nn.Module,
               own: List[Tuple[str, torch.Tensor]]) -> Optional[List[_Layer]]:
    """A layer for an otherwise unsupported module whose trainable
    parameters (own) are all 2-D or 3-D and whose forward calls linear(,
    else None."""
    cls = type(m)
    if not own or cls.__module__.startswith("torch.") or \
            not all(p.dim() in (2, 3) for _, p in own) or not _calls_linear(m):
        return None
    return [LinFnLayer(engine, name, m, own)]
