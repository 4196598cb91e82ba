"""WPO: each pair's loss weighed by how likely the current policy is to produce the pair itself.

Preference data is mostly off-policy; WPO weighs each pair by the policy's own, length-normalised
probability of its two completions, so that pairs the policy would sample count more (TRL 1.16's
`use_weighting`). A token's log-prob is aligned by the log of sum_v p_v^2, the expected
probability of a token drawn from the same distribution, so that a sharp and a flat
distribution are compared on one scale. The weights carry no gradient; they multiply each pair's
loss, summed over the loss types (as TRL multiplies each type's per-pair loss), the `sft` term
included. The per-token statistic comes from the head's own pass (`log_sum_sq_probs`).

Paper: https://huggingface.co/papers/2406.11827 (Eq. 2)

Formula:
    w(y) = exp( (1 / max(|y|, 1)) * sum_t [log pi(y_t | x, y_<t) - log sum_v pi(v | x, y_<t)^2] )
    loss_i <- w(y_w) * w(y_l) * loss_i
"""

from __future__ import annotations

import torch
from torch import Tensor


def wpo_weights(aligned_sums: Tensor, lengths: Tensor) -> Tensor:
    """Each pair's weight w(y_w) w(y_l), detached.

    Args:
        aligned_sums: [2B] per sequence (chosen rows, then rejected), the sum over its scored
            tokens of log p(token) - log sum_v p_v^2.
        lengths: [2B] scored tokens of each sequence (clamped to >= 1: an empty one weighs 1).

    Returns:
        [B] in aligned_sums' dtype.
    """
    with torch.no_grad():
        weights = torch.exp(aligned_sums / lengths.clamp(min=1).to(aligned_sums.dtype))  # [2B]
        half = weights.shape[0] // 2
        return weights[:half] * weights[half:]
