"""The GRPO loss of one micro-batch, as a SUM over the loss type's items.

`grpo_loss` returns `loss_sum` and `items`; the trainer's base divides by the items of the
whole optimizer step over all ranks (`loss_sum * world / total_items`; backends average
gradients over ranks), which gives TRL 1.16's loss for every type (table below), and the
same update however the step is split over ranks and micro-batches (bnpo excepted: it is
defined per micro-batch). `count_items(mask, loss_type)` counts the items from the mask
alone, before any forward.

| loss_type            | loss_sum of the micro-batch             | items               |
|----------------------|-----------------------------------------|---------------------|
| dapo, cispo, vespo   | sum_{i,t} m L                           | tokens, sum m       |
| grpo, sapo           | sum_i (sum_t m L / max(1, sum_t m))     | sequences (all rows)|
| dr_grpo              | sum_{i,t} m L / max_completion_length   | sequences           |
| luspo                | sum_i sum_t m L                         | sequences           |
| bnpo                 | sum_{i,t} m L / max(1, sum m)           | 1 per micro-batch   |

Against TRL: grpo/sapo/dr_grpo/luspo/bnpo are TRL's when micro-batches have equal row
counts (TRL means per micro-batch, then / accumulation steps). dapo/cispo/vespo normalise
by the tokens of the optimizer step; TRL normalises by the tokens of the generation batch
rescaled by accumulation / steps_per_generation, the same when steps_per_generation equals
the accumulation steps, and otherwise a step with longer completions gets a larger update
there, not here. A row whose completion is fully masked still counts as a sequence (TRL
counts it in its means); its loss is 0.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fusedalign.metrics import Mean

from .grpo_entropy import entropy_threshold, entropy_weight, high_entropy_mask, quantile  # noqa: F401 (re-exported)
from .grpo_metrics import GRPOLossMetrics, clip_statistics, token_mean
from .grpo_policy import (
    CLIPPED,
    LOSS_TYPES,
    GRPOOptions,
    PolicyInputs,
    capped_ratio,
    cispo,
    clipped,
    importance_weights,
    k3_kl,
    sapo,
    vespo,
    vespo_weights,
)

GRPO_POLICY_TERMS: dict[str, Callable[[PolicyInputs, GRPOOptions], Tensor]] = {
    **{name: clipped for name in CLIPPED},
    "cispo": cispo,
    "sapo": sapo,
    "vespo": vespo,
}


def _token_sum(L: Tensor, m: Tensor, o: GRPOOptions) -> Tensor:
    return (L * m).sum()


def _sequence_token_means(L: Tensor, m: Tensor, o: GRPOOptions) -> Tensor:
    return ((L * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum()


def _over_max_length(L: Tensor, m: Tensor, o: GRPOOptions) -> Tensor:
    return (L * m).sum() / o.max_completion_length


def _micro_batch_mean(L: Tensor, m: Tensor, o: GRPOOptions) -> Tensor:
    return (L * m).sum() / m.sum().clamp(min=1.0)


class Aggregation(NamedTuple):
    """How a loss type sums its per-token losses, and what it counts (`unit`)."""

    loss_sum: Callable[[Tensor, Tensor, GRPOOptions], Tensor]
    unit: str  # "tokens", "sequences" or "micro-batch"


AGGREGATIONS: dict[str, Aggregation] = {
    "dapo": Aggregation(_token_sum, "tokens"),
    "cispo": Aggregation(_token_sum, "tokens"),
    "vespo": Aggregation(_token_sum, "tokens"),
    "grpo": Aggregation(_sequence_token_means, "sequences"),
    "sapo": Aggregation(_sequence_token_means, "sequences"),
    "dr_grpo": Aggregation(_over_max_length, "sequences"),
    "luspo": Aggregation(_token_sum, "sequences"),  # sum_i sum_t m L, over sequences
    "bnpo": Aggregation(_micro_batch_mean, "micro-batch"),
}
assert set(AGGREGATIONS) == set(GRPO_POLICY_TERMS) == set(LOSS_TYPES)


def count_items(mask: Tensor, loss_type: str) -> Tensor:
    """Items of a micro-batch for the base's normalisation, from its loss mask [B, T] alone (0-dim float)."""
    unit = AGGREGATIONS[loss_type].unit
    if unit == "tokens":
        return mask.float().sum()
    if unit == "sequences":
        return torch.tensor(float(mask.shape[0]), device=mask.device)
    return torch.ones((), device=mask.device)


