"""Convolutions and per-channel affine normalizations as layers the daemon
clips.

nn.Conv1d / nn.Conv2d (any stride, padding, dilation, padding mode): the
per-sample weight gradient of a convolution is that of a Linear over its
input's patches, g_b^T a_b with a_b [positions, C_in * kernel] and g_b
[positions, C_out], so groups=1 goes to the daemon as a Linear. The patches
are made at step time, one layer at a time (nothing beyond the input the
forward keeps anyway is held through the backward); where the kernel equals
the stride (patch embeddings) they are the input itself, reordered, with no
unfold. With groups > 1 the weight is block-diagonal over the groups: the
trainer forms the per-sample gradients (B x the weight's size, one einsum)
and sends them as they are (_persample_part).

nn.GroupNorm, nn.InstanceNorm*d (affine) and nn.BatchNorm*d in eval mode
with running statistics (affine): y = x_hat * w[c] + b[c], x_hat normalized
per sample (or by frozen statistics), so the per-sample gradients of w and
b, sum over positions of g * x_hat and of g, are [B, C] each: formed in the
backward and sent as they are."""
import math
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._layers import (InputGrad, Part, _Layer, _autocast_dtype, _cast, _cat, _label,
                      _norm_input, _part, _persample_part, UnsupportedModuleError)


# --- convolutions ---------------------------------------------------------------------

class _ConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                layer: "_ConvLayer") -> torch.Tensor:
        dt = _autocast_dtype(x.device.type)
        xc, wc, bc = _cast(x, dt), _cast(weight, dt), _cast(bias, dt)
        ctx.layer = layer
        ctx.pass_id = layer.engine._pass
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(xc, wc)
        conv = F.conv1d if layer.nd == 1 else F.conv2d
        return conv(xc, wc, bc, layer.stride, layer.pad, layer.dilation, layer.groups)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> InputGrad:
        xc, wc = ctx.saved_tensors
        l = ctx.layer
        l.capture(xc, g, ctx.pass_id)
        gx = None
        if ctx.needs_input_grad[0]:
            fn = torch.nn.grad.conv1d_input if l.nd == 1 else torch.nn.grad.conv2d_input
            gx = fn(xc.shape, wc if wc.dtype == g.dtype else wc.to(g.dtype), g, l.stride, l.pad,
                    l.dilation, l.groups)
            if gx.dtype != ctx.x_dtype:
                gx = gx.to(ctx.x_dtype)
        return gx, None, None, None


