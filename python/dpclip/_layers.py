"""The per-module half of the PyTorch integration: autograd Functions that
compute only input gradients and capture what the daemon needs, the record
of one supported module (a _Layer, which sends the daemon one or more
layers: its parts), and the walk of the module tree done at attach time.

Which modules are supported, and as what, is dpclip._registry's; the
convolutions and GroupNorm are dpclip._conv's, the attention drop-in
dpclip._mha's."""
import types
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _lib, _rows


__all__ = ["UnsupportedModuleError"]

_RMSNorm = getattr(nn, "RMSNorm", None)
_ALIGN = 64
_DTYPES = {torch.float32: _lib.F32, torch.bfloat16: _lib.BF16, torch.float16: _lib.F16,
           torch.int32: _lib.I32, torch.int64: _lib.I64}
_FLOAT_WIRE = (torch.float32, torch.bfloat16, torch.float16)
_ESIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.int32: 4, torch.int64: 8}


class UnsupportedModuleError(ValueError):
    """A module dpclip cannot train privately: a trainable parameter in a
    module the daemon cannot clip, or a module that mixes samples."""


# --- autocast helpers (torch 1.13 and 2.x spell these differently) ---------------

def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype in force for device_type, or None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    except (TypeError, AttributeError):
        if device_type == "cuda":
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return None


def _low_precision(t: torch.Tensor) -> bool:
    return t.dtype in (torch.bfloat16, torch.float16)


def _norm_input(x: torch.Tensor) -> torch.Tensor:
    """x as autocast normalizes it: in f32 where x is 16-bit under autocast."""
    return x.float() if (_low_precision(x) and _autocast_dtype(x.device.type) is not None) else x


def _cast(t: Optional[torch.Tensor], dt: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """t in dtype dt (None: as it is); a no-op costs no host time."""
    return t if t is None or dt is None or t.dtype == dt else t.to(dt)


# --- the autograd Functions ---------------------------------------------------------
# Each forward reproduces the module's forward (with the casts autocast would
# make, done explicitly so that the tensor kept for the daemon is the one the
# product used); each backward records (input, output grad) for the layer and
# returns the input gradient only. None for the parameters: autograd then
# neither computes nor accumulates their gradients.

# What a backward returns: the input gradient (None where none is needed),
# then None for the weight, the bias and the layer.
InputGrad = Tuple[Optional[torch.Tensor], None, None, None]


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                layer: "_Layer") -> torch.Tensor:
        # Casts only where the dtype differs: each .to() is a few
        # microseconds of host time even when it returns its input, and a
        # trainer's step is often bound by the host.
        dt = _autocast_dtype(x.device.type) if x.is_floating_point() else None
        xc, wc, bc = _cast(x, dt), _cast(weight, dt), _cast(bias, dt)
        ctx.layer = layer
        ctx.pass_id = layer.engine._pass
        ctx.x_dtype = x.dtype
        # the weight as the product used it (autocast's linear saves its cast
        # weight too), so backward does not cast it again
        ctx.save_for_backward(xc, wc)
        return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> InputGrad:
        xc, wc = ctx.saved_tensors
        ctx.layer.capture(xc, g, ctx.pass_id)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.matmul(g, wc if wc.dtype == g.dtype else wc.to(g.dtype))
            if gx.dtype != ctx.x_dtype:
                gx = gx.to(ctx.x_dtype)
        return gx, None, None, None


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, idx: torch.Tensor, weight: torch.Tensor, layer: "_EmbeddingLayer",
                batch: int) -> torch.Tensor:
        ctx.layer = layer
        ctx.pass_id = layer.engine._pass
        ctx.batch = batch
        ctx.save_for_backward(idx)
        y = F.embedding(idx, weight, layer.padding_idx)
        # Indices shared by the batch (positions [1, T]): the output is
        # expanded to the batch here, so that each sample's output gradient
        # reaches backward instead of their sum (a broadcast add downstream
        # would sum them).
        return y.expand((batch,) + tuple(y.shape[1:])).contiguous() if batch else y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Tuple[None, None, None, None]:
        (idx,) = ctx.saved_tensors
        if ctx.batch:
            idx = idx.expand((ctx.batch,) + tuple(idx.shape[1:]))
        ctx.layer.capture(idx, g, ctx.pass_id)
        return None, None, None, None


