"""The first-step check: every module dpclip trains computes what it
computed before, and its per-sample gradient rule matches autograd's, or
the engine refuses to train it, naming the module and the parameter
(issue 38: a subclass of nn.Embedding that scaled its output was trained
as a plain one, its per-sample norms 30% low).

Once per layer, on a small slice of the batch (the first K samples), in
float64 on the layer's device, with autocast off, against the module's
own code run on float64 copies of its parameters and buffers (the engine
in reference mode: no layer of dpclip active, a subclass's super().forward
the torch class's own):

(a) forward: at the layer's first training forward, its output (dpclip's
    replacement, or for a subclass its own code around dpclip's base
    forward) against the module's own forward on the same inputs;
    UnsupportedModuleError on a difference beyond the tolerance, before
    the output is used.
(b) gradient: at the first step that captured the layer, before anything
    is sent to the daemon, each trained parameter's per-sample gradient by
    dpclip's rule (what the daemon computes from the parts the step sends:
    g^T a for a linear part, the index scatter of g for an embedding, the
    normalized input times g for a norm, the trainer's own for per-sample
    parts), against autograd's vector-Jacobian product through the
    module's own code with the output gradient the module received, for
    each sample alone. UnsupportedModuleError naming module, parameter and
    sample on a difference beyond the tolerance: nothing is sent, no
    parameter updated.
(c) replaced: a DPMultiheadAttention that replace_mha swapped in for an
    nn.MultiheadAttention, at its first training forward, against that
    module on the same inputs (both in eval mode and float64, 1e-6).

Tolerances, relative: (a) 1e-4 of the output's largest magnitude where
every tensor in play is f32 or f64 (1e-2 for f32 products on a GPU that
allows TF32), 2e-2 with bf16 or f16; (b) 1e-4 (f32 and f64; 5e-3 on a GPU
that allows TF32) or 3e-2 (bf16, f16) of the parameter's per-sample
gradient norm, floored at 1e-2 of the layer's whole per-sample norm (a
gradient that is zero in exact arithmetic compares at the layer's
scale). PrivacyEngine.make_private(...,
check_first_step=False) turns the check off."""
import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ._layers import UnsupportedModuleError, _autocast_dtype, _label

__all__ = ["install", "Probe", "check_step", "K"]

K = 2  # samples checked


# --- tolerances -------------------------------------------------------------------------

def _low(dts: Sequence[torch.dtype]) -> bool:
    return any(dt in (torch.bfloat16, torch.float16) for dt in dts)


def _forward_tol(dts: Sequence[torch.dtype], device: torch.device) -> float:
    if _low(dts):
        return 2e-2
    return 1e-2 if _tf32(device) else 1e-4


def _tf32(device: torch.device) -> bool:
    return device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or
                                      torch.backends.cudnn.allow_tf32)


def _grad_tol(dts: Sequence[torch.dtype], device: torch.device) -> float:
    # (TF32: the trainer's own per-sample gradients, grouped convolutions')
    return 3e-2 if _low(dts) else 5e-3 if _tf32(device) else 1e-4


# --- helpers ----------------------------------------------------------------------------

def _map(obj: Any, fn: Any) -> Any:
    """fn applied to every tensor in obj (tuples, lists, dicts walked)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> List[Optional[torch.Tensor]]:
    """The tensors of an output (a tensor, or a tuple or list of them and
    Nones), in order; raises for outputs of other kinds."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor)
                                              for o in obj):
        return list(obj)
    raise TypeError(type(obj).__name__)


def _f64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.double() if t.is_floating_point() else t


def _rows(t: torch.Tensor, lo: int, hi: int, B: int) -> torch.Tensor:
    """Samples [lo, hi) of a batch-first tensor of B samples; a tensor with
    another leading size (shared by the batch, as positions [1, T]) whole."""
    return t[lo:hi] if t.dim() > 0 and t.shape[0] == B else t


class _Rows:
    """The first K samples of a batch-first input, kept (copied) for the
    step's check; the rest of the batch is not held. sid: flattened tokens'
    (dpclip._rows), the sample of each row kept; None: row b is sample b."""
    __slots__ = ("t", "sid")

    def __init__(self, t: torch.Tensor, sid: Optional[torch.Tensor]) -> None:
        self.t = t
        self.sid = sid


