"""The step planner: what one optimizer step sends the daemon. From what the
layers captured in one forward/backward pass it finds the batch size, has
each layer lay out its daemon layers (Parts: tensors in the shapes and
dtypes the daemon reads, and the slices of the parameters' outputs they
write), adds them to a dpclip Step given each tensor's reference in a
transport (_host, _cuda), and writes the daemon's outputs into param.grad.
It holds no state: the engine (dpclip.torch) owns the layers and the Step."""
import collections
import ctypes
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _lib
from ._layers import _FLOAT_WIRE, Out, Part, Record, _Layer

__all__ = ["Plan", "Replanner", "batch_size", "plan", "add_layers", "params", "set_grad",
           "out_dtype"]

# refs(i) -> (input ref, output grad ref, weight out ref, bias out ref) of
# the plan's part i, in the transport's buffers.
Refs = Callable[[int], Tuple[_lib.Tensor, _lib.Tensor, _lib.Tensor, _lib.Tensor]]


class Plan(NamedTuple):
    """A step's parts, in the order they are sent, and the outputs they
    write (one per trainable parameter, each written by one or more parts).
    wired: each part's tensors are already in the dtypes and layout the
    daemon reads. serial: nonzero where Replanner made the plan again from
    a template, the template's number: two plans of one serial have the
    same parts but for their tensors (names, kinds, shapes, dtypes, outputs).
    ptrs: where the plan was staged as the layers captured (Replanner.stage),
    each part's input and output gradient device pointers, ptrs[2i] and
    ptrs[2i + 1] (a ctypes uint64 array, rewritten by the next pass's
    captures: read it before the next backward), and where the transport
    resolves them once staged (CUDA: Replanner.resolve), refs: their
    (buffer_id, offset) pairs, refs[4i .. 4i + 3] (the same)."""
    parts: List[Part]
    outs: Sequence[Out]  # (read only: a template's plans share their template's)
    wired: bool = False
    serial: int = 0
    ptrs: Optional[Any] = None
    refs: Optional[Any] = None


def batch_size(layers: Sequence[_Layer]) -> int:
    """The batch size of what the layers captured (0: nothing captured);
    ValueError naming a module that saw another."""
    # Every step of a well-formed model: one batch size everywhere (the
    # count below, a step's largest host cost after the plan, only decides
    # between sizes, and names the odd module out).
    b0 = None
    for l in layers:
        for inp, g, _ in l.records:
            s = inp.shape
            if not s or g.shape[0] != s[0] or (b0 is not None and s[0] != b0):
                return _batch_size_counted(layers)
            b0 = s[0]
    return b0 or 0


def _batch_size_counted(layers: Sequence[_Layer]) -> int:
    counts: collections.Counter = collections.Counter()
    seqs: collections.Counter = collections.Counter()  # inputs with positions: [B, T, ...]
    for l in layers:
        for inp, _, _ in l.records:
            counts[inp.shape[0] if inp.dim() > 0 else -1] += 1
            if inp.dim() >= (2 if l.kind == "embedding" else 3):
                seqs[inp.shape[0]] += 1
    if not counts:
        return 0
    B = (seqs or counts).most_common(1)[0][0]
    for l in layers:
        for inp, g, _ in l.records:
            if inp.dim() == 0 or inp.shape[0] != B or g.shape[0] != B:
                rows = ""
                if inp.dim() == 2 and l.kind != "embedding" and l.rowwise:
                    rows = (" (its input is rows [%d, %d]: flattened tokens are trained where "
                            "dpclip can prove each row's sample: a reshape of a batch-first "
                            "tensor, rows of one picked by an index, elementwise functions of "
                            "such; not rows transposed or reordered)" % tuple(inp.shape))
                raise ValueError(
                    "module %s saw a batch of %s samples where the other modules saw %d%s: "
                    "inputs must be batch-first, with the sample in dimension 0 (e.g. "
                    "positional indices expanded to [B, T])"
                    % (l.name, tuple(inp.shape[:1]) or "a scalar", B, rows))
    return B


def outputs(layers: Sequence[_Layer]) -> List[Out]:
    """Every layer's outputs, each once, in the layers' order. (The last
    answer is kept on the first layer, with what it was made from: each
    layer's outs list and its length. A trainer plans the same layers every
    step.)"""
    last = getattr(layers[0], "outputs_memo", None) if layers else None
    if last is not None and len(last[0]) == len(layers) and all(
            a is l.outs and len(a) == n for a, l, n in zip(last[0], layers, last[1])):
        return list(last[2])
    outs, seen = [], set()
    for l in layers:
        for o in l.outs:
            if id(o) not in seen:
                seen.add(id(o))
                outs.append(o)
    if layers:
        layers[0].outputs_memo = ([l.outs for l in layers], [len(l.outs) for l in layers], outs)
    return list(outs)


