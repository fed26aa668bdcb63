"""The per-module half of the PyTorch integration: autograd Functions that
compute only input gradients and capture (activation, output gradient), the
record of one supported module, and the checks done at attach time."""
import ctypes
import types
from typing import Any, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _lib


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

def _autocast_dtype(device_type):
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


def _low_precision(t):
    return t.dtype in (torch.bfloat16, torch.float16)


# --- the autograd Functions ---------------------------------------------------------
# Each forward reproduces the module's forward (with the casts autocast would
# make, done explicitly so that the tensor kept for the daemon is the one the
# product used); each backward records (input, output grad) for the layer and
# returns the input gradient only. None for the parameters: autograd then
# neither computes nor accumulates their gradients.

class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        # Casts only where the dtype differs: each .to() is a few
        # microseconds of host time even when it returns its input, and a
        # trainer's step is often bound by the host.
        dt = _autocast_dtype(x.device.type)
        if dt is not None and x.is_floating_point():
            xc = x if x.dtype == dt else x.to(dt)
            wc = weight if weight.dtype == dt else weight.to(dt)
            bc = bias if bias is None or bias.dtype == dt else bias.to(dt)
        else:
            xc, wc, bc = x, weight, bias
        ctx.layer = layer
        ctx.pass_id = layer.engine._pass
        ctx.x_dtype = x.dtype
        # the weight as the product used it (autocast's linear saves its cast
        # weight too), so backward does not cast it again
        ctx.save_for_backward(xc, wc)
        return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx, g):
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
    def forward(ctx, idx, weight, layer):
        ctx.layer = layer
        ctx.pass_id = layer.engine._pass
        ctx.save_for_backward(idx)
        return F.embedding(idx, weight, layer.padding_idx)

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        ctx.layer.capture(idx, g, ctx.pass_id)
        return None, None, None


def _norm_apply(layer, x, weight, bias, eps):
    if layer.kind == "layernorm":
        return F.layer_norm(x, (layer.d,), weight, bias, eps)
    return F.rms_norm(x, (layer.d,), weight, eps)


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        # Autocast runs norms in f32; do the same cast here so that the input
        # the daemon normalizes is the one the forward normalized.
        xc = x.float() if (_low_precision(x) and _autocast_dtype(x.device.type) is not None) \
            else x
        eps = layer.eps_used = layer.eps_for(xc)
        ctx.layer = layer
        ctx.pass_id = layer.engine._pass
        ctx.eps = eps
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
    def backward(ctx, g):
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
            # The input gradient of a norm is cheap elementwise work:
            # recompute the forward and differentiate it with respect to the
            # input alone (parameters detached, so no weight gradient).
            with torch.enable_grad(), torch.autocast(device_type=xc.device.type, enabled=False):
                xr = xc.detach().requires_grad_(True)
                y = _norm_apply(ctx.layer, xr, weight.detach(),
                                bias.detach() if bias is not None else None, ctx.eps)
                (gx,) = torch.autograd.grad(y, xr, g.to(y.dtype))
            gx = gx.to(ctx.x_dtype)
        return gx, None, None, None


# --- one supported module -------------------------------------------------------------

class _Layer:
    """A supported module under the engine: its parameters, its replaced
    forward, and the (input, output grad) pairs captured since the last step.
    The engine owns it; it holds the module (not the other way round, apart
    from the bound forward, removed by detach())."""

    def __init__(self, engine, name, module, kind):
        self.engine = engine
        self.name = name or type(module).__name__
        self.module = module
        self.kind = kind
        self.weight = module.weight
        b = getattr(module, "bias", None)
        self.bias = b if (b is not None and b.requires_grad) else None
        self.padding_idx = getattr(module, "padding_idx", None)
        if kind == "linear":
            self.d, self.p = module.in_features, module.out_features
        elif kind == "embedding":
            self.d, self.p = module.embedding_dim, 0
            self.vocab = module.num_embeddings
        else:
            self.d, self.p = module.normalized_shape[0], 0
        self.records = []
        self.replicated = False         # norm groups: held whole by every member
        self.eps_used = None            # norms: the eps the last forward used
        self.out_w = self.out_b = None  # CUDA outputs, allocated on first GPU step
        self.out_refs = None            # ... and their (buffer, offset) references
        self._orig_forward = None

    def eps_for(self, x):
        eps = getattr(self.module, "eps", None)
        if eps is None:  # nn.RMSNorm(eps=None): torch uses the dtype's epsilon
            eps = torch.finfo(x.dtype).eps
        return float(eps)

    def capture(self, inp, g, pass_id):
        self.records.append((inp.detach(), g.detach(), pass_id))

    def attach(self):
        m, layer = self.module, self

        def forward(mod, x):
            if not (layer.engine.active and torch.is_grad_enabled() and layer.weight.requires_grad):
                return layer._orig_forward(x)
            if layer.kind == "linear":
                return _LinearFn.apply(x, mod.weight, mod.bias, layer)
            if layer.kind == "embedding":
                return _EmbeddingFn.apply(x, mod.weight, layer)
            return _NormFn.apply(x, mod.weight, getattr(mod, "bias", None), layer)

        self._orig_forward = m.forward
        m.forward = types.MethodType(forward, m)

    def detach(self):
        if self._orig_forward is not None:
            try:
                del self.module.forward  # the instance attribute; the class method shows again
            except AttributeError:
                pass
            self._orig_forward = None

    # Shapes normalized for the daemon: inputs [B, T, d] (indices [B, T]),
    # output grads [B, T, p or d]; several calls of the module in one pass
    # are concatenated along T, which is exact: the per-sample gradient of a
    # module applied k times is the sum over all k*T positions.
    def flat_parts(self, B):
        ins, gs = [], []
        for inp, g, _ in self.records:
            if self.kind == "embedding":
                ins.append(inp.reshape(B, -1))
            else:
                ins.append(inp.reshape(B, -1, self.d))
            gs.append(g.reshape(B, -1, g.shape[-1]))
        return ins, gs


