"""dpclip.losses: per-sample losses for classifiers and sequence models."""
import pytest
import torch
import torch.nn.functional as F

from dpclip.losses import (cross_entropy, per_sample_cross_entropy, reduce_loss,
                           sequence_cross_entropy)


def test_sequence_cross_entropy_refuses_classifier_logits():
    """[B, C] logits: a ValueError naming per_sample_cross_entropy and the
    shapes (it was an IndexError from inside the function)."""
    logits, y = torch.randn(5, 4), torch.randint(0, 4, (5,))
    with pytest.raises(ValueError) as ei:
        sequence_cross_entropy(logits, y)
    msg = str(ei.value)
    assert "per_sample_cross_entropy" in msg and "[5, 4]" in msg and "[5]" in msg


def test_cross_entropy_takes_either_kind():
    g = torch.Generator().manual_seed(0)
    logits, y = torch.randn(5, 4, generator=g), torch.randint(0, 4, (5,), generator=g)
    per = F.cross_entropy(logits, y, reduction="none")
    assert torch.allclose(cross_entropy(logits, y, "none"), per)
    assert torch.allclose(cross_entropy(logits, y), per.mean())
    assert torch.allclose(cross_entropy(logits, y, "sum"), per.sum())
    assert torch.allclose(per_sample_cross_entropy(logits, y), per)
    seq, ys = torch.randn(3, 6, 7, generator=g), torch.randint(0, 7, (3, 6), generator=g)
    ys[0, :2] = -100  # ignored tokens: that sample's mean is over the other 4
    tok = F.cross_entropy(seq.reshape(18, 7), ys.reshape(18), reduction="none").view(3, 6)
    want = torch.stack([tok[0, 2:].mean(), tok[1].mean(), tok[2].mean()])
    assert torch.allclose(cross_entropy(seq, ys, "none"), want)
    assert torch.allclose(cross_entropy(seq, ys), want.mean())
    assert torch.allclose(sequence_cross_entropy(seq, ys, "sum"), want.sum())


def test_empty_batches_have_zero_loss():
    """Poisson sampling draws empty batches: both kinds give a zero loss
    (the sequence one failed to reshape zero elements)."""
    for logits, y in ((torch.randn(0, 4, requires_grad=True), torch.zeros(0, dtype=torch.long)),
                      (torch.randn(0, 6, 7, requires_grad=True),
                       torch.zeros(0, 6, dtype=torch.long))):
        loss = cross_entropy(logits, y)
        assert float(loss) == 0.0
        loss.backward()
        assert logits.grad.shape == logits.shape
    assert float(reduce_loss(torch.zeros(0), "mean")) == 0.0
