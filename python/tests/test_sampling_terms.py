"""The rate the ledger accounts is the rate the batches are drawn at: an
explicit sample_rate beside a DPDataLoader that samples at another rate is
refused at make_private, naming both (issue 38: q = 0.001 was charged for a
loader sampling at 0.1, epsilon 0.61 reported where 3.44 was true)."""
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from dpclip.data import DPDataLoader
from dpclip.torch import PrivacyEngine


def _data(n=100):
    return TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))


def _make(daemon, loader, **kw):
    model = nn.Linear(4, 2)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    try:
        return engine, engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, **kw)
    except Exception:
        engine.close()
        raise


def test_explicit_rate_disagreeing_with_dp_loader_refused(daemon):
    loader = DPDataLoader(_data(), 0.1, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as ei:
        _make(daemon, loader, sample_rate=0.001)
    msg = str(ei.value)
    assert "sample_rate=0.001" in msg and "0.1" in msg and "DPDataLoader" in msg


def test_explicit_rate_disagreeing_with_converted_loader_refused(daemon):
    """A plain loader that make_private turns into a Poisson one (batch 10
    of 100: q = 0.1)."""
    with pytest.raises(ValueError, match=r"sample_rate=0\.5.*0\.1"):
        _make(daemon, DataLoader(_data(), batch_size=10), sample_rate=0.5)


def test_agreeing_or_absent_rate_accepted(daemon):
    for kw in ({}, {"sample_rate": 0.1}):
        loader = DPDataLoader(_data(), 0.1, generator=torch.Generator().manual_seed(0))
        engine, _ = _make(daemon, loader, **kw)
        assert engine.sample_rate == 0.1
        engine.close()
    # without a loader, the rate given is the one accounted
    engine, _ = _make(daemon, None, sample_rate=0.01, expected_batch_size=4)
    assert engine.sample_rate == 0.01
    engine.close()
