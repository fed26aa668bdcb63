"""dpclip._planner.batch_size: the step's batch size from what the layers
captured, one pass where every capture agrees, and the odd module named
where one does not."""
import types

import pytest
import torch

from dpclip import _planner


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
