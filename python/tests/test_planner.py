"""dpclip._planner.batch_size: the step's batch size from what the layers
captured, one pass where every capture agrees, and the odd module named
where one does not."""
import types

import pytest
import torch

from dpclip import _lib, _planner


def _layer(name, *shapes, kind="linear"):
    recs = [(torch.zeros(s), torch.zeros(s[:1] + (3,) if s else ()), 0) for s in shapes]
    return types.SimpleNamespace(name=name, kind=kind, rowwise=True, records=recs)


def test_one_batch_size_everywhere():
    layers = [_layer("a", (4, 5, 2)), _layer("b", (4, 2), (4, 7, 2)), _layer("c")]
    assert _planner.batch_size(layers) == 4
    assert _planner.batch_size([_layer("c")]) == 0  # nothing captured
    assert _planner.batch_size([_layer("e", (0, 3))]) == 0  # an empty batch


@pytest.mark.parametrize("odd", [0, 1, 2])
def test_the_odd_module_is_named(odd):
    """The batch is what the inputs with positions ([B, T, d]) saw, wherever
    the module that saw another comes (first, middle or last)."""
    layers = [_layer("m%d" % i, (6, 5, 2)) for i in range(3)]
    layers[odd] = _layer("odd", (12, 2))  # flattened tokens of 6 x 2 rows
    with pytest.raises(ValueError) as ei:
        _planner.batch_size(layers)
    msg = str(ei.value)
    assert "module odd saw a batch of (12,) samples where the other modules saw 6" in msg
    assert "rows [12, 2]" in msg


def test_an_output_grad_of_another_batch_is_refused():
    bad = _layer("g", (4, 2))
    bad.records[0] = (bad.records[0][0], torch.zeros(5, 3), 0)
    with pytest.raises(ValueError, match="module g saw"):
        _planner.batch_size([_layer("a", (4, 5, 2)), bad])


def test_outputs_follow_the_layers():
    """outputs() keeps its last answer on the first layer: the same layers
    get it again, and any change to a layer's outs, or other layers, a new
    one (each output once, in the layers' order)."""
    o1, o2, o3 = object(), object(), object()
    a, b = _layer("a"), _layer("b")
    a.outs, b.outs = [o1], [o2, o1]  # a tied output: once
    assert _planner.outputs([a, b]) == [o1, o2]
    assert _planner.outputs([a, b]) == [o1, o2]
    b.outs.append(o3)
    assert _planner.outputs([a, b]) == [o1, o2, o3]
    b.outs = [o3]
    assert _planner.outputs([a, b]) == [o1, o3]
    assert _planner.outputs([a]) == [o1]
    assert _planner.outputs([b, a]) == [o3, o1]
    assert _planner.outputs([]) == []


def _same_plan(got, want, identical=True):
    """The same parts; their tensors the same objects (identical), or equal
    (a concatenation is a new tensor each time)."""
    assert len(got.parts) == len(want.parts) and list(got.outs) == list(want.outs)
    for a, b in zip(got.parts, want.parts):
        if identical or a.inp is None:
            assert a.inp is b.inp and a.grad is b.grad
        else:
            assert torch.equal(a.inp, b.inp) and torch.equal(a.grad, b.grad)
        assert a[:3] == b[:3] and a[5:] == b[5:]


def test_plans_made_again_are_the_plans(daemon):
    """Replanner: a pass whose every layer captured what the template's did
    (the same shapes and dtypes, one capture each, or nothing) gets the
    template's parts with its own tensors, which is what plan() returns;
    any other pass (other shapes, a module used that was not) is planned
    afresh; and the template holds none of a step's tensors."""
    import gc
    import weakref

    from models import SteadyModel, private
    torch.manual_seed(0)
    model = SteadyModel()
    engine, model, opt = private(daemon, model, 1.0, 4)
    rp = engine._replanner
    seen, serials = [], []
    for T, extra in [(5, False), (5, False), (5, False), (7, False), (7, False), (7, True),
                     (7, True)]:
        model.use_extra = extra
        x = torch.randint(0, 9, (4, T))
        model(x).square().mean().backward()
        B = _planner.batch_size(engine._layers)
        want = _planner.plan(engine._layers, B)
        st = rp.steady(engine._layers)  # the batch and plan without counting
        got = rp.plan(engine._layers, B)
        _same_plan(got, want)
        assert got.wired == bool(got.serial)
        assert (st is not None) == bool(got.serial)
        if st is not None:
            assert st[0] == B
            _same_plan(st[1], want)
        serials.append(got.serial)
        seen.append(weakref.ref(engine._layers[2].records[0][0]))
        opt.step()
        opt.zero_grad()
        del want, got, st
        gc.collect()
        assert seen[-1]() is None  # the step's capture is gone: the template holds none
    # the first pass of each shape is planned afresh, the next ones from its template
    assert serials[0] == 0 and serials[3] == 0 and serials[5] == 0
    assert serials[1] and serials[2] == serials[1]
    assert serials[4] and serials[4] != serials[1]
    assert serials[6] and serials[6] != serials[4]
    engine.close()