def params(layers: Sequence[_Layer]) -> List[torch.Tensor]:
    """The trainable parameters the layers train, each once (a tied weight
    is one parameter)."""
    return [o.param for o in outputs(layers)]


def plan(layers: Sequence[_Layer], B: int) -> Plan:
    """The step's parts and outputs. Layers not used in this pass (and
    every layer of an empty batch) send zeros of one position: norm 0, so
    the daemon adds noise alone to their params."""
    nb = max(B, 1)
    parts: List[Part] = []
    for l in layers:
        l.part0 = len(parts)  # a tied layer's partner, earlier, is placed already
        parts.extend(l.parts(B if l.records else 0, nb))
    return Plan(parts, outputs(layers))


class Replanner:
    """plan() made again cheaply for a trainer's steady state: the last
    plan kept as a template where each layer was one part reading its one
    capture as it is (contiguous, in the dtype the daemon reads), and the
    next pass whose every layer captured tensors of the same shapes and
    dtypes (or, like the template, nothing) gets the template's parts with
    its own tensors, without asking the layers. That is what plan() would
    return: a layer's parts depend on its captures' shapes and dtypes and on
    what make_private fixed (names, outputs, ties), whose outs lists are
    checked. The template holds no tensor (a step's captures are freed once
    it is sent). The engine owns it; the first-step check plans afresh.

    Staging: the same comparison made as each layer captures, during the
    backward (stage(), from _Layer.record), so that a steady step's plan,
    and its tensors' device pointers, are ready when step() is called:
    steady() then only checks that every layer holds what was staged for it
    (its one capture, the same object), which is plan()'s answer again, and
    whole() (step()'s common case) not even that: the layers' records count
    their changes (dpclip._layers.Records), so none since staging began on
    empty records means they hold what was staged. Anything else (a layer
    captured twice, another shape or pass, a layer the template does not
    know, records changed) leaves the pass to the comparison at step().
    unstage() forgets it, with the layers' captures. resolve (set by the
    engine for a CUDA model: Client.refs_cuda_at, a norm group member's
    refs_cuda_cached_at) names the staged tensors
    for the daemon at the backward's end (_seal), all in one call, so that
    the step only rebinds; where it fails the pass is left to step(), which
    raises its error."""

    def __init__(self, changes: Optional[List[int]] = None) -> None:
        # the engine's count of changes to its layers' records (Records):
        # what it read when staging began, and whether they were empty then
        self.changes = changes if changes is not None else [0]
        self.seen = -1
        self.clean = False
        self.serial = 0      # the template's number (Plan.serial); 0: none
        self.layers: Optional[Sequence[_Layer]] = None
        self.B = -1
        self.tmpl: List[Part] = []
        # per layer: None (captured nothing) or (input shape, grad shape,
        # input dtype, grad dtype, its outs list, the part's fields before
        # its tensors, and after them)
        self.keys: List[Optional[Tuple[Any, ...]]] = []
        self.outs: Sequence[Out] = ()
        # staging: the template's index of each layer (by id), this pass's
        # staged parts (None: not yet), how many, whether the pass left the
        # template (then steady() compares at step()), and the pointers
        self.at: Dict[int, int] = {}
        self.staged: List[Optional[Part]] = []
        self.recs: List[Optional[Record]] = []   # the records staged (their identity is checked)
        self.pass_id = 0                         # ... all of one pass
        self.n_staged = 0
        self.off = False
        self.ptrs: Optional[Any] = None
        self.refs: Optional[Any] = None
        self.resolve: Optional[Callable[[int, int, int], int]] = None
        self._addrs = (0, 0)  # ptrs' and refs' addresses
        self.sealed = False   # refs hold the staged pass's tensors, resolved
        self._queued = False  # _seal queued at this backward's end

    def plan(self, layers: Sequence[_Layer], B: int) -> Plan:
        p = self._again(layers, B)
        if p is None:
            p = plan(layers, B)
            self._keep(layers, B, p)
        return p

    def steady(self, layers: Sequence[_Layer]) -> Optional[Tuple[int, Plan]]:
        """(B, the plan) of a pass whose every layer captured what the
        template's did (same shapes and dtypes: the same batch size, which
        batch_size() would find), without counting the batch; None
        otherwise (a template of an empty batch included: its step drops
        the captures first)."""
        if self.B <= 0:
            return None
        p = self._staged_plan(layers)
        if p is None:
            p = self._again(layers, self.B)
        return None if p is None else (self.B, p)

    def stage(self, layer: _Layer, rec: Record) -> None:
        """layer captured rec (its record, just appended): its part of a
        steady step staged where it is what the template's part reads, as
        _again() would find at step(), and the pass is the one the others
        staged."""
        if not self.serial or self.off:
            return
        i = self.at.get(id(layer), -1)
        k = self.keys[i] if i >= 0 else None
        inp, g, pass_id = rec
        if k is None or self.changes[0] != self.seen or self.staged[i] is not None \
                or layer.outs is not k[4] \
                or inp.shape != k[0] or g.shape != k[1] or inp.dtype is not k[2] \
                or g.dtype is not k[3] or not inp.is_contiguous() or not g.is_contiguous() \
                or (self.n_staged and pass_id != self.pass_id):
            # (a second capture, or records changed since staging began,
            # included: the pass is not the template's, or not only it)
            self._leave()
            return
        ptrs = self.ptrs
        ptrs[2 * i] = inp.data_ptr()
        ptrs[2 * i + 1] = g.data_ptr()
        self.staged[i] = tuple.__new__(Part, k[5] + (inp, g) + k[6])
        self.recs[i] = rec
        self.pass_id = pass_id
        self.n_staged += 1
        self.sealed = False
        if self.resolve is not None and not self._queued:
            try:  # (the backward's end: every layer's capture of a pass is in)
                torch.autograd.Variable._execution_engine.queue_callback(self._seal)
                self._queued = True
            except RuntimeError:  # not inside a backward: step() resolves them
                pass

    def _seal(self) -> None:
        """At a backward's end: a pass staged whole has its tensors named
        for the daemon, all in one call (resolve), while the GPU still runs
        the backward; where that fails the pass is left to step(), which
        raises the error. A norm group member's resolve names only what is
        registered already (Client.refs_cuda_cached_at): its micro-batch in
        flight waits in the daemon for the other members', which may wait
        on the device for this process's next send (a pipeline's gradient,
        queued after this backward), and the daemon answers a registration
        only after it. EAGAIN keeps the pass staged, its pointers named when
        the step is sent."""
        self._queued = False
        if self.off or self.n_staged != len(self.staged) or self.resolve is None:
            return
        rc = self.resolve(len(self.ptrs), self._addrs[0], self._addrs[1])
        if rc == _lib.EAGAIN:
            return  # (an allocation not registered yet: the step names the pointers)
        if rc:
            self._leave()
        else:
            self.sealed = True

    def _leave(self) -> None:
        """This pass is not staged (what was is dropped: it holds tensors)."""
        self._empty(len(self.keys), off=True)

    def _empty(self, n: int, off: bool = False) -> None:
        """Nothing staged for the n layers (the parts and their records
        together), the pass off the template or not."""
        self.staged = [None] * n
        self.recs = [None] * n
        self.n_staged, self.off, self.sealed = 0, off, False

    def unstage(self, clean: bool = True) -> None:
        """Forgets what was staged (the layers' captures are being dropped,
        or some sent: the staged parts hold their tensors); staging begins
        again, the layers' records empty (clean) or not. A _seal queued
        by a backward that raised never runs: the next backward queues its
        own."""
        self._queued = False
        self.seen, self.clean = self.changes[0], clean
        if self.n_staged or self.off:
            self._empty(len(self.keys))

    def whole(self, layers: Sequence[_Layer]) -> Optional[Plan]:
        """The plan of the pass (pass_id) the layers hold staged whole:
        step()'s common case, a whole step of the template's batch size;
        else None. Without a look at each layer: their records were empty
        when staging began (unstage(clean)), every capture since was staged
        (each layer's once, all of one pass), and nothing else changed them
        (Records counts each change)."""
        if not self._all_staged(layers) or not self.clean or self.B <= 0 \
                or self.changes[0] != self.seen:
            return None
        return self._staged_as_plan()

    def _staged_plan(self, layers: Sequence[_Layer]) -> Optional[Plan]:
        if not self._all_staged(layers):
            return None
        # (the record itself, not its tensors: one identity test a layer)
        for l, rec in zip(layers, self.recs):
            r = l.records
            if len(r) != 1 or r[0] is not rec:
                return None
        return self._staged_as_plan()

    def _all_staged(self, layers: Sequence[_Layer]) -> bool:
        """Every layer of the template's (these layers) staged this pass."""
        staged = self.staged
        return bool(self.serial and not self.off and staged and self.n_staged == len(staged)
                    and layers is self.layers)

    def _staged_as_plan(self) -> Plan:
        return Plan(self.staged, self.outs, True, self.serial, self.ptrs,
                    self.refs if self.sealed else None)

    def _again(self, layers: Sequence[_Layer], B: int) -> Optional[Plan]:
        if not self.serial or B != self.B or layers is not self.layers \
                or len(layers) != len(self.keys):
            return None
        parts = []
        new = tuple.__new__  # (a Part from its fields, without NamedTuple's own __new__)
        for l, t, k in zip(layers, self.tmpl, self.keys):
            r = l.records
            if k is None:
                if r:
                    return None
                parts.append(t)  # zeros of one position, as before
                continue
            if len(r) != 1 or l.outs is not k[4]:
                return None
            inp, g, _ = r[0]
            if inp.shape != k[0] or g.shape != k[1] or inp.dtype is not k[2] \
                    or g.dtype is not k[3] or not inp.is_contiguous() or not g.is_contiguous():
                return None
            parts.append(new(Part, k[5] + (inp, g) + k[6]))
        return Plan(parts, self.outs, True, self.serial)

    def _keep(self, layers: Sequence[_Layer], B: int, p: Plan) -> None:
        self.serial = 0
        self.seen, self.clean = -1, False  # (staging waits for the step's end: unstage())
        self.at = {}
        self._empty(0)
        if len(p.parts) != len(layers):
            return
        tmpl, keys = [], []
        for l, pt in zip(layers, p.parts):
            r = l.records
            if pt.layer is not l:
                return
            if not r:
                if pt.inp is not None:
                    return
                tmpl.append(pt)
                keys.append(None)
                continue
            inp, g = pt.inp, pt.grad
            if len(r) != 1 or inp is not r[0][0] or g is not r[0][1] \
                    or inp.dtype != pt.in_dtype or g.dtype != pt.grad_dtype \
                    or not inp.is_contiguous() or not g.is_contiguous():
                return
            tmpl.append(pt._replace(inp=None, grad=None))
            # (the part's fields before and after its tensors, kept apart from
            # tmpl's part so that a steady step joins them without slicing)
            keys.append((inp.shape, g.shape, inp.dtype, g.dtype, l.outs, tuple(pt[:3]),
                         tuple(pt[5:])))
        Replanner._serials += 1
        self.serial = Replanner._serials
        self.layers, self.B, self.tmpl, self.keys = layers, B, tmpl, keys
        self.outs = tuple(p.outs)
        if all(k is not None for k in keys):  # (a layer that captured nothing: not staged)
            self.at = {id(l): i for i, l in enumerate(layers)}
            self._empty(len(keys))
            self.ptrs = (ctypes.c_uint64 * (2 * len(keys)))()
            self.refs = (ctypes.c_uint64 * (4 * len(keys)))()
            self._addrs = (ctypes.addressof(self.ptrs), ctypes.addressof(self.refs))

    _serials = 0  # numbers unique in the process: a transport may serve several engines


