"""Batch statistics of KTO: the KL reference point z0, and the metrics users know.

z0 is a batch statistic. As in the KTO paper and TRL, each rank takes the mean log-ratio of
its mismatched (prompt, other completion) pairs, the ranks are averaged, and only THEN is the
result clamped at 0. `kl_sums` -> all-reduce (sum) -> `kl_from_sums` does that; sum/count over
the global batch equals TRL's mean of rank means when ranks hold equal numbers of KL pairs,
and is what one process computes over the same global batch. z0 is detached, so the KL
log-probs can be computed under `torch.no_grad()`.

Metrics are detached fp32 SUMS with counts: all-reduce (sum) over ranks, optionally add over
logging steps, then divide once with `.means()`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


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


class KTOMetrics(NamedTuple):
    """Sums over a batch (fp32): all-reduce (sum), optionally add over steps, then `means()`."""

    chosen_rewards: Tensor
    rejected_rewards: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor
    num_desirable: Tensor
    num_undesirable: Tensor

    def means(self) -> dict[str, float]:
        """rewards/*, logps/*, count/*; a class with no example in the sums is left out."""
        n_d, n_u = float(self.num_desirable), float(self.num_undesirable)
        out = {"count/desirable": n_d, "count/undesirable": n_u}
        if n_d > 0:
            out["rewards/chosen"] = float(self.chosen_rewards) / n_d
            out["logps/chosen"] = float(self.chosen_logps) / n_d
        if n_u > 0:
            out["rewards/rejected"] = float(self.rejected_rewards) / n_u
            out["logps/rejected"] = float(self.rejected_logps) / n_u
        if n_d > 0 and n_u > 0:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def kto_metrics(rewards: Tensor, policy_logps: Tensor, desirable: Tensor) -> KTOMetrics:
    """Batch sums behind rewards/chosen, rewards/rejected, logps/*, count/* from [B] tensors."""
    d = desirable.bool()
    r, lp = rewards.detach().float(), policy_logps.detach().float()
    zero = r.new_zeros(())

    def split(x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.where(d, x, zero).sum(), torch.where(d, zero, x).sum()

    (r_d, r_u), (lp_d, lp_u) = split(r), split(lp)
    n_d = d.float().sum()
    return KTOMetrics(r_d, r_u, lp_d, lp_u, n_d, d.numel() - n_d)