def test_a_steady_step_is_one_of_the_templates_batch(daemon):
    """Replanner.steady: a pass of another batch size (or an empty one) is
    not the template's, however its layers are laid out: batch_size()
    counts it and plan() plans it; an empty batch's template serves none."""
    from models import SteadyModel, private
    torch.manual_seed(0)
    engine, model, opt = private(daemon, SteadyModel(), 1.0, 4)
    rp = engine._replanner
    for B, steady in [(4, False), (4, True), (3, False), (3, True), (0, False), (0, False)]:
        model(torch.randint(0, 9, (B, 5))).square().sum().backward()
        st = rp.steady(engine._layers)
        assert (st is not None) == steady, (B, st)
        if st is not None:
            assert st[0] == B == _planner.batch_size(engine._layers)
        rp.plan(engine._layers, _planner.batch_size(engine._layers))
        engine._drop()  # (not sent: the replanner alone is under test)
        opt.zero_grad()
    engine.close()


def test_no_template_where_a_layer_is_captured_twice(daemon):
    """A module used twice in a pass (its captures concatenated) makes no
    template: every such pass is planned afresh."""
    from models import SeqModel, private
    torch.manual_seed(0)
    engine, model, opt = private(daemon, SeqModel(), 1.0, 3)
    rp = engine._replanner
    for _ in range(3):
        model(torch.randint(0, 11, (3, 6))).square().mean().backward()
        B = _planner.batch_size(engine._layers)
        got = rp.plan(engine._layers, B)
        _same_plan(got, _planner.plan(engine._layers, B), identical=False)
        assert got.serial == 0 and not got.wired
        opt.step()
        opt.zero_grad()
    engine.close()


def _steady_engine(daemon):
    """(engine, model, optimizer) of a SteadyModel using every module."""
    from models import SteadyModel, private
    torch.manual_seed(0)
    model = SteadyModel()
    model.use_extra = True
    return private(daemon, model, 1.0, 4)


def test_a_steady_plan_is_staged_as_the_layers_capture(daemon):
    """Replanner.stage: once a template is kept, a pass of its shapes has
    its plan staged during the backward (each layer's part, and its
    tensors' pointers, as it captures), so that steady() is plan()'s
    answer without comparing shapes again. A pass that leaves the template
    (another length: staging stops and holds nothing; a module not used)
    is compared at step(), as is one whose capture was replaced after it
    was staged (records rewritten); and the step drops what was staged."""
    import gc
    import weakref

    engine, model, opt = _steady_engine(daemon)
    rp = engine._replanner
    n = len(engine._layers)
    # (length, extra module used, a record replaced, layers staged, steady() from them)
    for T, extra, swap, staged, used in [(5, True, False, 0, False), (5, True, False, n, True),
                                         (5, True, True, n, False), (6, True, False, 0, False),
                                         (6, True, False, n, True), (6, False, False, n - 1,
                                                                     False)]:
        model.use_extra = extra
        model(torch.randint(0, 9, (4, T))).square().mean().backward()
        assert rp.n_staged == staged, (T, extra, rp.n_staged)
        for i, l in enumerate(engine._layers):
            if rp.staged and rp.staged[i] is not None:
                inp, g, _ = l.records[0]
                assert rp.staged[i].inp is inp and rp.staged[i].grad is g
                assert rp.ptrs[2 * i] == inp.data_ptr() and rp.ptrs[2 * i + 1] == g.data_ptr()
        if rp.off:
            assert all(pt is None for pt in rp.staged)  # (no tensor held for nothing)
        if swap:  # a record rewritten after it was staged: compared, not trusted
            l = engine._layers[2]
            inp, g, p = l.records[0]
            l.records[0] = (inp.clone(), g, p)
        B = _planner.batch_size(engine._layers)
        want = _planner.plan(engine._layers, B)
        st = rp.steady(engine._layers)
        if used:
            assert st is not None and st[1].ptrs is rp.ptrs and st[1].parts is rp.staged
        elif st is not None:
            assert st[1].ptrs is None  # the comparison's plan
        if st is not None:
            assert st[0] == B
            _same_plan(st[1], want)
        rp.plan(engine._layers, B)
        held = weakref.ref(engine._layers[0].records[0][0])
        opt.step()
        opt.zero_grad()
        del want, st
        gc.collect()
        assert held() is None and rp.n_staged == 0  # the step dropped the staged parts
    engine.close()