def _classify(module):
    """The kind of a supported module, or None. Subclasses that override
    forward are not supported: their forward may not be what we replace."""
    t = type(module)
    if isinstance(module, nn.Linear) and t.forward is nn.Linear.forward:
        return "linear"
    if isinstance(module, nn.Embedding) and t.forward is nn.Embedding.forward:
        return "embedding"
    if isinstance(module, nn.LayerNorm) and t.forward is nn.LayerNorm.forward:
        return "layernorm"
    if _RMSNorm is not None and isinstance(module, _RMSNorm) and t.forward is _RMSNorm.forward:
        return "rmsnorm"
    return None


def _check_module(name, m, kind):
    label = "%s (%s)" % (name or "<root>", type(m).__name__)
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    if w is None or not w.requires_grad:
        if b is not None and b.requires_grad:
            raise UnsupportedModuleError(
                "module %s: a trainable bias with a frozen weight is not supported; "
                "freeze both or neither" % label)
        return False
    if kind == "embedding":
        if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
            raise UnsupportedModuleError(
                "module %s: Embedding with max_norm, scale_grad_by_freq or sparse=True is not "
                "supported" % label)
    if kind in ("layernorm", "rmsnorm") and len(m.normalized_shape) != 1:
        raise UnsupportedModuleError(
            "module %s: only normalization over the last dimension is supported "
            "(normalized_shape %s)" % (label, tuple(m.normalized_shape)))
    return True


# Normalizations that can couple the samples of a batch (see _mixing).
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _mixing(m):
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


def _mixing_error(name, m, why):
    return UnsupportedModuleError(
        "module %s (%s) mixes samples: %s; use a per-sample normalization instead (nn.LayerNorm, "
        "or nn.GroupNorm without trainable affine parameters), or keep the module in eval mode "
        "with frozen running statistics (module.eval(); model.train() switches it back)"
        % (name or "<root>", type(m).__name__, why))


def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _wire_dtype(t):
    """The dtype a tensor travels as: its own when the daemon reads it, else
    f32 (floats) or i64 (indices)."""
    if t.dtype in _DTYPES:
        return t.dtype
    return torch.float32 if t.is_floating_point() else torch.int64


def _tref(buf, off, dtype, shape):
    s = list(shape) + [0] * (3 - len(shape))
    return _lib.Tensor(buf, off, _DTYPES[dtype], len(shape), (ctypes.c_int64 * 3)(*s))


def _collect_layers(engine: Any, module: nn.Module
                    ) -> Tuple[List[_Layer], List[Tuple[str, nn.Module]]]:
    """make_private's walk of the module tree: a _Layer per supported module
    with a trainable weight, and the normalizations whose mode is checked at
    each forward. UnsupportedModuleError names any module it cannot train."""
    layers, seen, norms = [], {}, []
    for name, m in module.named_modules():
        why = _mixing(m)
        if why is not None:
            raise _mixing_error(name, m, why)
        if isinstance(m, _NORMS):
            norms.append((name, m))
        own = [(pn, p) for pn, p in m.named_parameters(recurse=False) if p.requires_grad]
        kind = _classify(m)
        if kind is None:
            if own:
                raise UnsupportedModuleError(
                    "module %s (%s) has trainable parameters (%s) but is not supported by "
                    "dpclip (supported: Linear, Embedding, LayerNorm%s); freeze them or "
                    "replace the module" % (name or "<root>", type(m).__name__,
                                             ", ".join(pn for pn, _ in own),
                                             ", RMSNorm" if _RMSNorm else ""))
            continue
        if not _check_module(name, m, kind):
            continue
        for _, p in own:
            if id(p) in seen:
                raise UnsupportedModuleError(
                    "modules %s and %s share a parameter (tied weights are not supported)"
                    % (seen[id(p)], name))
            seen[id(p)] = name
        layers.append(_Layer(engine, name, m, kind))
    if not layers:
        raise UnsupportedModuleError("the module has no trainable parameters to train privately")
    return layers, norms
