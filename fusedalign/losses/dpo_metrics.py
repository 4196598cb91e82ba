"""Batch statistics of DPO: the metrics users know, and bco_pair's reward mean.

Everything here is a detached SUM with its count, so the trainer can all-reduce (sum) over
ranks, optionally add over logging steps, and divide once: means over the global batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class RewardMean(NamedTuple):
    """Sum and count of rewards (fp32): all-reduce (sum), then `mean = sum / count`."""

    sum: Tensor  # scalar, detached
    count: Tensor  # scalar

    @property
    def mean(self) -> Tensor:
        return self.sum / self.count.clamp(min=1)


def bco_reward_mean(chosen_rewards: Tensor, rejected_rewards: Tensor) -> RewardMean:
    """This batch's mean reward over chosen and rejected, the update for bco_pair's running mean.

    Args:
        chosen_rewards: [B] beta * chosen log-ratios (e.g. `DPOLossOutput.chosen_rewards`).
        rejected_rewards: [B] beta * rejected log-ratios.
    """
    rewards = torch.cat([chosen_rewards, rejected_rewards]).detach().float()  # [2B]
    return RewardMean(rewards.sum(), torch.tensor(float(rewards.numel()), device=rewards.device))


_METRIC_NAMES = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
    "logps/chosen", "logps/rejected",
)


class DPOMetrics(NamedTuple):
    """Sums over a batch: all-reduce (sum) over ranks, optionally add over steps, then `means()`.

    All fields are detached fp32 scalar tensors, so `torch.stack(m)` gives one tensor to
    reduce and `DPOMetrics(*reduced)` rebuilds it.
    """

    chosen_rewards: Tensor
    rejected_rewards: Tensor
    accuracies: Tensor  # number of pairs with chosen reward > rejected reward
    margins: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor
    count: Tensor  # number of pairs

    def means(self) -> dict[str, float]:
        n = max(float(self.count), 1.0)
        return {name: float(value) / n for name, value in zip(_METRIC_NAMES, self[:-1])}


def dpo_metrics(
    chosen_rewards: Tensor, rejected_rewards: Tensor, chosen_logps: Tensor, rejected_logps: Tensor
) -> DPOMetrics:
    """Batch sums behind the metrics users know (rewards/*, logps/*), from [B] tensors, in fp32."""
    c, r = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    return DPOMetrics(
        chosen_rewards=c.sum(),
        rejected_rewards=r.sum(),
        accuracies=(c > r).float().sum(),
        margins=(c - r).sum(),
        chosen_logps=chosen_logps.detach().float().sum(),
        rejected_logps=rejected_logps.detach().float().sum(),
        count=torch.tensor(float(c.numel()), device=c.device),
    )
