"""The Poisson-sampling loader."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dpclip.data
from dpclip.data import DPDataLoader


def test_poisson_batches():
    n, q = 2000, 0.01
    ds = TensorDataset(torch.arange(n), torch.randn(n, 3))
    loader = DPDataLoader(ds, q, generator=torch.Generator().manual_seed(0), steps=400)
    assert loader.expected_batch_size == 20 and len(loader) == 400
    sizes, seen = [], torch.zeros(n)
    for idx, feats in loader:
        assert feats.shape == (idx.shape[0], 3)
        assert idx.unique().numel() == idx.numel()  # no sample twice in a batch
        sizes.append(idx.shape[0])
        seen[idx] += 1
    sizes = torch.tensor(sizes, dtype=torch.float64)
    # Binomial(n, q): mean 20, variance n q (1 - q) = 19.8.
    assert abs(float(sizes.mean()) - 20) < 6 * (19.8 / 400) ** 0.5
    assert abs(float(sizes.var()) - 19.8) < 0.35 * 19.8
    assert len(set(sizes.tolist())) > 5  # sizes vary
    # Each sample joins each batch with probability q: 4 times on average.
    assert abs(float(seen.mean()) - 4.0) < 0.1


def test_empty_batches_have_shapes():
    ds = TensorDataset(torch.arange(10), torch.randn(10, 3, 2))
    loader = DPDataLoader(ds, 1e-9, steps=3)
    batches = list(loader)
    assert len(batches) == 3
    for idx, feats in batches:
        assert idx.shape == (0,) and feats.shape == (0, 3, 2)


def test_from_data_loader():
    ds = TensorDataset(torch.arange(100))
    dl = DPDataLoader.from_data_loader(DataLoader(ds, batch_size=10))
    assert abs(dl.sample_rate - 0.1) < 1e-12 and len(dl) == 10 and dl.expected_batch_size == 10


def _masks(loader):
    return [tuple(idx.tolist()) for idx, in loader]


def test_masks_are_independent_of_the_global_rng():
    """Trainers seed the global RNG alike on every rank (same initial
    weights): loaders must not draw alike from it."""
    ds = TensorDataset(torch.arange(200))
    torch.manual_seed(0)
    a = _masks(DPDataLoader(ds, 0.5, steps=4))
    torch.manual_seed(0)
    b = _masks(DPDataLoader(ds, 0.5, steps=4))
    assert a != b
    # A generator given for a reproducible test is still followed.
    c = _masks(DPDataLoader(ds, 0.5, steps=4, generator=torch.Generator().manual_seed(1)))
    d = _masks(DPDataLoader(ds, 0.5, steps=4, generator=torch.Generator().manual_seed(1)))
    assert c == d


def test_secure_mode(monkeypatch):
    n, q = 2000, 0.01
    ds = TensorDataset(torch.arange(n))
    loader = DPDataLoader(ds, q, steps=400, secure_mode=True)
    assert loader.secure_mode and loader.expected_batch_size == 20
    sizes = torch.tensor([idx.shape[0] for idx, in loader], dtype=torch.float64)
    assert abs(float(sizes.mean()) - 20) < 6 * (19.8 / 400) ** 0.5
    assert abs(float(sizes.var()) - 19.8) < 0.35 * 19.8
    with pytest.raises(ValueError, match="generator"):
        DPDataLoader(ds, q, secure_mode=True, generator=torch.Generator())
    # The masks are os.urandom's bits against the rate: all-zero bits take
    # every sample, all-one bits none, whatever torch's RNG does.
    small = TensorDataset(torch.arange(10))
    monkeypatch.setattr(dpclip.data.os, "urandom", lambda k: b"\0" * k)
    assert _masks(DPDataLoader(small, 0.3, steps=2, secure_mode=True)) == [tuple(range(10))] * 2
    monkeypatch.setattr(dpclip.data.os, "urandom", lambda k: b"\xff" * k)
    assert _masks(DPDataLoader(small, 0.3, steps=2, secure_mode=True)) == [()] * 2
    # from_data_loader keeps the mode.
    assert DPDataLoader.from_data_loader(DataLoader(ds, batch_size=10),
                                         secure_mode=True).secure_mode


def test_a_replicas_shard():
    """rank= and world_size= (a model-parallel replica's index and count,
    not torch.distributed's): the loader samples that shard, reports the
    global expected batch size, and from_data_loader derives the rate from
    them; half of the pair, or a rank outside, is refused."""
    ds = TensorDataset(torch.arange(300))
    loader = DPDataLoader(ds, 0.5, rank=1, world_size=3, steps=4)
    assert (loader.rank, loader.world_size, loader.expected_batch_size) == (1, 3, 150)
    drawn = {i for idx, in loader for i in idx.tolist()}
    assert drawn and all(i % 3 == 1 for i in drawn)
    conv = DPDataLoader.from_data_loader(DataLoader(ds, batch_size=10), rank=2, world_size=3)
    assert (conv.rank, conv.world_size, conv.sample_rate) == (2, 3, 0.1)
    with pytest.raises(ValueError, match="together"):
        DPDataLoader(ds, 0.5, rank=1)
    with pytest.raises(ValueError, match="outside"):
        DPDataLoader(ds, 0.5, rank=3, world_size=3)