class GRPOLossOutput(NamedTuple):
    """Attributes: loss_sum (0-dim, with gradient), items (0-dim, = count_items), metrics."""

    loss_sum: Tensor
    items: Tensor
    metrics: GRPOLossMetrics


def grpo_loss(
    logps: Tensor,
    mask: Tensor,
    advantages: Tensor,
    options: GRPOOptions,
    *,
    old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_mask: Tensor | None = None,
    is_ratio: Tensor | None = None,
    entropy_weight: float | Tensor = 0.0,
    micro_batch_tokens: Tensor | None = None,
) -> GRPOLossOutput:
    """The micro-batch's GRPO loss sum, its items and its metrics.

    Args:
        logps: [B, T] policy log-probs of the completion tokens (with gradient), 0 off the mask.
        mask: [B, T] the tokens in the loss (completion mask, truncated rows off with
            mask_truncated_completions).
        advantages: [B] (or [B, T]) advantages.
        old_logps: [B, T] log-probs of the policy that generated (num_iterations > 1 or
            steps_per_generation > accumulation), or None: then logps.detach() (r == 1).
        ref_logps: [B, T] reference log-probs; required when options.beta != 0.
        entropy: [B, T] per-token entropy (the `entropy` metric; also the bonus below).
        entropy_mask: [B, T] bool, tokens kept by `top_entropy_quantile` (`high_entropy_mask`).
        is_ratio: [B, T] or [B, 1] the generator's importance-sampling weight, or None.
        entropy_weight: with a differentiable `entropy`, loss_sum -= entropy_weight *
            sum_t H m_eff; `entropy_weight(coef, step_items, step_tokens)` makes it the
            bonus coef * (mean entropy of the step's tokens).
        micro_batch_tokens: when these rows are a part of a micro-batch trained in parts, the whole
            micro-batch's loss tokens: bnpo's divisor (its mean is the micro-batch's); None: sum m.

    Formula:
        L = term(r, A) (* entropy_mask) (* is_ratio, not vespo) + beta * kl
    """
    o = options
    m = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    adv = adv.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    coef = importance_weights(log_ratio, m, o.importance_sampling_level)
    p = PolicyInputs(logps, adv, m, log_ratio, coef, is_ratio)
    L = GRPO_POLICY_TERMS[o.loss_type](p, o)
    if entropy_mask is not None:
        L = L * entropy_mask.to(L.dtype)
    if is_ratio is not None and o.loss_type != "vespo":
        L = L * is_ratio
    kl = None
    if o.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference log-probs (ref_logps)")
        kl = k3_kl(logps, ref_logps, coef if o.use_bias_correction_kl else None)
        L = L + o.beta * kl
    if o.loss_type == "bnpo" and micro_batch_tokens is not None:
        loss_sum = (L * m).sum() / micro_batch_tokens.to(L.dtype).clamp(min=1.0)
    else:
        loss_sum = AGGREGATIONS[o.loss_type].loss_sum(L, m, o)
    bonus = None
    if entropy is not None and not (isinstance(entropy_weight, float) and entropy_weight == 0.0):
        effective = m if entropy_mask is None else m * entropy_mask.to(m.dtype)
        loss_sum = loss_sum - entropy_weight * (entropy * effective).sum()
        bonus = Mean((entropy * effective).detach().double().sum(-1), m.double().sum(-1))
    return GRPOLossOutput(loss_sum, count_items(mask, o.loss_type), _metrics(p, o, kl, entropy, bonus))


def _metrics(p: PolicyInputs, o: GRPOOptions, kl: Tensor | None, entropy: Tensor | None,
             bonus: Mean | None = None) -> GRPOLossMetrics:
    stats: dict = {"bonus_entropy": bonus}
    sequence = o.importance_sampling_level == "sequence"  # the ratio p.coef is [B, 1], one per sequence
    if kl is not None:
        stats["kl"] = token_mean(kl, p.mask)
    if entropy is not None:
        stats["entropy"] = token_mean(entropy, p.mask)
    with torch.no_grad():
        if o.loss_type in CLIPPED:
            capped = capped_ratio(p.coef.detach(), o)
            stats.update(clip_statistics(capped, p.advantages, p.mask, 1 - o.epsilon_low, 1 + o.eps_high, sequence))
        elif o.loss_type == "cispo":
            stats["cispo_clip_ratio"] = token_mean(((p.coef > o.eps_high) & (p.advantages > 0)).float(), p.mask,
                                                   sequence)
        elif o.loss_type == "vespo":
            stats["vespo_phi_seq_mean"] = token_mean(vespo_weights(p, o), p.mask, per_sequence=True)
    return GRPOLossMetrics(**stats)