class _ConvLayer(_Layer):
    """nn.Conv1d / nn.Conv2d. The input the daemon reads is what the
    convolution itself reads (padded first where the module pads other than
    with zeros, or asymmetrically for 'same')."""
    rowwise = False
    kind = "conv"

    def _setup(self) -> None:
        m = self.module
        self.nd = 1 if isinstance(m, nn.Conv1d) else 2  # spatial dimensions
        self.k: Tuple[int, ...] = tuple(m.kernel_size)
        self.stride: Tuple[int, ...] = tuple(m.stride)
        self.dilation: Tuple[int, ...] = tuple(m.dilation)
        self.groups: int = m.groups
        # (F.pad's pads, mode) applied before the convolution
        self.pre_pad: Optional[Tuple[List[int], str]] = None
        self.pad: Tuple[int, ...] = (0,) * self.nd
        if m.padding_mode != "zeros" or m.padding == "same":
            # as the module pads: 'same' may be asymmetric (torch keeps the
            # pads in _reversed_padding_repeated_twice for both)
            self.pre_pad = (list(m._reversed_padding_repeated_twice),
                            "constant" if m.padding_mode == "zeros" else m.padding_mode)
        elif not isinstance(m.padding, str):
            self.pad = tuple(m.padding)
        cin, cout = m.in_channels, m.out_channels
        G = self.groups
        self.d = cin // G * math.prod(self.k)
        self.p = cout // G
        self.cout: int = cout

    def _forward(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.pre_pad is not None:
            pads, mode = self.pre_pad
            x = F.pad(x, pads, mode=mode)
        return _ConvFn.apply(x, mod.weight, mod.bias, self)

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """[B, positions, C_in * kernel] of input x (as the convolution read
        it), ordered as the weight's (channel, kernel) dims flatten."""
        B, C = x.shape[:2]
        if self.nd == 1:
            x = x.unsqueeze(2)
        k = self.k if self.nd == 2 else (1,) + self.k
        s = self.stride if self.nd == 2 else (1,) + self.stride
        p = self.pad if self.nd == 2 else (0,) + self.pad
        dl = self.dilation if self.nd == 2 else (1,) + self.dilation
        if k == s and all(v == 0 for v in p) and all(v == 1 for v in dl):
            # non-overlapping patches: the input itself, reordered (no unfold)
            Ho, Wo = x.shape[2] // k[0], x.shape[3] // k[1]
            x = x[:, :, :Ho * k[0], :Wo * k[1]].reshape(B, C, Ho, k[0], Wo, k[1])
            return x.permute(0, 2, 4, 1, 3, 5).reshape(B, Ho * Wo, C * k[0] * k[1])
        return F.unfold(x, k, dilation=dl, padding=p, stride=s).transpose(1, 2)

    def parts(self, B: int, nb: int) -> List[Part]:
        G = self.groups
        if G > 1:
            return self._grouped_parts(B, nb)
        inp = g = None
        T = 1
        if B:
            ins, gs = [], []
            for x, go, _ in self.records:
                ins.append(self.patches(x))
                gs.append(go.reshape(B, self.cout, -1).transpose(1, 2))
            inp, g = _cat(ins), _cat(gs)
            T = inp.shape[1]
        b = (self.b_out, 0, (self.p,)) if self.bias is not None else None
        return [_part(self, "linear", self.name, inp, g, (nb, T, self.d), (nb, T, self.p),
                      (self.w_out, 0, (self.p, self.d)), b, self.bias is not None)]

    def _grouped_parts(self, B: int, nb: int) -> List[Part]:
        G = self.groups
        vw = vb = None
        if B:
            for x, go, _ in self.records:
                a = self.patches(x).float().reshape(B, -1, G, self.d)
                gg = go.float().reshape(B, G, self.p, -1)
                w = torch.einsum("blgi,bgol->bgoi", a, gg).reshape(B, -1)
                vw = w if vw is None else vw + w
                if self.bias is not None:
                    bb = gg.sum(-1).reshape(B, -1)
                    vb = bb if vb is None else vb + bb
        out = [_persample_part(self, self.name, vw, self.weight.numel(), nb, self.w_out)]
        if self.bias is not None:
            out.append(_persample_part(self, self.name + ".bias", vb, self.cout, nb, self.b_out))
        return out


# --- per-channel affine normalizations ---------------------------------------------

class _AffineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], layer: "_AffineLayer") -> torch.Tensor:
        # Autocast runs these norms in f32: so does this.
        xc = _norm_input(x)
        ctx.layer = layer
        ctx.pass_id = layer.engine._pass
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(xc, weight, bias)
        return layer.normalize(xc, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> InputGrad:
        xc, weight, bias = ctx.saved_tensors
        l = ctx.layer
        with torch.enable_grad(), torch.autocast(device_type=xc.device.type, enabled=False):
            xr = xc.detach().requires_grad_(ctx.needs_input_grad[0])
            xh = l.normalize(xr, None, None)
            gf = g.to(xh.dtype)
            dims = list(range(2, g.dim()))
            B, C = g.shape[:2]

            # sum over positions ([B, C] input: none; sum([]) is all)
            def per_sample(t: torch.Tensor) -> torch.Tensor:
                return (t.sum(dims) if dims else t).reshape(B, C)

            vw = per_sample((gf * xh).detach()) if l.weight is not None else None
            vb = per_sample(gf) if l.bias is not None else None
            l.capture_affine(vw, vb, ctx.pass_id)
            gx = None
            if ctx.needs_input_grad[0]:
                shape = (1, C) + (1,) * len(dims)
                w = weight.detach().reshape(shape).to(xh.dtype) if weight is not None else None
                (gx,) = torch.autograd.grad(xh, xr, gf * w if w is not None else gf)
                gx = gx.to(ctx.x_dtype)
        return gx, None, None, None


class _AffineLayer(_Layer):
    """GroupNorm, InstanceNorm (affine) and eval-mode BatchNorm (affine)."""
    rowwise = False
    kind = "affine"

    def _setup(self) -> None:
        self.d, self.p = self.weight.shape[0], 0

    def normalize(self, x: torch.Tensor, weight: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
        m = self.module
        if isinstance(m, nn.GroupNorm):
            return F.group_norm(x, m.num_groups, weight, bias, m.eps)
        if isinstance(m, nn.modules.instancenorm._InstanceNorm):
            use_input = m.training or not m.track_running_stats
            return F.instance_norm(x, m.running_mean, m.running_var, weight, bias, use_input,
                                   0.0, m.eps)
        return F.batch_norm(x, m.running_mean, m.running_var, weight, bias, False, 0.0, m.eps)

    def capture_affine(self, vw: Optional[torch.Tensor], vb: Optional[torch.Tensor],
                       pass_id: int) -> None:
        # records are (first, second, pass) with both batch-first
        first = vw if vw is not None else vb
        self.record(first, vb if vb is not None else first, pass_id)

    def _forward(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _AffineFn.apply(x, mod.weight, mod.bias, self)

    def parts(self, B: int, nb: int) -> List[Part]:
        vw = vb = None
        if B:
            # several calls in a pass: the per-sample gradient is their sum
            for first, second, _ in self.records:
                if self.weight is not None:
                    vw = first if vw is None else vw + first
                if self.bias is not None:
                    vb = second if vb is None else vb + second
        out = [_persample_part(self, self.name, vw, self.d, nb, self.w_out)]
        if self.bias is not None:
            out.append(_persample_part(self, self.name + ".bias", vb, self.d, nb, self.b_out))
        return out


def _frozen_pair(name: str, m: nn.Module) -> bool:
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    if w is None or not w.requires_grad:
        if isinstance(b, torch.Tensor) and b.requires_grad:
            raise UnsupportedModuleError(
                "module %s: a trainable bias with a frozen weight is not supported; "
                "freeze both or neither" % _label(name, m))
        return True
    return False


# the torch classes whose forward this module's layers replace
BASES = (nn.Conv1d, nn.Conv2d, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
         nn.modules.batchnorm._BatchNorm)


def build(engine: Any, name: str, m: nn.Module) -> Optional[List[_Layer]]:
    """The layers of m as the convolution or affine normalization it is an
    instance of (empty: frozen), whatever its forward; None for others."""
    if isinstance(m, (nn.Conv1d, nn.Conv2d)):
        return [] if _frozen_pair(name, m) else [_ConvLayer(engine, name, m)]
    if isinstance(m, BASES[2:]):
        if getattr(m, "weight", None) is None or not getattr(m, "affine", True):
            return []
        if _frozen_pair(name, m):
            return []
        return [_AffineLayer(engine, name, m)]
    return None


def layers_for(engine: Any, name: str, m: nn.Module) -> Optional[List[_Layer]]:
    """The layers of a convolution or affine normalization with its torch
    class's own forward (empty: frozen), or None for any other module."""
    if type(m).forward in [b.forward for b in BASES] and isinstance(m, BASES):
        return build(engine, name, m)
    return None