def _first(t: torch.Tensor, sid: Optional[torch.Tensor]) -> torch.Tensor:
    """The rows of the first K samples of t (row b sample b, or sid's)."""
    if sid is None:
        return t[:K].clone() if t.shape[0] > K else t
    return t[(sid < K).to(t.device)].clone()


def _keep(obj: Any, n0: int, sid: Optional[torch.Tensor] = None) -> Any:
    """obj's tensors detached, those with n0 rows cut to the first K
    samples'."""
    kept = sid[sid < K] if sid is not None else None

    def one(t: torch.Tensor) -> Any:
        t = t.detach()
        return _Rows(_first(t, sid), kept) if n0 and t.dim() > 0 and t.shape[0] == n0 else t
    return _map(obj, one)


def _sample(obj: Any, b: int) -> Any:
    """What _keep kept, with sample b alone of the cut tensors."""
    if isinstance(obj, _Rows):
        return obj.t[b:b + 1] if obj.sid is None else obj.t[(obj.sid == b).to(obj.t.device)]
    if isinstance(obj, (tuple, list)):
        return type(obj)(_sample(o, b) for o in obj)
    if isinstance(obj, dict):
        return {k: _sample(v, b) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def reference_mode(engine: Any, *modules: nn.Module) -> Iterator[Dict[int, torch.Tensor]]:
    """The modules' parameters and floating buffers (their submodules' too)
    replaced by float64 copies (one per parameter object), the engine in
    reference mode (no layer of dpclip active) and autocast off; yields
    id(original parameter) -> its copy. Everything is put back on exit."""
    saved, copies = [], {}
    subs = {id(s): s for m in modules for s in m.modules()}  # a shared submodule once
    for sm in subs.values():
        for n, p in list(sm._parameters.items()):  # pylint: disable=protected-access
            if p is None:
                continue
            c = copies.get(id(p))
            if c is None:
                c = copies[id(p)] = nn.Parameter(_f64(p).clone(), requires_grad=p.requires_grad)
            saved.append((sm._parameters, n, p))  # pylint: disable=protected-access
            sm._parameters[n] = c  # pylint: disable=protected-access
        for n, b in list(sm._buffers.items()):  # pylint: disable=protected-access
            if b is not None and b.is_floating_point():
                saved.append((sm._buffers, n, b))  # pylint: disable=protected-access
                sm._buffers[n] = _f64(b).clone()  # pylint: disable=protected-access
    was = getattr(engine, "_reference", False)
    engine._reference = True
    dev = next((p.device.type for p in copies.values()), "cpu")
    try:
        with torch.autocast(device_type=dev, enabled=False):
            yield copies
    finally:
        engine._reference = was
        for where, n, t in reversed(saved):
            where[n] = t


# --- the probe on each layer ------------------------------------------------------------

class _Use:
    """One call of a layer's module in a pass: its inputs and the output
    gradients it received (hooks), of its first K samples where they are
    batch-first (n0: the output's leading size, the batch's)."""
    __slots__ = ("layer", "pass_id", "args", "kwargs", "n0", "sid", "grads")

    def __init__(self, layer: Any, pass_id: int, args: Any, kwargs: Any, n0: int,
                 sid: Optional[torch.Tensor], n: int) -> None:
        self.layer = layer  # whose module was called
        self.pass_id = pass_id
        self.args, self.kwargs = args, kwargs
        self.n0 = n0
        self.sid = sid  # flattened tokens: the sample of each row (dpclip._rows); else None
        self.grads: List[Optional[torch.Tensor]] = [None] * n


class Probe:
    """A layer's first-step check (its _Layer.verify): called after each
    training forward with (layer, args, kwargs, output) until the layer
    has been checked at a step."""

    def __init__(self) -> None:
        self.forward_done = False
        self.uses: List[_Use] = []

    def __call__(self, layer: Any, args: tuple, kwargs: dict, y: Any) -> Any:
        """Returns the output for the caller: y, or where the module returns
        several tensors (a tuple or list), one made of views of them, so
        that the hooks see only the gradient reaching each from outside
        the module. A hook on the tensor itself would also see what flows
        into it from another output made of it (a router returns its
        logits and the top-k softmax of them): the reference would count
        that twice."""
        if hasattr(layer, "self_check"):  # checks its own rule at the step (_tablerows)
            return y
        try:
            outs = _tensors(y)
        except TypeError as e:
            raise UnsupportedModuleError(
                "module %s returns a %s, which dpclip's first-step check cannot compare "
                "(a tensor, or a tuple of tensors): make_private(..., check_first_step=False) "
                "trains it unchecked" % (_label(layer.name, layer.module), e)) from None
        if not self.forward_done:
            self.forward_done = _check_forward(layer, args, kwargs, outs)
        pass_id = layer.engine._pass  # pylint: disable=protected-access
        # a pass sent already (or before the step) is done with; one whose
        # backward is still to come (gradient accumulation: GPipe's, 1F1B's)
        # is checked when its micro-batch is sent
        done = layer.engine._acc.done()  # pylint: disable=protected-access
        self.uses = [u for u in self.uses if u.pass_id == pass_id or u.pass_id > done]
        if len(outs) > 1 and type(y) in (tuple, list):
            outs = [o.view_as(o) if o is not None and o.requires_grad else o for o in outs]
            y = type(y)(outs)
        n0 = next((o.shape[0] for o in outs if o is not None and o.dim() > 0), 0)
        sid = layer.sid
        use = _Use(layer, pass_id, _keep(args, n0, sid), _keep(kwargs, n0, sid), n0, sid,
                   len(outs))
        for i, o in enumerate(outs):
            if o is not None and o.requires_grad:
                o.register_hook(_grad_keeper(use, i))
        self.uses.append(use)
        return y


def _grad_keeper(use: _Use, i: int) -> Any:
    def keep(g: torch.Tensor) -> None:
        g = g.detach()
        use.grads[i] = _first(g, use.sid) if g.dim() > 0 and g.shape[0] == use.n0 else g
    return keep


def _own(layer: Any, args: Any, kwargs: Any) -> List[Optional[torch.Tensor]]:
    """The module's own output (its tensors) on args, in reference mode
    (the caller holds it)."""
    return _tensors(layer.reference(layer.module, *_map(args, _f64), **_map(kwargs, _f64)))


def _check_forward(layer: Any, args: tuple, kwargs: dict, outs: List[Any]) -> bool:
    """(a): the layer's output on its first K samples against the module's
    own forward in f64. False where a value is not finite (the data's, for
    the daemon to refuse): checked at a later forward."""
    n0 = next((o.shape[0] for o in outs if o is not None and o.dim() > 0), 0)
    k = min(K, n0) if n0 else 0
    sl = _map((args, kwargs), lambda t: _rows(t, 0, k, n0) if n0 else t)
    with torch.no_grad(), reference_mode(layer.engine, layer.module):
        want = _own(layer, *sl)
    label = _label(layer.name, layer.module)
    what = layer.what or "dpclip's %s layer" % layer.kind
    if len(want) != len(outs):
        raise UnsupportedModuleError(
            "module %s is trained as %s, but its own forward returns %d tensors where dpclip's "
            "gives %d: %s" % (label, what, len(want), len(outs), layer.hint))
    for got, ref in zip(outs, want):
        if got is None or ref is None:
            if (got is None) != (ref is None):
                raise UnsupportedModuleError(
                    "module %s is trained as %s, but its own forward returns %s where dpclip's "
                    "gives %s: %s" % (label, what, type(ref).__name__, type(got).__name__,
                                      layer.hint))
            continue
        m = ref.shape[0] if ref.dim() > 0 else 0
        g = got[:m] if m else got
        if g.shape != ref.shape:
            raise UnsupportedModuleError(
                "module %s is trained as %s, but its own forward returns shape %s where %s "
                "gives shape %s: %s" % (label, what, tuple(ref.shape), what,
                                        tuple(got.shape), layer.hint))
        if not ref.is_floating_point():
            if not torch.equal(g, ref):
                raise UnsupportedModuleError(
                    "module %s is trained as %s, but its own forward computes something else: "
                    "%s" % (label, what, layer.hint))
            continue
        if not (bool(torch.isfinite(ref).all()) and bool(torch.isfinite(g).all())):
            return False
        scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1e-12)
        err = float((g.detach().double() - ref).abs().max()) / scale if ref.numel() else 0.0
        dts = [got.dtype] + [t.dtype for t in _flat(args) if t.is_floating_point()] + \
            [p.dtype for p in layer.module.parameters()]
        # products inside the module ran in autocast's dtype (a bf16 patch
        # convolution whose output a float parameter promotes back)
        dts += [dt for dt in [_autocast_dtype(got.device.type)] if dt is not None]
        tol = _forward_tol(dts, got.device)
        if not err <= tol:
            raise UnsupportedModuleError(
                "module %s is trained as %s, but its own forward computes something else (the "
                "outputs differ by %.3g of their largest magnitude on its first forward, "
                "tolerance %g): %s" % (label, what, err, tol, layer.hint))
    return True


