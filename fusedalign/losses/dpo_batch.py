"""One DPO micro-batch: the summed loss of its pairs and its metrics.

The trainer's step: policy and reference sequence log-probs of 2B rows (rows `[:B]`
chosen, `[B:]` rejected) in, `(sum of the valid pairs' losses, DPOMetrics)` out; the
trainer's base divides by the valid pairs of the whole optimizer step. Under LD-DPO
(`ld_alpha`) the policy's come as the 4B part sums of `dpo_length`, weighted here; under WPO
(`use_weighting`) each pair's loss is multiplied by its weight (`dpo_weighting`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .dpo import DPOLossOutput, pair_losses
from .dpo_metrics import DPOMetrics, dpo_metrics
from .dpo_length import ld_weighted
from .dpo_types import DPOOptions, PairLogps


def split_pairs(policy: Tensor, reference: Tensor, lengths: Tensor, ld_alpha: float | None = None) -> PairLogps:
    """[2B] policy (or with `ld_alpha`, [4B] part sums) and reference sequence log-probs and [2B]
    completion lengths -> `PairLogps` of B pairs."""
    half = lengths.shape[0] // 2
    plain = None
    if ld_alpha is not None:
        policy, plain = ld_weighted(policy, ld_alpha)
        plain = plain[:half]
    return PairLogps(policy[:half], policy[half:], reference[:half], reference[half:],
                     lengths[:half].clamp(min=1), lengths[half:].clamp(min=1), plain)


def valid_pairs(lengths: Tensor) -> Tensor:
    """[B] bool: pairs whose chosen and rejected (rows `[:B]`, `[B:]` of `lengths` [2B]) keep a token."""
    half = lengths.shape[0] // 2
    return (lengths[:half] > 0) & (lengths[half:] > 0)


def dpo_batch_loss(
    policy: Tensor,
    reference: Tensor,
    lengths: Tensor,
    plan: Sequence[tuple[str, float]],
    opts: DPOOptions,
    *,
    logit_sums: Tensor | None = None,
    entropy_sums: Tensor | None = None,
    correct: Tensor | None = None,
    ld_alpha: float | None = None,
    pair_weights: Tensor | None = None,
) -> tuple[Tensor, DPOMetrics]:
    """The sum over valid pairs of the DPO losses, and the batch's metrics.

    Args:
        policy: [2B] policy sequence log-probs (chosen rows, then rejected); with `ld_alpha`, [4B]
            their part sums (`dpo_length.ld_weighted`).
        reference: [2B] reference sequence log-probs (zeros when reference-free).
        lengths: [2B] completion tokens of each row.
        plan: the validated (loss type, weight) list (`check_dpo_args`).
        opts: the loss options.
        logit_sums: [2B] per-row sums of each scored position's mean logit, for logits/*.
        entropy_sums: [2B] per-row sums of the entropy over completion tokens, for `entropy`.
        correct: [2B] per-row completion tokens whose argmax is the label (the chosen rows'
            give `mean_token_accuracy`).
        ld_alpha: LD-DPO's weight of the tokens past each pair's shared length; None: none.
        pair_weights: [B] WPO's weight of each pair's loss (`dpo_weighting.wpo_weights`), detached;
            None: 1.

    Returns:
        The loss sum (pairs with nothing to score contribute zero but stay in the graph)
        and `DPOMetrics`.
    """
    pairs = split_pairs(policy, reference.to(policy.dtype), lengths, ld_alpha)
    result: DPOLossOutput = pair_losses(pairs, plan, opts)
    valid = valid_pairs(lengths)
    losses = result.losses if pair_weights is None else result.losses * pair_weights.to(result.losses.dtype)
    loss_sum = (losses * valid.to(losses.dtype)).sum()
    half = lengths.shape[0] // 2
    seq = torch.cat([pairs.chosen, pairs.rejected]).detach()  # [2B] the sums scored (weighted under LD-DPO)
    extra = dict(chosen_tokens=lengths[:half], rejected_tokens=lengths[half:], entropy_sums=entropy_sums,
                 chosen_correct=None if correct is None else correct[:half])
    if logit_sums is not None:
        extra.update(chosen_logit_sums=logit_sums[:half], rejected_logit_sums=logit_sums[half:])
    metrics = dpo_metrics(result.chosen_rewards, result.rejected_rewards, seq[:half], seq[half:], valid, **extra)
    return loss_sum, metrics


def pair_loss_gradient(reference: Tensor, lengths: Tensor, plan: Sequence[tuple[str, float]], opts: DPOOptions,
                       ld_alpha: float | None = None):
    """d(sum of the valid pairs' losses) / d(policy row sums), as a function of the row sums [2B]
    (with `ld_alpha`, of the part sums [4B], as `dpo_batch_loss` takes them).

    What the loss-aware head needs to form its gradient in the forward.
    """
    valid = valid_pairs(lengths)

    def grad(sums: Tensor) -> Tensor:
        sums = sums.detach().requires_grad_()
        losses = pair_losses(split_pairs(sums, reference.to(sums.dtype), lengths, ld_alpha), plan, opts).losses
        return torch.autograd.grad((losses * valid.to(sums.dtype)).sum(), sums)[0]

    return grad