def _rms(x: torch.Tensor, d: int, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as Hugging Face's RMSNorms compute it: in f32,
    normalized in the input dtype, then times the weight."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y * weight if weight is not None else y


def _norm_apply(layer: "_NormLayer", x: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    if layer.kind == "layernorm":
        return F.layer_norm(x, (layer.d,), weight, bias, eps)
    if layer.offset:  # Gemma's (1 + weight)
        weight = weight + layer.offset
    if layer.hf_style or not hasattr(F, "rms_norm"):
        return _rms(x, layer.d, weight, eps)
    return F.rms_norm(x, (layer.d,), weight, eps)


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], layer: "_NormLayer") -> torch.Tensor:
        # Autocast runs norms in f32; do the same cast here so that the input
        # the daemon normalizes is the one the forward normalized.
        xc = _norm_input(x)
        eps = layer.eps_used = layer.eps_for(xc)
        ctx.layer = layer
        ctx.pass_id = layer.engine._pass
        ctx.x_dtype = x.dtype
        if layer.kind == "layernorm":
            # ATen's own forward keeps the statistics its backward needs, so
            # the input gradient is one fused kernel (no recomputation)
            y, mean, rstd = torch.ops.aten.native_layer_norm(xc, [layer.d], weight, bias, eps)
            ctx.save_for_backward(xc, weight, bias, mean, rstd)
            return y
        ctx.save_for_backward(xc, weight, bias)
        return _norm_apply(layer, xc, weight, bias, eps)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> InputGrad:
        xc, weight, bias = ctx.saved_tensors[:3]
        ctx.layer.capture(xc, g, ctx.pass_id)
        gx = None
        if ctx.needs_input_grad[0] and ctx.layer.kind == "layernorm":
            mean, rstd = ctx.saved_tensors[3:]
            gx = torch.ops.aten.native_layer_norm_backward(
                g if g.dtype == xc.dtype else g.to(xc.dtype), xc, [ctx.layer.d], mean, rstd,
                weight, bias, [True, False, False])[0]
            return (gx if gx.dtype == ctx.x_dtype else gx.to(ctx.x_dtype)), None, None, None
        if ctx.needs_input_grad[0]:
            # an RMSNorm comes here only when its input needs no gradient:
            # autograd differentiates the others (_NormLayer._forward)
            raise RuntimeError("dpclip: internal error: an RMSNorm's input gradient asked "
                               "of _NormFn")
        return gx, None, None, None


# --- what a step sends: parts and outputs -----------------------------------------

class Out:
    """One trainable parameter's private gradient as the daemon writes it:
    `numel` values of `dtype`, flat; each part that writes it names a slice
    (its element offset and wire shape). grad(flat) is the parameter-shaped
    tensor (a view where the layouts agree: a transposed one for a weight
    kept as [in, out]). The CUDA transport keeps its buffer in `buf`, its
    (buffer id, offset) in `ref`, and in `alias` the parameter-shaped view
    of it that param.grad can be (None: the layout or dtype differs, so
    param.grad is a copy)."""
    __slots__ = ("param", "numel", "dtype", "grad", "buf", "ref", "alias")
    param: torch.Tensor
    numel: int
    dtype: torch.dtype                            # the gradient's, as the daemon writes it
    grad: Callable[[torch.Tensor], torch.Tensor]  # flat -> parameter-shaped
    buf: Optional[torch.Tensor]                   # the CUDA transport's buffer
    ref: Optional[Tuple[int, int]]                # ... and its (buffer id, offset)
    alias: Optional[torch.Tensor]                 # ... and grad(buf) where param.grad can be it

    def __init__(self, param: torch.Tensor, grad: Optional[Callable] = None) -> None:
        self.param = param
        self.numel = param.numel()
        self.dtype = param.dtype if param.dtype in _FLOAT_WIRE else torch.float32
        shape = tuple(param.shape)
        self.grad = grad if grad is not None else (lambda flat: flat.view(shape))
        self.buf = None
        self.ref = None
        self.alias = None


# (Out, element offset, shape on the wire)
Slice = Tuple[Out, int, Tuple[int, ...]]