def add_layers(step: _lib.Step, parts: Sequence[Part], algorithm: int, refs: Refs,
               which: Optional[Sequence[int]] = None) -> None:
    """Adds every part to the step (or the parts which names, in increasing
    order: a step in phases' sums), its tensors named by refs(index in
    parts)."""
    which = range(len(parts)) if which is None else which
    at = {i: k for k, i in enumerate(which)}
    for k, i in enumerate(which):
        pt = parts[i]
        l = pt.layer
        a_ref, g_ref, w_ref, b_ref = refs(i)
        name = pt.name.encode()
        if pt.kind == "linear":
            step.add_linear(_lib.Linear(name, a_ref, g_ref, int(pt.has_bias), algorithm, w_ref,
                                        b_ref, 0.0))
        elif pt.kind == "embedding":
            pad = l.padding_idx
            step.add_embedding(_lib.Embedding(name, a_ref, g_ref, l.vocab, int(pad is not None),
                                              pad if pad is not None else 0, w_ref, 0.0))
        else:
            eps = l.eps_used if l.eps_used is not None else \
                l.eps_for(torch.empty(0, dtype=torch.float32))
            nl = _lib.NormLayer(name, a_ref, g_ref, eps, int(pt.has_bias), w_ref, b_ref, 0.0)
            if pt.kind == "layernorm":
                step.add_layernorm(nl)
            else:
                step.add_rmsnorm(nl)
        if l.replicated:
            step.set_replicated(k)
        if pt.tied_to:
            step.set_tied(k, at[pt.tied_to - 1])


def out_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the daemon writes a parameter's gradient in: its own where
    the daemon writes it, else f32."""
    return weight.dtype if weight.dtype in _FLOAT_WIRE else torch.float32


def set_grad(p: torch.Tensor, src: torch.Tensor) -> None:
    """param.grad = a copy of src in the parameter's dtype (a copy: the
    transport's buffer is reused, and may be replaced, by the next step)."""
    if p.grad is None or p.grad.shape != p.shape or p.grad.dtype != p.dtype:
        p.grad = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    p.grad.copy_(src)
