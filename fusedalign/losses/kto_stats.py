"""Batch statistics of KTO: the KL reference point z0, and the metrics users know.

z0 is a batch statistic. As in the KTO paper and TRL, each rank takes the mean log-ratio of
its mismatched (prompt, other completion) pairs, the ranks are averaged, and only THEN is the
result clamped at 0. `kl_sums` -> all-reduce (sum) -> `kl_from_sums` does that; sum/count over
the global batch equals TRL's mean of rank means when ranks hold equal numbers of KL pairs,
and is what one process computes over the same global batch. z0 is detached, so the KL
log-probs can be computed under `torch.no_grad()`.

Metrics are typed (`fusedalign.metrics`): per-example statistics that declare how they reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from fusedalign.metrics import Mean, MetricSet, Total, logged_as


class KLSums(NamedTuple):
    """Sum and count of the KL log-ratios of a batch (fp32, detached), to all-reduce (sum)."""

    sum: Tensor
    count: Tensor


def kl_sums(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> KLSums:
    """Sum of log pi(y'|x) - log pi_ref(y'|x) over mismatched pairs [B], and their count."""
    diff = (policy_kl_logps - ref_kl_logps).detach().float()
    return KLSums(diff.sum(), torch.tensor(float(diff.numel()), device=diff.device))


def kl_estimate(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """This rank's unclamped KL estimate (mean log-ratio, 0 if empty), detached.

    To average over ranks TRL's way: all-reduce the estimates (sum), then
    `kl_from_sums(summed_estimates, world_size)`; clamping comes last.
    """
    total, count = kl_sums(policy_kl_logps, ref_kl_logps)
    return total / count.clamp(min=1)


def kl_from_sums(total: Tensor, count: Tensor) -> Tensor:
    """z0 = max(0, total / count) from sums reduced over ranks; 0 when there is no KL pair."""
    return (total / count.clamp(min=1)).clamp(min=0).detach()


@dataclass(frozen=True)
class KTOMetrics(MetricSet):
    """Per example (`[B]`): class means of rewards and log-probs, z0, and class counts per step."""

    chosen_rewards: Mean = logged_as("rewards/chosen")
    rejected_rewards: Mean = logged_as("rewards/rejected")
    chosen_logps: Mean = logged_as("logps/chosen")
    rejected_logps: Mean = logged_as("logps/rejected")
    kl: Mean | None = logged_as("kl")
    num_desirable: Total = logged_as("count/desirable")
    num_undesirable: Total = logged_as("count/undesirable")
    chosen_logits: Mean | None = logged_as("logits/chosen")  # token means over each class's completions
    rejected_logits: Mean | None = logged_as("logits/rejected")
    entropy: Mean | None = logged_as("entropy")  # token mean over every completion token

    derived = {"rewards/margins": lambda logged: logged["rewards/chosen"] - logged["rewards/rejected"]}


def kto_metrics(rewards: Tensor, policy_logps: Tensor, desirable: Tensor, valid: Tensor | None = None,
                kl: Tensor | None = None, *, logit_sums: Tensor | None = None, entropy_sums: Tensor | None = None,
                tokens: Tensor | None = None) -> KTOMetrics:
    """The metrics users know (rewards/*, logps/*, kl, count/*), per example.

    Args:
        rewards: [B] beta * log-ratios (`KTOLossOutput.rewards`).
        policy_logps: [B] policy sequence log-probs.
        desirable: [B] bool labels.
        valid: [B] bool, examples with a completion token (default: all).
        kl: scalar z0 of the step, reported once per valid example; None leaves `kl` out.
        logit_sums, entropy_sums: [B] per-example sums over completion tokens of each
            position's mean logit and entropy, with `tokens` [B] their token counts
            (logits/* and entropy are token means, as TRL's).
    """
    keep = torch.ones_like(desirable, dtype=torch.bool) if valid is None else valid.bool()
    d = (desirable.bool() & keep).double()
    u = (~desirable.bool() & keep).double()
    r, lp = rewards.detach().double(), policy_logps.detach().double()
    z0 = None if kl is None else Mean(kl.detach().double() * (d + u), d + u)
    logits_d = logits_u = entropy = None
    if logit_sums is not None:
        n, sums, is_d = tokens.double(), logit_sums.detach().double(), desirable.bool().double()
        logits_d, logits_u = Mean(sums * is_d, n * is_d), Mean(sums * (1 - is_d), n * (1 - is_d))
    if entropy_sums is not None:
        entropy = Mean(entropy_sums.detach().double(), tokens.double())
    return KTOMetrics(
        chosen_rewards=Mean(r * d, d), rejected_rewards=Mean(r * u, u),
        chosen_logps=Mean(lp * d, d), rejected_logps=Mean(lp * u, u),
        kl=z0, num_desirable=Total(d), num_undesirable=Total(u),
        chosen_logits=logits_d, rejected_logits=logits_u, entropy=entropy,
    )
