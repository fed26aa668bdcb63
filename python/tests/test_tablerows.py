"""Embeddings whose forward reads rows of their table itself (issue 41;
dpclip._tablerows): a position embedding named WhisperPositionalEmbedding,
built here as transformers builds it (weight[past : past + T], or
weight[position_ids] with position_ids [1, T]), its output shared by the
batch and added to every sample's tokens: exact against the per-sample f64
reference on the CPU and the GPU (sigma 0, flat clipping, C between the
middle norms); one that returns something else than rows it read (a mean
over positions) refused at its first forward, naming it."""
import pytest
import torch
import torch.nn as nn

from dpclip.torch import UnsupportedModuleError
from models import DEVICES, exact_step, per_sample_losses, private, prose

B, T, D = 6, 8, 16


class WhisperPositionalEmbedding(nn.Embedding):
    def __init__(self, n, d, how="slice"):
        super().__init__(n, d)
        self.how = how

    def forward(self, input_ids, past_key_values_length=0, position_ids=None):
        if self.how == "index":
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            return self.weight[position_ids]
        rows = self.weight[past_key_values_length:past_key_values_length + input_ids.shape[1]]
        return rows.mean(0, keepdim=True).expand_as(rows) if self.how == "mean" else rows


class Decoder(nn.Module):
    def __init__(self, V, how="slice"):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.embed_positions = WhisperPositionalEmbedding(32, D, how)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        h = self.embed_tokens(idx) + self.embed_positions(idx)
        return self.head(torch.tanh(self.norm(h)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["slice", "index"])
def test_positions_read_from_the_table_exact(daemon, how, device):
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=9)
    engine, model = exact_step(daemon, Decoder(V, how), "seq", (x,), y, device)
    assert "forward" in vars(model.embed_positions)
    engine.close()
    assert "forward" not in vars(model.embed_positions)


def test_other_outputs_refused(daemon):
    """The rows averaged over positions: not rows of the table as read, so
    the rule (each row's gradient to the row read) does not hold; refused
    at the module's first training forward, by name, nothing captured."""
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=9)
    engine, model, opt = private(daemon, Decoder(V, "mean"), 1.0, B)
    with pytest.raises(UnsupportedModuleError, match=r"embed_positions \(WhisperPositional"):
        per_sample_losses("seq", model(x), y).mean().backward()
    assert all(p.grad is None for p in model.parameters())
    engine.close()
