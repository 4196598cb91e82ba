"""The entropy parts of GRPO: the top-entropy token mask (80/20 rule) and the entropy bonus's weight.

The mask's threshold is a quantile of the entropies of every valid token on ALL ranks: the
trainer gathers them (padding across ranks), then `entropy_threshold` and `high_entropy_mask`
apply TRL 1.16's rule. Paper: https://huggingface.co/papers/2506.01939 (Beyond the 80/20 Rule).
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_weight(coef: float, step_items: Tensor, step_tokens: Tensor) -> Tensor:
    """`grpo_loss`'s entropy_weight for a bonus of coef * (entropy mean over the step's tokens).

    The base divides every loss_sum by the step's items; scaling the entropy sum by
    items / tokens (both over the whole optimizer step, all ranks) turns it into a token mean.
    TRL subtracts coef * (the micro-batch's mean over m_eff) / accumulation steps instead:
    the same when micro-batches hold equal numbers of tokens and no entropy mask is on.
    """
    return coef * step_items / step_tokens.clamp(min=1)


def quantile(values: Tensor, q: float) -> Tensor:
    """torch.quantile's linear interpolation, without its input-size limit. values: [n], n >= 1."""
    v = values.flatten().double().sort().values
    pos = q * (v.numel() - 1)
    lo = int(pos // 1)
    hi = min(lo + 1, v.numel() - 1)
    return (v[lo] + (v[hi] - v[lo]) * (pos - lo)).to(values.dtype)


def entropy_threshold(gathered: Tensor, top_entropy_quantile: float) -> Tensor | None:
    """The entropy at quantile 1 - rho of the valid tokens of ALL ranks (gathered by the caller), None if empty."""
    if gathered.numel() == 0:
        return None
    return quantile(gathered, 1.0 - top_entropy_quantile)


def high_entropy_mask(entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> Tensor:
    """[B, T] bool: tokens in `mask` whose entropy is >= threshold (none when threshold is None), as TRL."""
    if threshold is None:
        return torch.zeros_like(mask, dtype=torch.bool)
    return ((entropy * mask.to(entropy.dtype)) >= threshold) & mask.bool()