class Part(NamedTuple):
    """One daemon layer of a step: its wire kind ("linear", "embedding",
    "layernorm", "rmsnorm"), its input and output gradient (None where the
    module was not used this step: the transport sends zeros) in the shapes
    and dtypes they travel in (inputs [B, T, d] or indices [B, T], output
    grads [B, T, p or d]), the output slices its weight and bias
    gradients go to (None: not written by this part), the daemon's has_bias,
    and tied_to: 1 + the index in the step of the part whose weight this
    part's weight is (tied parameters), else 0."""
    layer: Any
    kind: str
    name: str
    inp: Optional[torch.Tensor]
    grad: Optional[torch.Tensor]
    in_shape: Tuple[int, ...]
    in_dtype: torch.dtype
    grad_shape: Tuple[int, ...]
    grad_dtype: torch.dtype
    w: Optional[Slice]
    b: Optional[Slice]
    has_bias: bool
    tied_to: int = 0


def _wire_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a tensor travels as: its own when the daemon reads it, else
    f32 (floats) or i64 (indices)."""
    if t.dtype in _DTYPES:
        return t.dtype
    return torch.float32 if t.is_floating_point() else torch.int64


def _part(layer: "_Layer", kind: str, name: str, inp: Optional[torch.Tensor],
          g: Optional[torch.Tensor], in_shape: Tuple[int, ...], grad_shape: Tuple[int, ...],
          w: Optional[Slice], b: Optional[Slice], has_bias: bool, tied_to: int = 0) -> Part:
    idx = kind == "embedding"
    in_dt = _wire_dtype(inp) if inp is not None else (torch.int64 if idx else torch.float32)
    g_dt = _wire_dtype(g) if g is not None else torch.float32
    return Part(layer, kind, name, inp, g, in_shape, in_dt, grad_shape, g_dt, w, b, has_bias,
                tied_to)


def _cat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts, 1)


def _persample_part(layer: "_Layer", name: str, v: Optional[torch.Tensor], n: int, nb: int,
                    out: Out, offset: int = 0) -> Part:
    """A part that carries per-sample gradients v [B, n] the trainer computed
    itself (cheap ones: a norm's affine parameters): a Linear with one
    position and one input feature equal to 1, whose per-sample weight
    gradient [n, 1] is v_b itself (its squared norm, ||1||^2 ||v_b||^2, is
    exact), written to `out` from element `offset`."""
    if v is None:
        return _part(layer, "linear", name, None, None, (nb, 1, 1), (nb, 1, n),
                     (out, offset, (n, 1)), None, False)
    v = v.reshape(v.shape[0], 1, n)
    return _part(layer, "linear", name, v.new_ones((v.shape[0], 1, 1)), v, (nb, 1, 1),
                 (nb, 1, n), (out, offset, (n, 1)), None, False)


# --- one supported module -------------------------------------------------------------

# A _Layer's bias argument: None = the module's own "bias", False = none,
# else the tensor itself.
BiasArg = Union[None, bool, torch.Tensor]
# A capture: (input, output grad, pass), both batch-first.
Record = Tuple[torch.Tensor, torch.Tensor, int]


class Records(list):
    """A layer's records: a list that counts each change made to it in
    `changes` (its engine's one-element list), but _Layer.record's append,
    which stages what it appends (dpclip._planner.Replanner). So a pass
    staged whole is known to be what the layers hold, with no look at each
    layer: nothing changed their records since staging began."""
    __slots__ = ("changes",)

    def __init__(self, changes: List[int], items: Any = ()) -> None:
        super().__init__(items)
        self.changes = changes

    def append(self, x: Any) -> None:
        self.changes[0] += 1
        list.append(self, x)

    def extend(self, xs: Any) -> None:
        self.changes[0] += 1
        list.extend(self, xs)

    def insert(self, i: Any, x: Any) -> None:
        self.changes[0] += 1
        list.insert(self, i, x)

    def pop(self, *i: Any) -> Any:
        self.changes[0] += 1
        return list.pop(self, *i)

    def remove(self, x: Any) -> None:
        self.changes[0] += 1
        list.remove(self, x)

    def clear(self) -> None:
        self.changes[0] += 1
        list.clear(self)

    def sort(self, *a: Any, **k: Any) -> None:
        self.changes[0] += 1
        list.sort(self, *a, **k)

    def reverse(self) -> None:
        self.changes[0] += 1
        list.reverse(self)

    def __setitem__(self, i: Any, x: Any) -> None:
        self.changes[0] += 1
        list.__setitem__(self, i, x)

    def __delitem__(self, i: Any) -> None:
        self.changes[0] += 1
        list.__delitem__(self, i)

    def __iadd__(self, xs: Any) -> "Records":
        self.changes[0] += 1
        list.extend(self, xs)
        return self

    def __imul__(self, n: Any) -> "Records":
        self.changes[0] += 1
        return list.__imul__(self, n)


def _attr_name(module: nn.Module, t: Optional[torch.Tensor]) -> Optional[str]:
    """The name under which module holds t directly (a parameter or a
    buffer), else None."""
    if t is None:
        return None
    for n, v in list(module.named_parameters(recurse=False)) + \
            list(module.named_buffers(recurse=False)):
        if v is t:
            return n
    return None


class _Layer:
    """A supported module under the engine: its parameters, its replaced
    forward, and what it captured since the last step (records of (input,
    output grad, pass), both batch-first). The engine owns it; it holds the
    module (not the other way round, apart from the bound forward, removed
    by detach()).

    Subclasses say how the module is replaced (_forward), which outputs its
    parameters have (outputs) and what it sends the daemon (parts). This
    class is a Linear: y = x W^T + b, W [p, d]."""
    kind = "linear"
    d: int      # input features (an embedding's and a norm's: its width), set by _setup
    p: int      # output features (0: none, an embedding or a norm)
    # its forward is row by row over its input's last dimension, so that
    # flattened tokens [B*T, d] can be trained as [B, T, d] (dpclip._rows)
    rowwise = True

    def __init__(self, engine: Any, name: str, module: nn.Module,
                 weight: Optional[torch.Tensor] = None, bias: BiasArg = None) -> None:
        self.engine = engine
        self.name: str = name or type(module).__name__
        self.module = module
        self.weight: torch.Tensor = module.weight if weight is None else weight
        # bias: None = the module's own "bias", False = none
        b = getattr(module, "bias", None) if bias is None else (None if bias is False else bias)
        # what the forward adds
        self.bias_any: Optional[torch.Tensor] = b if isinstance(b, torch.Tensor) else None
        self.bias: Optional[torch.Tensor] = \
            b if (isinstance(b, torch.Tensor) and b.requires_grad) else None
        # (the engine's count of changes to its layers' records: Records)
        self._changes: List[int] = getattr(engine, "_record_changes", None) or [0]
        self._records = Records(self._changes)
        self.replicated = False         # norm groups: held whole by every member
        self.tie: Optional[_Layer] = None      # the earlier layer whose weight this one's is
        self.tied_by: Optional[_Layer] = None  # ... and the later one, on that layer
        # embeddings of one weight in several modules (BART's shared tokens):
        # the later ones' captures are the first one's (_merge)
        self.merged_into: Optional[_Layer] = None
        self.merged: List[_Layer] = []
        # Outs of the weight and bias (bind_outputs)
        self.w_out: Optional[Out] = None
        self.b_out: Optional[Out] = None
        self.outs: List[Out] = []       # every Out its parts write, outputs()' order
        self.outputs_memo: Optional[tuple] = None  # _planner.outputs()' last answer (first layer)
        self.part0 = 0                  # index of its first part in a step
        # first-step check (dpclip._verify.Probe)
        self.verify: Optional[Callable[[Any, tuple, dict, Any], Any]] = None
        # how the check's errors name what the module is trained as, and the way out
        self.what: Optional[str] = None   # None: dpclip's layer of its kind
        self.hint = "this is a bug in dpclip: please report it"
        # a subclass with its own forward, trained through its calls of
        # this torch class's forward (super().forward; see _swap_class)
        self.via_super: Optional[type] = None
        self._class: Optional[type] = None  # the module's own class while swapped
        self._orig_forward: Optional[Callable[..., Any]] = None
        # the sample of each row of the last forward's input (flattened
        # tokens, dpclip._rows), else None
        self.sid: Optional[torch.Tensor] = None
        self._setup()

    def _setup(self) -> None:
        self.d, self.p = self.module.in_features, self.module.out_features

    def outputs(self) -> List[Tuple[torch.Tensor, Optional[Callable]]]:
        """(parameter, grad(flat) or None for a plain view) of every
        trainable parameter this layer's parts write."""
        if self.merged_into is not None:
            return []
        return [(p, None) for p in (self.weight, self.bias) if p is not None]

    def capture(self, inp: torch.Tensor, g: torch.Tensor, pass_id: int) -> None:
        if self.merged_into is not None:
            self.merged_into.capture(inp, g, pass_id)
            return
        self.record(inp.detach(), g.detach(), pass_id)

    def record(self, first: torch.Tensor, second: torch.Tensor, pass_id: int) -> None:
        """A capture of pass_id kept for the step (every layer's captures
        come through here): the engine tracks the passes one backward
        reaches, and a steady step's plan is staged as its layers capture
        (dpclip._planner.Replanner.stage)."""
        rec = (first, second, pass_id)
        list.append(self._records, rec)  # (not a change: staged, below)
        e = self.engine
        e._acc.captured(pass_id)  # pylint: disable=protected-access
        e._replanner.stage(self, rec)  # pylint: disable=protected-access

    @property
    def records(self) -> Records:
        """What it captured since the last step (see Records)."""
        return self._records

    @records.setter
    def records(self, v: Any) -> None:
        self._changes[0] += 1
        self._records = Records(self._changes, v)

    def trains(self) -> bool:
        """Whether a parameter it trains is trainable now (not frozen)."""
        return self.weight.requires_grad

    def active(self) -> bool:
        # (_reference: the first-step check is running the modules' own code)
        return self.engine.active and torch.is_grad_enabled() and self.trains() and \
            not getattr(self.engine, "_reference", False)

    def attach(self) -> None:
        layer = self

        def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not layer.active():
                return layer._orig_forward(*args, **kwargs)
            layer.sid = None
            x0 = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x0 is not None and x0.dim() >= (2 if layer.kind == "embedding" else 3):
                _rows.note_batch(layer.engine, x0.shape[0])
            if layer.via_super is not None:  # its own code, the base's forward swapped
                y = layer._orig_forward(*args, **kwargs)
            elif layer.rowwise and len(args) == 1 and not kwargs and x0 is not None and \
                    x0.dim() == 2 and _rows.flat_rows(layer, x0):
                y = _rows.flat_forward(layer, mod, x0)
            else:
                y = layer._forward(mod, *args, **kwargs)
            if layer.verify is not None:
                y = layer.verify(layer, args, kwargs, y)
            return y

        if self.via_super is not None:
            self._swap_class()
        self._orig_forward = self.module.forward
        self.module.forward = types.MethodType(forward, self.module)

    def _swap_class(self) -> None:
        """A subclass of a torch module with its own forward that reaches the
        weight through super().forward(...): the module's class becomes a
        subclass of its own whose MRO puts a shim between it and the torch
        class, so that the subclass's code runs as written and its call of
        the base forward is this layer's _forward. Whatever the subclass does
        around that call (a scale, an offset, shifted indices) autograd
        differentiates: the output gradient captured is the one w.r.t. the
        base forward's output (a scale s on the output gives s times the
        incoming gradient), exactly what the per-sample rule needs."""
        layer, base, cls = self, self.via_super, type(self.module)

        def base_forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if mod is layer.module and layer.active():
                return layer._forward(mod, *args, **kwargs)
            return base.forward(mod, *args, **kwargs)

        shim = type("_DPClip" + base.__name__, (base,), {"forward": base_forward,
                                                         "__module__": __name__})
        swapped = type(cls.__name__, (cls, shim), {"__module__": cls.__module__,
                                                   "__qualname__": cls.__qualname__})
        self._class = cls
        self.module.__class__ = swapped

    def reference(self, mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The module's computation as it was before dpclip (the first-step
        check calls it with the engine in reference mode: no layer active)."""
        return self._orig_forward(*args, **kwargs)

    def _forward(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, mod.weight, mod.bias, self)

    def detach(self) -> None:
        if self._orig_forward is not None:
            try:
                del self.module.forward  # the instance attribute; the class method shows again
            except AttributeError:
                pass
            self._orig_forward = None
        if self._class is not None:
            self.module.__class__ = self._class
            self._class = None

    # Shapes normalized for the daemon: inputs [B, T, d] (indices [B, T]),
    # output grads [B, T, p or d]; several calls of the module in one pass
    # are concatenated along T, which is exact: the per-sample gradient of a
    # module applied k times is the sum over all k*T positions.
    def flat_parts(self, B: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        ins, gs = [], []
        for inp, g, _ in self.records:
            if self.kind == "embedding":
                ins.append(inp if inp.dim() == 2 else inp.reshape(B, -1))
            else:
                ins.append(inp if inp.dim() == 3 and inp.shape[2] == self.d
                           else inp.reshape(B, -1, self.d))
            gs.append(g if g.dim() == 3 else g.reshape(B, -1, g.shape[-1]))
        return ins, gs

    def captured(self, B: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], int]:
        """(input, output grad, positions T) of what the layer captured, each
        concatenated over its uses, or (None, None, 1) for B = 0 (the
        transport sends zeros of one position)."""
        if not B:
            return None, None, 1
        ins, gs = self.flat_parts(B)
        inp = _cat(ins)
        return inp, _cat(gs), inp.shape[1]

    def _wslice(self, shape: Tuple[int, ...]) -> Optional[Slice]:
        """The weight's output slice, or None where a tie makes the earlier
        layer write it."""
        return None if self.tie is not None else (self.w_out, 0, shape)

    def _tied_to(self) -> int:
        return self.tie.part0 + 1 if self.tie is not None else 0

    def parts(self, B: int, nb: int) -> List[Part]:
        """This layer's daemon layers for a step of B samples (0: nothing
        captured; nb = max(B, 1) samples are sent)."""
        inp, g, T = self.captured(B)
        b = (self.b_out, 0, (self.p,)) if self.bias is not None else None
        return [_part(self, "linear", self.name, inp, g, (nb, T, self.d), (nb, T, self.p),
                      self._wslice((self.p, self.d)), b, self.bias is not None,
                      self._tied_to())]


class _HFConv1DLayer(_Layer):
    """Hugging Face's Conv1D (GPT-2): a Linear whose weight is kept
    transposed, [in, out] (nx, nf): y = x W + b. Sent as a Linear with
    d = nx, p = nf; the daemon writes [nf, nx], which param.grad sees
    transposed."""

    def _setup(self) -> None:
        self.d, self.p = self.weight.shape

    def outputs(self) -> List[Tuple[torch.Tensor, Optional[Callable]]]:
        nx, nf = self.d, self.p
        return [(self.weight, lambda flat: flat.view(nf, nx).t())] + \
            ([(self.bias, None)] if self.bias is not None else [])

    def _forward(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, mod.weight.t(), mod.bias, self)


class _EmbeddingLayer(_Layer):
    rowwise = False
    kind = "embedding"

    def _setup(self) -> None:
        m = self.module
        self.d, self.p = m.embedding_dim, 0
        self.vocab: int = m.num_embeddings
        self.padding_idx: Optional[int] = m.padding_idx

    def _forward(self, mod: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        # positions [1, T] shared by the batch: expand to the pass's batch
        # (seen by the layers before this one in the pass: the token
        # embedding, usually)
        B = _rows.pass_batch(self.engine)
        if B is None and idx.dim() >= 1:
            _rows.note_batch(self.engine, idx.shape[0])
        batch = B if B is not None and idx.dim() >= 1 and idx.shape[0] == 1 else 0
        return _EmbeddingFn.apply(idx, mod.weight, self, batch)

    def parts(self, B: int, nb: int) -> List[Part]:
        if self.merged_into is not None:  # sent with the layer it is merged into
            return []
        inp, g, T = self.captured(B)
        return [_part(self, "embedding", self.name, inp, g, (nb, T), (nb, T, self.d),
                      self._wslice((self.vocab, self.d)), None, False, self._tied_to())]


class _NormLayer(_Layer):
    """LayerNorm / RMSNorm over the last dimension: torch's, or a registered
    class (dpclip._registry.register) whose eps and weight attributes it
    names."""

    def __init__(self, engine: Any, name: str, module: nn.Module, kind: str,
                 weight: Optional[torch.Tensor] = None, bias: BiasArg = None,
                 eps: Union[str, float] = "eps", offset: float = 0.0,
                 hf_style: bool = False) -> None:
        self.kind = kind                # "layernorm" or "rmsnorm"
        self.eps_attr = eps             # the module's attribute that holds eps, or eps itself
        self.offset = float(offset)     # added to the weight (Gemma's 1 + weight)
        self.hf_style = hf_style        # Hugging Face's RMSNorm arithmetic (_rms)
        self.eps_used: Optional[float] = None  # the eps the last forward used
        super().__init__(engine, name, module, weight, bias)

    def _setup(self) -> None:
        self.d, self.p = self.weight.shape[0], 0
        # the attributes the forward reads: a wrapper may swap the module's
        # tensors between forwards (FSDP2 puts the unsharded parameter in
        # the sharded one's place), so they are looked up by name each time
        self._attrs: List[Optional[str]] = [_attr_name(self.module, t)
                                            for t in (self.weight, self.bias_any)]

    def _live(self, mod: nn.Module, i: int, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return getattr(mod, self._attrs[i]) if self._attrs[i] is not None else t

    def eps_for(self, x: torch.Tensor) -> float:
        eps = self.eps_attr if not isinstance(self.eps_attr, str) else \
            getattr(self.module, self.eps_attr, None)
        if eps is None:  # nn.RMSNorm(eps=None): torch uses the dtype's epsilon
            eps = torch.finfo(x.dtype).eps
        return float(eps)

    def _forward(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = self._live(mod, 0, self.weight)
        if self.kind == "layernorm" or not x.requires_grad:
            return _NormFn.apply(x, weight,
                                 self._live(mod, 1, self.bias_any) if self.kind == "layernorm"
                                 else None, self)
        # An RMSNorm has no fused input-gradient kernel to call, and
        # recomputing its forward in backward cost a Llama-1B-like bf16 step
        # 8 ms of the trainer's GPU time (66 more elementwise kernels, H100).
        # So autograd records the forward with
        # the weight detached (no weight gradient, as _NormFn gives none) and
        # differentiates it; a hook on the output records (input, output
        # grad) as _NormFn.backward does. A norm whose input needs no
        # gradient goes through _NormFn, whose output the weight makes
        # differentiable, so that its gradient is still captured.
        xc = _norm_input(x)
        eps = self.eps_used = self.eps_for(xc)
        y = _norm_apply(self, xc, weight.detach(), None, eps)
        saved, pass_id = xc.detach(), self.engine._pass
        y.register_hook(lambda g: self.capture(saved, g, pass_id))
        return y

    def parts(self, B: int, nb: int) -> List[Part]:
        inp, g, T = self.captured(B)
        b = (self.b_out, 0, (self.d,)) if self.bias is not None else None
        return [_part(self, self.kind, self.name, inp, g, (nb, T, self.d), (nb, T, self.d),
                      (self.w_out, 0, (self.d,)), b, self.bias is not None)]


# --- checks -------------------------------------------------------------------------

# Normalizations that can couple the samples of a batch (see _mixing).
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _mixing(m: nn.Module) -> Optional[str]:
    """Why module m, in its present mode, couples the samples of a batch
    (through its output, or through running statistics the saved model
    keeps), or None. Checked at make_private and before each forward of
    the module: model.train() may switch it back to training mode."""
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        if m.training:
            return ("in training mode it normalizes each sample with the batch's statistics (a "
                    "sample's gradient then depends on the others') and moves its running "
                    "statistics, which the saved model keeps, with them")
        if m.running_mean is None and m.running_var is None:
            return ("without running statistics (track_running_stats=False) it normalizes each "
                    "sample with the batch's statistics, in eval mode too")
    elif isinstance(m, nn.modules.instancenorm._InstanceNorm):
        if m.training and m.track_running_stats:
            return ("in training mode it moves its running statistics (track_running_stats="
                    "True), which the saved model keeps, with the batch's")
    return None


def _mixing_error(name: str, m: nn.Module, why: str) -> UnsupportedModuleError:
    return UnsupportedModuleError(
        "module %s (%s) mixes samples: %s; use a per-sample normalization instead (nn.LayerNorm, "
        "or nn.GroupNorm without trainable affine parameters), or keep the module in eval mode "
        "with frozen running statistics (module.eval(); model.train() switches it back)"
        % (name or "<root>", type(m).__name__, why))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _tref(buf: int, off: int, dtype: torch.dtype, shape: Sequence[int]) -> _lib.Tensor:
    # (a tuple fills the struct's array field directly: no array object of
    # its own, host time on every part of every step)
    return _lib.Tensor(buf, off, _DTYPES[dtype], len(shape), tuple(shape))


def _label(name: str, m: nn.Module) -> str:
    return "%s (%s)" % (name or "<root>", type(m).__name__)


def bind_outputs(layers: List[_Layer]) -> List[Out]:
    """One Out per trainable parameter, in the layers' order (a tied weight
    has one, its first layer's); sets each layer's w_out and b_out."""
    outs, by_id = [], {}
    for l in layers:
        l.outs = []
        for p, grad in l.outputs():
            o = by_id.get(id(p))
            if o is None:
                o = by_id[id(p)] = Out(p, grad)
                outs.append(o)
            l.outs.append(o)
            if p is l.weight:
                l.w_out = o
            elif p is l.bias:
                l.b_out = o
    return outs
