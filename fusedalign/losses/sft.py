"""Supervised fine-tuning loss: token-mean NLL over a GLOBAL token count.

Dividing by the number of label tokens in the whole global batch (all ranks, all
accumulation steps), not by this micro-batch's, is what makes the summed gradient equal
to one big batch's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def sft_loss(token_logps: Tensor, mask: Tensor, num_tokens: Tensor | int | float) -> Tensor:
    """Negative log-likelihood of the label tokens, normalised by a global token count.

    Formula:
        loss = -sum_{t in mask} log p(y_t | y_<t) / num_tokens

    Args:
        token_logps: [B, T] or [N] log-probs of the labels.
        mask: same shape, True (or 1) where a token is scored.
        num_tokens: Scored tokens in the global batch; values < 1 are treated as 1, so a
            global batch with nothing to score gives 0, not NaN.

    Returns:
        Scalar loss, connected to `token_logps` even when `mask` is all False.
    """
    mask = mask.bool()
    # where(), not multiply: positions outside the mask may hold anything (even -inf).
    picked = torch.where(mask, token_logps, token_logps.new_zeros(()))
    denom = torch.as_tensor(num_tokens, dtype=token_logps.dtype, device=token_logps.device)
    return -picked.sum() / denom.clamp(min=1)


class SFTMetrics(NamedTuple):
    """Sums over a batch (fp32): all-reduce (sum), optionally add over steps, then `means()`."""

    num_tokens: Tensor  # scored tokens
    correct_tokens: Tensor  # scored tokens whose argmax is the label
    entropy: Tensor  # sum of per-token entropies over scored tokens

    def means(self) -> dict[str, float]:
        n = max(float(self.num_tokens), 1.0)
        return {
            "num_tokens": float(self.num_tokens),
            "mean_token_accuracy": float(self.correct_tokens) / n,
            "entropy": float(self.entropy) / n,
        }


def sft_metrics(mask: Tensor, argmax_match: Tensor | None = None,
                entropy: Tensor | None = None) -> SFTMetrics:
    """Batch sums behind mean_token_accuracy and entropy, from the head's per-token statistics.

    Args:
        mask: [B, T] or [N], True where a token is scored.
        argmax_match: same shape, bool, argmax of the logits == label (None: counted as 0).
        entropy: same shape, per-token entropy (None: counted as 0).
    """
    mask = mask.bool()
    zero = torch.zeros((), device=mask.device)

    def masked_sum(x: Tensor | None) -> Tensor:
        return zero if x is None else torch.where(mask, x.detach().float(), zero).sum()

    return SFTMetrics(mask.float().sum(), masked_sum(argmax_match), masked_sum(entropy))
