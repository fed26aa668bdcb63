"""Per-sample losses: the reduction over a sample's own terms first, so that a
mean loss is a mean over samples (what loss_reduction="mean" tells the daemon)."""
import torch
import torch.nn.functional as F


def reduce_loss(per_sample, reduction):
    """mean or sum over samples of a [B] loss. The mean of an empty batch is
    0 (with a zero gradient), not NaN."""
    if reduction == "sum":
        return per_sample.sum()
    if reduction == "mean":
        return per_sample.sum() / max(per_sample.shape[0], 1)
    raise ValueError("reduction must be 'mean' or 'sum'")


def per_sample_cross_entropy(logits, targets, **kwargs):
    """[B] classification losses of logits [B, C] and targets [B]."""
    return F.cross_entropy(logits, targets, reduction="none", **kwargs)


def sequence_cross_entropy(logits, targets, reduction="mean", ignore_index=-100):
    """Loss of a sequence model, logits [B, T, V] and targets [B, T]: each
    sample's loss is the mean over its (non-ignored) tokens, then the batch
    is reduced by `reduction` over samples ("none" returns the [B] losses).
    A plain token-level mean over B*T tokens is the same only when every
    sample has the same number of counted tokens."""
    B, T = targets.shape[0], targets.shape[1]
    tok = F.cross_entropy(logits.reshape(B * T, -1).float(), targets.reshape(B * T),
                          reduction="none", ignore_index=ignore_index).view(B, T)
    mask = (targets != ignore_index).to(tok.dtype)
    per_sample = (tok * mask).sum(1) / mask.sum(1).clamp(min=1)
    if reduction == "none":
        return per_sample
    return reduce_loss(per_sample, reduction)