def _flat(obj: Any) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    _map(obj, out.append)
    return out


# --- the step's check ---------------------------------------------------------------------

def _rule(pt: Any, k: int) -> List[torch.Tensor]:
    """dpclip's per-sample gradients of one part for its first k samples,
    in f64: [weight [k, *w shape]] (+ [bias [k, p or d]]), as the daemon
    forms them from the tensors the step sends."""
    l = pt.layer
    if pt.inp is None:
        return []
    a = pt.inp[:k].reshape((k,) + tuple(pt.in_shape[1:]))
    g = pt.grad[:k].reshape((k,) + tuple(pt.grad_shape[1:])).double()
    if pt.kind == "linear":
        a = a.double()
        out = [torch.einsum("btp,btd->bpd", g, a)]
        return out + ([g.sum(1)] if pt.has_bias else [])
    if pt.kind == "embedding":
        w = torch.zeros((k, l.vocab, g.shape[-1]), dtype=torch.float64, device=g.device)
        w.scatter_add_(1, a.long().unsqueeze(-1).expand_as(g), g)
        if l.padding_idx is not None:
            w[:, l.padding_idx] = 0
        return [w]
    x = a.double()
    eps = l.eps_used if l.eps_used is not None else l.eps_for(torch.empty(0))
    if pt.kind == "layernorm":
        mu = x.mean(-1, keepdim=True)
        xh = (x - mu) * torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps)
    else:
        xh = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return [(g * xh).sum(1)] + ([g.sum(1)] if pt.has_bias else [])