def test_a_pass_staged_whole_is_one_pass(daemon):
    """Replanner.whole (step()'s steady case, which skips counting the
    passes): the layers' captures of one pass, staged as they came, give
    its plan (and that pass, pass_id), and the committed step is the one the
    comparison makes; captures of two passes (each layer once) are not
    staged whole, and step() counts the passes, as before."""
    from dpclip import _accumulate
    engine, model, opt = _steady_engine(daemon)
    rp, layers = engine._replanner, engine._layers
    counted = []
    to_commit = _accumulate.Accumulator._to_commit

    def counting(acc):
        counted.append(1)
        return to_commit(acc)
    _accumulate.Accumulator._to_commit = counting
    try:
        for i in range(4):
            model(torch.randint(0, 9, (4, 5))).square().mean().backward()
            whole = rp.whole(layers)
            # (the first step checks the layers; the second is kept as the template)
            assert (whole is not None) == (i >= 2)
            if whole is not None:
                assert engine._acc._passes() == [rp.pass_id]
                _same_plan(whole, _planner.plan(layers, 4))
            opt.step()
            opt.zero_grad()
        assert len(counted) == 2  # the steps before the template alone counted their passes
        model(torch.randint(0, 9, (4, 5))).square().mean().backward()
        recs = [l.records[0] for l in layers]
        recs[1] = (recs[1][0], recs[1][1], recs[1][2] + 1)
        for l, r in zip(layers, recs):
            l.records[:] = []
        rp.unstage()  # the same captures, staged as if the second layer's were another pass's
        for l, r in zip(layers, recs):
            list.append(l.records, r)  # (as _Layer.record appends)
            rp.stage(l, r)
        assert rp.off and rp.n_staged == 0 and rp.whole(layers) is None
        assert engine._acc._passes() == sorted({recs[0][2], recs[0][2] + 1})
        engine._drop()
        opt.zero_grad()
    finally:
        _accumulate.Accumulator._to_commit = to_commit
    engine.close()


