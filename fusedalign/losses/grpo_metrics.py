"""GRPO's metrics as typed statistics: the names TRL 1.16 logs, each with its reduction.

Every value is per example (`[B]`: sums and counts of each completion), so they reduce
exactly over micro-batches, ranks and a logging window, and evaluation can drop the rows
accelerate repeats. Where TRL averages per-micro-batch values over the window (its token
means, the min/max of clip ratios, reward means per generation batch), these are the
statistics of the whole window: the same numbers when every micro-batch holds the same
number of tokens, and the exact window value otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Iterator

import torch
from torch import Tensor

from fusedalign.metrics import Max, Mean, MetricSet, Min, Stat, Std


def token_mean(x: Tensor, mask: Tensor, per_sequence: bool = False) -> Mean:
    """Mean over the masked tokens of `x` [B, T]; with `per_sequence`, `x` [B, 1] holds one value per
    sequence and each row counts once. (Said, not read from the shape: a micro-batch whose longest
    completion has one token has per-token values [B, 1] too.)"""
    x = x.detach().double()
    if per_sequence:
        return Mean(x[:, 0], torch.ones_like(x[:, 0]))
    m = mask.double()
    return Mean((x * m).sum(-1), m.sum(-1))


def sequence_means(x: Tensor, mask: Tensor, per_sequence: bool = False) -> Tensor:
    """[B] masked mean of `x` per sequence (NaN for a row with no token); with `per_sequence`, `x` [B, 1]
    is taken as is."""
    x = x.detach().double()
    if per_sequence:
        return x[:, 0]
    m = mask.double()
    return (x * m).sum(-1) / m.sum(-1)


def _optional(name: str):
    return field(default=None, metadata={"name": name})


@dataclass(frozen=True)
class GRPOLossMetrics(MetricSet):
    """What TRL logs from the loss. Fields a loss type does not define are None."""

    kl: Mean | None = _optional("kl")
    entropy: Mean | None = _optional("entropy")
    low_mean: Mean | None = _optional("clip_ratio/low_mean")
    low_min: Min | None = _optional("clip_ratio/low_min")
    high_mean: Mean | None = _optional("clip_ratio/high_mean")
    high_max: Max | None = _optional("clip_ratio/high_max")
    region_mean: Mean | None = _optional("clip_ratio/region_mean")
    cispo_clip_ratio: Mean | None = _optional("cispo_clip_ratio")
    vespo_phi_seq_mean: Mean | None = _optional("vespo/phi_seq_mean")
    # With an entropy bonus: the entropy it sums (over its tokens) per loss token, so that the bonus taken
    # off the loss is entropy_coef x this; the trainer logs TRL's `policy_loss` (the loss without it).
    bonus_entropy: Mean | None = _optional("bonus_entropy")


def clip_statistics(capped: Tensor, advantages: Tensor, mask: Tensor, low: float, high: float,
                    per_sequence: bool) -> dict:
    """TRL's clip ratios of the PPO-clip family, from the (delta-capped) ratio.

    Args:
        capped: [B, T], or [B, 1] with `per_sequence` (a sequence-level ratio), r after the two-sided cap
            (TRL tests the capped ratio).
        advantages: [B, 1].
        mask: [B, T].
        low, high: 1 - eps_low and 1 + eps_high.
    """
    low_clip = ((capped < low) & (advantages < 0)).float()
    high_clip = ((capped > high) & (advantages > 0)).float()
    region = torch.maximum(low_clip, high_clip)
    low_seq, high_seq = sequence_means(low_clip, mask, per_sequence), sequence_means(high_clip, mask, per_sequence)
    return {
        "low_mean": token_mean(low_clip, mask, per_sequence),
        "high_mean": token_mean(high_clip, mask, per_sequence),
        "region_mean": token_mean(region, mask, per_sequence),
        # Rows with no token have no ratio: +inf / -inf mark "nothing here" (TRL: nanmin/nanmax).
        "low_min": Min(torch.nan_to_num(low_seq, nan=float("inf"))),
        "high_max": Max(torch.nan_to_num(high_seq, nan=float("-inf"))),
    }


@dataclass(frozen=True)
class RewardMetrics(MetricSet):
    """Rewards of the completions on this rank (record each rank's own rows, never the gathered batch).

    Build with `RewardMetrics.of`. Logged: `reward`, `reward_std`, `frac_reward_zero_std`, and
    `rewards/<function>/mean` and `/std` for each reward function (NaN rewards excluded). A
    function that scored no completion of the logging window is logged as None, as TRL logs
    it; so are `reward` and `reward_std` when none scored at all.
    """

    logged_when_empty: ClassVar[tuple[str, ...]] = ("reward", "reward_std", "rewards/*")

    reward: Mean
    reward_std: Std
    frac_reward_zero_std: Mean
    per_function: tuple[tuple[str, Mean, Std], ...] = ()

    @classmethod
    def of(cls, rewards_per_func: Tensor, rewards: Tensor, std_is_zero: Tensor, names: list[str]) -> "RewardMetrics":
        """From this rank's rows of a generation batch.

        Args:
            rewards_per_func: [n, K] float, NaN where a function returned None.
            rewards: [n] weighted sums (`Advantages.rewards`), NaN where none scored.
            std_is_zero: [n] bool (`Advantages.std_is_zero`).
            names: the K reward functions' names.
        """
        funcs = []
        for k, name in enumerate(names):
            col = rewards_per_func[:, k].detach().double()
            ok = ~torch.isnan(col)
            funcs.append((name, Mean(torch.where(ok, col, 0.0), ok.double()), Std.of(torch.where(ok, col, 0.0), ok)))
        r = rewards.detach().double()
        ok = ~torch.isnan(r)
        safe = torch.where(ok, r, 0.0)
        zero = std_is_zero.double()
        return cls(Mean(safe, ok.double()), Std.of(safe, ok), Mean(zero, torch.ones_like(zero)), tuple(funcs))

    def stats(self) -> Iterator[tuple[str, Stat]]:
        yield "reward", self.reward
        yield "reward_std", self.reward_std
        yield "frac_reward_zero_std", self.frac_reward_zero_std
        for name, mean, std in self.per_function:
            yield f"rewards/{name}/mean", mean
            yield f"rewards/{name}/std", std