def _dpclip_grads(layer: Any, parts: Sequence[Any], k: int) -> Dict[int, torch.Tensor]:
    """id(Out) -> [k, numel] f64: the layer's parts' per-sample gradients,
    laid out as the daemon writes them (a tied part into its partner's
    weight output)."""
    flat: Dict[int, torch.Tensor] = {}
    for pt in parts:
        if pt.layer is not layer:
            continue
        got = _rule(pt, k)
        w = pt.w if pt.w is not None or not pt.tied_to else parts[pt.tied_to - 1].w
        for sl, v in zip((w, pt.b), got):
            if sl is None:
                continue
            o, elem, shape = sl
            buf = flat.get(id(o))
            if buf is None:
                buf = flat[id(o)] = torch.zeros((k, o.numel), dtype=torch.float64,
                                                device=v.device)
            n = 1
            for s in shape:
                n *= s
            buf[:, elem:elem + n] += v.reshape(k, n)
    return flat


def _reference_grads(layer: Any, uses: Sequence[_Use], k: int, B: int,
                     params: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    """[sample][param]: autograd's per-sample gradient of each of params
    through the module's own code, for each of the first k samples alone,
    summed over the module's uses in the pass."""
    out = [[torch.zeros(p.shape, dtype=torch.float64, device=p.device) for p in params]
           for _ in range(k)]
    mods = [layer.module] + [l.module for l in layer.merged]
    with torch.enable_grad(), reference_mode(layer.engine, *mods) as copies:
        ps = [copies[id(p)] for p in params]
        for u in uses:
            for b in range(k):
                outs = _own(u.layer, _sample(u.args, b), _sample(u.kwargs, b))
                ys, gs = [], []
                for y, g in zip(outs, u.grads):
                    if y is None or g is None or not y.requires_grad:
                        continue
                    if u.sid is not None:  # flattened tokens: sample b's rows
                        kept = u.sid[u.sid < K]
                        g = g[(kept == b).to(g.device)]
                    else:
                        if y.dim() > 0 and y.shape[0] == B and B > 1:
                            y = y[b:b + 1]  # nothing was sliced on the way in
                        g = g[b:b + 1] if u.n0 == B and g.dim() > 0 else g
                    ys.append(y)
                    gs.append(g.double().reshape(y.shape))
                if not ys:
                    continue
                vjp = torch.autograd.grad(ys, ps, gs, allow_unused=True)
                for i, v in enumerate(vjp):
                    if v is not None:
                        out[b][i] += v
    return out


def check_step(engine: Any, plan: Any, B: int) -> None:
    """(b) for every layer captured in this step whose probe is pending;
    each checked layer's probe is removed (checked once)."""
    if B <= 0:
        return
    k = min(K, B)
    pass_ids = {pid for l in engine._layers for _, _, pid in l.records}  # pylint: disable=W0212
    pass_ids = pass_ids or {engine._pass}  # pylint: disable=protected-access
    for layer in engine._layers:  # pylint: disable=protected-access
        probe = layer.verify
        if not isinstance(probe, Probe):
            continue
        if hasattr(layer, "self_check"):  # a layer that checks its own rule (dpclip._relbias)
            layer.self_check(1e-6)
            continue
        if layer.merged_into is not None:  # checked with the layer it is merged into
            continue
        # (a module called whose layer captured nothing: its rule gives zero)
        uses = [u for l in [layer] + layer.merged if isinstance(l.verify, Probe)
                for u in l.verify.uses if u.pass_id in pass_ids]
        if not layer.records and not any(g is not None for u in uses for g in u.grads):
            continue
        outs = layer.outs
        params = [o.param for o in outs]
        got = _dpclip_grads(layer, plan.parts, k)
        want = _reference_grads(layer, uses, k, B, params)
        if not all(bool(torch.isfinite(t).all()) for t in list(got.values()) +
                   [w for ws in want for w in ws]):
            continue  # the data's (the daemon refuses the step): checked at a later step
        dts = [pt.in_dtype for pt in plan.parts if pt.layer is layer] + \
            [pt.grad_dtype for pt in plan.parts if pt.layer is layer] + \
            [p.dtype for p in params]
        tol = _grad_tol(dts, params[0].device if params else torch.device("cpu"))
        for b in range(k):
            whole = sum(float(w.pow(2).sum()) for w in want[b]) ** 0.5
            for o, p, w in zip(outs, params, want[b]):
                flat = got.get(id(o))
                g = o.grad(flat[b]) if flat is not None else torch.zeros_like(w)
                err = float((g - w).norm())
                scale = max(float(w.norm()), 1e-2 * whole, 1e-30)
                if not err <= tol * scale:
                    raise UnsupportedModuleError(
                        "first-step check: module %s (trained as %s), parameter %s: dpclip's "
                        "per-sample gradient differs from autograd's through the module's own "
                        "forward by %.3g of its norm (tolerance %g) for sample %d of the batch "
                        "(norms %.6g and %.6g): %s. Nothing was sent or updated"
                        % (_label(layer.name, layer.module),
                           layer.what or "dpclip's %s layer" % layer.kind,
                           _param_name(engine, p), err / scale, tol, b, float(g.norm()),
                           float(w.norm()), layer.hint))
        for l in [layer] + layer.merged:
            if layer.records:  # checked: once
                l.verify = None
            elif isinstance(l.verify, Probe):
                l.verify.uses = [u for u in l.verify.uses if u.pass_id not in pass_ids]


# (sample b's cotangent of the output, the table rows read, their gradients [n, d])
RowsRule = Callable[[int, torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def check_table_rule(layer: Any, module: nn.Module, forward: Callable[..., Any], args: tuple,
                     kwargs: dict, k: int, per_sample: RowsRule, through: str,
                     tol: float) -> None:
    """The first-step check of a layer that sends a table's per-sample
    gradient as the scatter of output gradients to the rows read
    (dpclip._relbias, _tablerows: they check their own rule, check_step
    calls their self_check): the rule against autograd's through `forward`
    (the module's own code, in reference mode with float64 copies of
    module's parameters) for samples 0..k-1, per_sample(b, out) giving each
    sample's cotangent, rows and gradients. UnsupportedModuleError naming
    the layer; its probe cleared when the rule holds."""
    w = layer.module.weight
    with torch.enable_grad(), reference_mode(layer.engine, module) as copies:
        w64 = copies[id(w)]
        out = forward(*args, **kwargs)
        for b in range(k):
            cot, rows, g = per_sample(b, out)
            (want,) = torch.autograd.grad(out, w64, cot, retain_graph=True)
            got = torch.zeros_like(want).index_add_(0, rows, g.reshape(-1, want.shape[1]))
            scale = max(float(want.norm()), 1e-30)
            err = float((got - want).norm())
            if not err <= tol * scale:
                raise UnsupportedModuleError(
                    "first-step check: module %s (trained as %s): its per-sample gradient "
                    "differs from autograd's through %s by %.3g of its norm for sample %d: %s. "
                    "Nothing was sent or updated"
                    % (_label(layer.name, module), layer.what, through, err / scale, b,
                       layer.hint))
    layer.verify = None


def _param_name(engine: Any, p: torch.Tensor) -> str:
    from ._guard import param_names  # noqa: E402
    return param_names(engine.module).get(id(p), "of shape %s" % (tuple(p.shape),))


# --- set up, and the attention drop-in against what it replaced -------------------------

def install(engine: Any, module: nn.Module, layers: Sequence[Any]) -> None:
    """A Probe on every layer, and on every DPMultiheadAttention that
    replaced an nn.MultiheadAttention (replace_mha) the check of its
    function against that module's."""
    from ._mha import DPMultiheadAttention  # noqa: E402 (it imports _layers)
    for l in layers:
        l.verify = Probe()
    for name, m in module.named_modules():
        if isinstance(m, DPMultiheadAttention) and m._dp[5] is not None:  # pylint: disable=W0212
            m._dp[6] = _mha_check(engine, name)  # pylint: disable=protected-access


def _mha_check(engine: Any, name: str) -> Any:
    """At the drop-in's first training forward: its outputs and those of
    the nn.MultiheadAttention it replaced on the same inputs, both in eval
    mode (no dropout) and float64; UnsupportedModuleError on a difference."""

    def check(dp: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if not (engine.active and torch.is_grad_enabled()) or \
                engine._reference:  # pylint: disable=protected-access
            return
        slots = dp._dp  # pylint: disable=protected-access
        slots[6] = None
        orig = slots[5]
        for n, p in dp._parameters.items():  # the same objects, whatever moved them since
            orig._parameters[n] = p  # pylint: disable=protected-access
        orig.out_proj = dp.out_proj
        modes = [(m, m.training) for m in list(dp.modules()) + list(orig.modules())]
        dp.eval()
        orig.eval()
        try:
            # grad on: torch's fast path (no grad) takes no float64
            with torch.enable_grad(), reference_mode(engine, dp, orig):
                a, kw = _map(args, _f64), _map(kwargs, _f64)
                want, got = orig(*a, **kw), dp(*a, **kw)
        finally:
            for m, t in modes:
                m.training = t
        for g, w in zip(got, want):
            if g is None or w is None:
                if (g is None) != (w is None):
                    break
                continue
            scale = max(float(w.abs().max()) if w.numel() else 0.0, 1e-12)
            if g.shape != w.shape or not float((g - w).abs().max()) <= 1e-6 * scale:
                break
        else:
            return
        raise UnsupportedModuleError(
            "module %s (DPMultiheadAttention) replaced an nn.MultiheadAttention but computes "
            "something else on its first forward (float64, eval mode): leave replace_mha off "
            "and freeze the attention, or report this bug in dpclip" % (name or "<root>"))
    return check