def test_any_change_to_the_records_after_staging_is_seen(daemon):
    """Replanner.whole trusts a pass staged whole without looking at each
    layer because Records counts every change to a layer's records but
    _Layer.record's own append: each kind of change after staging (even
    one that leaves the same record in place) makes whole() decline, and
    step()'s comparison then plans what the layers hold."""
    engine, model, opt = _steady_engine(daemon)
    rp, layers = engine._replanner, engine._layers
    changes = {
        "append": lambda r: r.append(r[0]),
        "extend": lambda r: r.extend([]),
        "insert": lambda r: r.insert(0, r[0]),
        "setitem": lambda r: r.__setitem__(0, r[0]),
        "slice": lambda r: r.__setitem__(slice(0, 1), [r[0]]),
        "delitem then append": lambda r: (r.__delitem__(0), r.append(None)),
        "pop then append": lambda r: r.append(r.pop()),
        "clear then append": lambda r: (lambda x: (r.clear(), r.append(x)))(r[0]),
        "remove then append": lambda r: (lambda x: (r.remove(x), r.append(x)))(r[0]),
        "sort": lambda r: r.sort(key=id),
        "reverse": lambda r: r.reverse(),
        "iadd": lambda r: r.__iadd__([]),
        "imul": lambda r: r.__imul__(1),
        "replaced": None,
    }
    for i in range(2):  # the first-step check, then the template
        model(torch.randint(0, 9, (4, 5))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for name, change in changes.items():
        model(torch.randint(0, 9, (4, 5))).square().mean().backward()
        assert rp.whole(layers) is not None, name
        l = layers[1]
        if change is None:
            l.records = list(l.records)  # (the setter: the same records, a new list)
        else:
            change(l.records)
        assert rp.whole(layers) is None, name
        if name != "delitem then append":  # (whose record is gone: not a plan)
            st = rp.steady(layers)
            want = _planner.plan(layers, 4) if all(len(x.records) == 1 for x in layers) else None
            if want is None:
                assert st is None, name
            else:
                _same_plan(st[1], want)
        engine._drop()
        opt.zero_grad()
    engine.close()


@pytest.mark.parametrize("rc", [0, 5, _lib.EAGAIN])
def test_staged_tensors_are_resolved_at_the_backwards_end(daemon, rc):
    """Replanner.resolve (a CUDA engine's Client.refs_cuda_at): once the
    backward that captured a whole staged pass ends, every pointer staged
    is resolved in one call, into the refs the steady plan carries; a
    resolution that fails leaves the pass to step()'s comparison (no error
    in the backward), holding nothing. EAGAIN (a norm group member's
    refs_cuda_cached_at: an allocation not registered yet) keeps the pass
    staged, unsealed: the step names its pointers."""
    import ctypes
    fails, later = rc not in (0, _lib.EAGAIN), rc == _lib.EAGAIN

    engine, model, opt = _steady_engine(daemon)
    rp = engine._replanner
    n = len(engine._layers)
    calls = []

    def resolve(k, pa, ra):
        calls.append((k, pa - ctypes.addressof(rp.ptrs), ra - ctypes.addressof(rp.refs),
                      rp.n_staged))
        for i in range(k):  # (a stand-in: each pointer's "buffer" is its index + 1)
            rp.refs[2 * i] = i + 1
            rp.refs[2 * i + 1] = rp.ptrs[i]
        return rc

    for step in range(3):
        if step == 2:
            rp.resolve = resolve
        model(torch.randint(0, 9, (4, 5))).square().mean().backward()
        B = _planner.batch_size(engine._layers)
        want = _planner.plan(engine._layers, B)
        st = rp.steady(engine._layers)
        if step == 2:
            # one call, once every layer was staged
            assert calls == [(2 * n, 0, 0, n)], calls
            assert rp.n_staged == (0 if fails else n) and rp.off == fails
            assert rp.sealed == (rc == 0)
            assert st is not None
            _same_plan(st[1], want)
            if fails:
                assert st[1].ptrs is None and st[1].refs is None
            elif later:
                assert st[1].refs is None and list(st[1].ptrs) == [
                    t.data_ptr() for l in engine._layers for t in l.records[0][:2]]
            else:
                assert st[1].refs is rp.refs and list(rp.refs) == [
                    v for i, l in enumerate(engine._layers) for j, t in enumerate(l.records[0][:2])
                    for v in (2 * i + j + 1, t.data_ptr())]
        else:
            assert not calls and not rp.sealed and (st is None or st[1].refs is None)
        rp.plan(engine._layers, B)
        engine._drop()
        assert not rp.sealed
        opt.zero_grad()
    if not fails:  # a backward that raised left its _seal queued, never run: the next seals
        rp._queued = True
        engine._drop()
        model(torch.randint(0, 9, (4, 5))).square().mean().backward()
        assert rp.sealed == (rc == 0) and len(calls) == 2
    engine.close()


def test_staged_or_compared_a_steady_plan_is_the_plan(daemon):
    """Over a random run of passes (batch and length changing, the extra
    module unused, used once or twice, two passes before a step, a record
    rewritten after it was staged, a step dropped before it was planned),
    whatever steady() answers, staged or compared, is plan()'s answer, and
    a pass that is not one template's gets None."""
    import random

    rng = random.Random(7)
    engine, model, opt = _steady_engine(daemon)
    rp = engine._replanner
    seen = {"staged": 0, "compared": 0, "none": 0, "rewritten after staging": 0}
    for _ in range(120):  # (repeats likely: a template is kept, then used)
        B, T = rng.choice([4, 4, 3]), rng.choice([5, 5, 6])
        model.use_extra = rng.choice([0, 0, 1, 1, 1, 2])
        for _ in range(2 if rng.random() < 0.15 else 1):
            model(torch.randint(0, 9, (B, T))).square().mean().backward()
        if rng.random() < 0.25:
            l = engine._layers[rng.randrange(len(engine._layers))]
            if l.records:
                inp, g, p = l.records[0]
                l.records[0] = (inp.clone(), g, p)
                seen["rewritten after staging"] += rp.n_staged == len(engine._layers)
        if rng.random() < 0.1:
            engine._drop()  # (a step dropped: nothing to plan)
            opt.zero_grad()
            continue
        nb = _planner.batch_size(engine._layers)
        want = _planner.plan(engine._layers, nb)
        st = rp.steady(engine._layers)
        whole = rp.whole(engine._layers)  # (step()'s: the plan of a pass staged whole)
        if whole is not None:
            assert engine._acc._passes() == [rp.pass_id]
            assert whole.ptrs is not None and st is not None and st[1].ptrs is not None
            _same_plan(whole, want)
        else:
            assert st is None or st[1].ptrs is None
        if st is None:
            seen["none"] += 1
        else:
            seen["staged" if st[1].ptrs is not None else "compared"] += 1
            assert st[0] == nb
            _same_plan(st[1], want)
            assert all(len(l.records) <= 1 for l in engine._layers), \
                "a steady plan for a pass with a layer captured twice"
            if st[1].ptrs is not None:  # staged: every layer captured, once
                assert all(len(l.records) == 1 for l in engine._layers)
        rp.plan(engine._layers, nb)
        engine._drop()
        opt.zero_grad()
    assert all(seen.values()), seen  # every path taken
    engine.close()
