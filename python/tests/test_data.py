"""The Poisson-sampling loader."""
import torch
from torch.utils.data import DataLoader, TensorDataset

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
