"""Per-sample losses: the reduction over a sample's own terms first, so that a
mean loss is a mean over samples (what loss_reduction="mean" tells the daemon).
per_sample_cross_entropy is for classifiers (logits [B, C]),
sequence_cross_entropy for sequence models (logits [B, T, V]), and
cross_entropy takes either."""
from typing import Any

from . import _needs_torch  # noqa: F401  (says which python3 has torch when it is missing)

import torch
import torch.nn.functional as F


def reduce_loss(per_sample: torch.Tensor, reduction: str) -> torch.Tensor:
    """mean or sum over samples of a [B] loss. The mean of an empty batch is
    0 (with a zero gradient), not NaN."""
    if reduction == "sum":
        return per_sample.sum()
    if reduction == "mean":
        return per_sample.sum() / max(per_sample.shape[0], 1)
    raise ValueError("reduction must be 'mean' or 'sum'")


def per_sample_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                             **kwargs: Any) -> torch.Tensor:
    """[B] classification losses of logits [B, C] and targets [B]."""
    return F.cross_entropy(logits, targets, reduction="none", **kwargs)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
                  ignore_index: int = -100) -> torch.Tensor:
    """Cross entropy over samples for either kind of model: a classifier's
    (logits [B, C], targets [B]) or a sequence model's (logits [B, T, V],
    targets [B, T]: each sample's loss the mean over its tokens, as
    sequence_cross_entropy). `reduction` over samples: "mean", "sum" (as
    make_private's loss_reduction) or "none" (the [B] losses)."""
    if logits.dim() == 3:
        return sequence_cross_entropy(logits, targets, reduction, ignore_index)
    per_sample = per_sample_cross_entropy(logits, targets, ignore_index=ignore_index)
    return per_sample if reduction == "none" else reduce_loss(per_sample, reduction)


def sequence_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean",
                           ignore_index: int = -100) -> torch.Tensor:
    """Loss of a sequence model, logits [B, T, V] and targets [B, T]: each
    sample's loss is the mean over its (non-ignored) tokens, then the batch
    is reduced by `reduction` over samples ("none" returns the [B] losses).
    A plain token-level mean over B*T tokens is the same only when every
    sample has the same number of counted tokens. Classifier logits [B, C]
    are refused: per_sample_cross_entropy is their loss."""
    if logits.dim() != 3 or targets.dim() != 2 or tuple(logits.shape[:2]) != \
            tuple(targets.shape):
        raise ValueError(
            "sequence_cross_entropy takes logits [B, T, V] and targets [B, T], got logits %s "
            "and targets %s; for a classifier (logits [B, C], targets [B]) use "
            "engine.loss(per_sample_cross_entropy(logits, targets))"
            % (list(logits.shape), list(targets.shape)))
    B, T = targets.shape[0], targets.shape[1]
    # (the vocabulary named, not -1: an empty batch has no elements to infer it from)
    tok = F.cross_entropy(logits.reshape(B * T, logits.shape[-1]).float(),
                          targets.reshape(B * T), reduction="none",
                          ignore_index=ignore_index).view(B, T)
    mask = (targets != ignore_index).to(tok.dtype)
    per_sample = (tok * mask).sum(1) / mask.sum(1).clamp(min=1)
    if reduction == "none":
        return per_sample
    return reduce_loss(per_sample, reduction)
