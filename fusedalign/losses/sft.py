"""Supervised fine-tuning loss: token-mean NLL over a GLOBAL token count.

Dividing by the number of label tokens in the whole global batch (all ranks, all
accumulation steps), not by this micro-batch's, is what makes the summed gradient equal
to one big batch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fusedalign.metrics import Mean, MetricSet, logged_as


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


@dataclass(frozen=True)
class SFTMetrics(MetricSet):
    """Token means over the scored tokens, per example (`[B]`)."""

    accuracy: Mean = logged_as("mean_token_accuracy")
    entropy: Mean | None = logged_as("entropy")


def sft_metrics(mask: Tensor, argmax_match: Tensor | None = None, entropy: Tensor | None = None,
                examples: Tensor | None = None, num_examples: int | None = None) -> SFTMetrics:
    """mean_token_accuracy and entropy from the head's per-token statistics.

    Args:
        mask: [B, T], True where a token is scored.
        argmax_match: same shape, bool, argmax of the logits == label (None: counted as 0).
        entropy: same shape, per-token entropy (None: no entropy metric).
        examples: [B, T] long, the example each position belongs to (a padding-free row holds
            several); default: each row is one example.
        num_examples: how many examples `examples` numbers (default: its maximum + 1).
    """
    mask = mask.bool()

    def per_example(x: Tensor | None) -> Tensor:
        values = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device) if x is None else \
            torch.where(mask, x.detach().double(), torch.zeros((), dtype=torch.float64, device=mask.device))
        if examples is None:
            return values.sum(-1)
        count = num_examples if num_examples is not None else int(examples.max()) + 1
        return values.new_zeros(count).index_add_(0, examples.reshape(-1), values.reshape(-1))

    tokens = per_example(mask)
    return SFTMetrics(
        accuracy=Mean(per_example(argmax_match), tokens),
        entropy=None if entropy is None else Mean(per_example(entropy), tokens),
    )


def sft_batch_loss(token_logps: Tensor, mask: Tensor, argmax_match: Tensor | None = None,
                   entropy: Tensor | None = None, examples: Tensor | None = None,
                   num_examples: int | None = None) -> tuple[Tensor, SFTMetrics]:
    """One SFT micro-batch: the NLL SUM of its label tokens (the trainer divides by the
    step's global token count) and its metrics; arguments as `sft_metrics`."""
    return sft_loss(token_logps, mask, num_tokens=1), sft_metrics(mask, argmax_match, entropy, examples, num_examples)
