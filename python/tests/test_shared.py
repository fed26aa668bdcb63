"""One weight in several modules (issue 41; _layers._merge): BART's token
embedding is three nn.Embedding modules (`shared`, the encoder's and the
decoder's) holding one weight, tied to the output Linear too. Built here
from plain modules: exact against the per-sample f64 reference (sigma 0,
flat clipping, C between the middle norms; the per-sample norm covers every
use, cross terms included), with the Linear met before or after the
embeddings; embeddings of one weight that disagree on padding_idx are
refused by name."""
import pytest
import torch
import torch.nn as nn

from dpclip.torch import PrivacyEngine, UnsupportedModuleError
from models import DEVICES, exact_step, prose

B, T, D = 6, 8, 16


class EncDec(nn.Module):
    """Two embedding modules of one weight (source and target tokens, the
    target shifted), a Linear on each, the head tied to the weight; with
    head_first the head is registered (met) before the embeddings."""

    def __init__(self, V, head_first=False, pad=(None, None)):
        super().__init__()
        if head_first:
            self.head = nn.Linear(D, V, bias=False)
        self.shared = nn.Embedding(V, D)  # never called, as BART's
        self.enc_tokens = nn.Embedding(V, D, padding_idx=pad[0])
        self.dec_tokens = nn.Embedding(V, D, padding_idx=pad[1])
        self.enc_tokens.weight = self.dec_tokens.weight = self.shared.weight
        self.enc = nn.Linear(D, D)
        self.dec = nn.Linear(D, D)
        if not head_first:
            self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, idx):
        memory = torch.tanh(self.enc(self.enc_tokens(idx))).mean(1, keepdim=True)
        shifted = torch.roll(idx, 1, dims=1)
        h = torch.tanh(self.dec(self.dec_tokens(shifted)) + memory)
        return self.head(h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_first", [False, True])
def test_one_weight_in_three_modules_exact(daemon, head_first, device):
    torch.manual_seed(0)
    (x,), y, V = prose(B, T, seed=7)
    engine, _ = exact_step(daemon, EncDec(V, head_first), "seq", (x,), y, device)
    layers = {l.name: l for l in engine._layers}
    first = layers["head"].tie or layers["head"].tied_by
    assert {l.name for l in first.merged} | {first.name} == {"shared", "enc_tokens", "dec_tokens"}
    engine.close()


def test_padding_idx_disagrees_refused(daemon):
    (x,), y, V = prose(B, T, seed=7)
    engine = PrivacyEngine(daemon.socket, allow_insecure_seed=True)
    with pytest.raises(UnsupportedModuleError, match="enc_tokens"):
        engine.make_private(module=EncDec(V, pad=(0, None)), optimizer=None,
                            noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=B)
    engine.close()
