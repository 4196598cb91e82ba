"""What DPO reports, typed (`fusedalign.metrics`), and bco_pair's running reward mean.

Every value is per pair (`[B]`) with the pair's validity as its count, so that the same
metrics serve training and evaluation (where rows repeated across ranks are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from fusedalign.metrics import Mean, MetricSet, logged_as


@dataclass(frozen=True)
class DPOMetrics(MetricSet):
    """Means over the pairs with something to score (`logits/*`: over their completion tokens)."""

    chosen_rewards: Mean = logged_as("rewards/chosen")
    rejected_rewards: Mean = logged_as("rewards/rejected")
    accuracies: Mean = logged_as("rewards/accuracies")
    margins: Mean = logged_as("rewards/margins")
    chosen_logps: Mean = logged_as("logps/chosen")
    rejected_logps: Mean = logged_as("logps/rejected")
    chosen_logits: Mean | None = logged_as("logits/chosen")
    rejected_logits: Mean | None = logged_as("logits/rejected")
    entropy: Mean | None = logged_as("entropy")  # over chosen and rejected completion tokens
    accuracy: Mean | None = logged_as("mean_token_accuracy")  # argmax == label, chosen tokens


def dpo_metrics(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    valid: Tensor | None = None,
    *,
    chosen_logit_sums: Tensor | None = None,
    rejected_logit_sums: Tensor | None = None,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
    entropy_sums: Tensor | None = None,
    chosen_correct: Tensor | None = None,
) -> DPOMetrics:
    """The metrics users know (rewards/*, logps/*, logits/*), per pair.

    Args:
        chosen_rewards, rejected_rewards: [B] beta * log-ratios (`DPOLossOutput`).
        chosen_logps, rejected_logps: [B] policy sequence log-probs.
        valid: [B] bool, pairs with a completion token on both sides (default: all).
        chosen_logit_sums, rejected_logit_sums: [B] sums over completion tokens of each
            position's mean logit, with `chosen_tokens`/`rejected_tokens` [B] their token
            counts (logits/* are token means, as TRL's).
        entropy_sums: [2B] per-row sums of the entropy over completion tokens (chosen rows,
            then rejected): `entropy` is their token mean over both, as TRL's.
        chosen_correct: [B] chosen completion tokens whose argmax is the label:
            `mean_token_accuracy`, a token mean over the chosen tokens, as TRL's.
    """
    c, r = chosen_rewards.detach().double(), rejected_rewards.detach().double()
    v = torch.ones_like(c) if valid is None else valid.double()

    def mean(x: Tensor) -> Mean:
        return Mean(x.detach().double() * v, v)

    logits_c = logits_r = None
    if chosen_logit_sums is not None:
        logits_c = Mean(chosen_logit_sums.detach().double(), chosen_tokens.double())
        logits_r = Mean(rejected_logit_sums.detach().double(), rejected_tokens.double())
    entropy = accuracy = None
    if entropy_sums is not None:
        half = entropy_sums.shape[0] // 2
        entropy = Mean(entropy_sums[:half].double() + entropy_sums[half:].double(),
                       chosen_tokens.double() + rejected_tokens.double())
    if chosen_correct is not None:
        accuracy = Mean(chosen_correct.double(), chosen_tokens.double())
    return DPOMetrics(
        chosen_rewards=mean(c), rejected_rewards=mean(r), accuracies=mean((c > r).double()), margins=mean(c - r),
        chosen_logps=mean(chosen_logps), rejected_logps=mean(rejected_logps),
        chosen_logits=logits_c, rejected_logits=logits_r, entropy=entropy, accuracy=accuracy,
    )


class RewardMean(NamedTuple):
    """Sum and count of rewards (fp32): all-reduce (sum), then `mean = sum / count`."""

    sum: Tensor  # scalar, detached
    count: Tensor  # scalar

    @property
    def mean(self) -> Tensor:
        return self.sum / self.count.clamp(min=1)


def bco_reward_mean(chosen_rewards: Tensor, rejected_rewards: Tensor) -> RewardMean:
    """This batch's mean reward over chosen and rejected, the update of `RunningRewardMean`.

    Args:
        chosen_rewards: [B] beta * chosen log-ratios (e.g. `DPOLossOutput.chosen_rewards`).
        rejected_rewards: [B] beta * rejected log-ratios.
    """
    rewards = torch.cat([chosen_rewards, rejected_rewards]).detach().float()  # [2B]
    return RewardMean(rewards.sum(), torch.tensor(float(rewards.numel()), device=rewards.device))


class RunningRewardMean:
    """bco_pair's reward shift delta: the mean of every reward seen so far (BCO paper, Eq. 12).

    The trainer adds each batch's sums, reduced over ranks; the state goes into every
    checkpoint (`state_dict`), so a resumed run shifts by the same delta.
    """

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0.0

    @property
    def delta(self) -> float:
        return self.total / self.count if self.count else 0.0

    def update(self, total: float, count: float) -> None:
        self.total += float(total)
        self.count += float(count)

    def state_dict(self) -> dict[str, float]:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.total, self.count = float(state["total"]), float(state["count"])
