"""GRPO advantages: rewards of a generation batch -> one advantage per completion.

The rewards are those of the WHOLE generation batch, gathered over ranks in the sampler's
order (each prompt's `num_generations` completions contiguous, groups possibly spanning
ranks); every rank computes the same advantages and keeps its own slice. The arithmetic is
TRL 1.16's (`_generate_and_score_completions`), NaN-aware: a reward function returns None
where it does not apply (NaN here); a completion no function scored is NaN throughout and
gets advantage 0, so it neither moves the policy nor the group's baseline.

Paper: https://huggingface.co/papers/2402.03300 (GRPO, group-relative advantages); the
batch scale is PPO-Lite's, normalize_then_sum is GDPO's (as TRL names them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
STD_EPS = 1e-4  # TRL's: advantages are divided by (std + 1e-4)


class Advantages(NamedTuple):
    """What `group_advantages` returns for the N completions of a generation batch.

    Attributes:
        advantages: [N] float32, 0 where no reward function scored the completion.
        rewards: [N] float32, the weighted sum of the rewards (NaN where none scored it):
            the `reward` TRL logs (its mean and std).
        std_is_zero: [N] bool, whether the std the completion was scaled by is 0
            (TRL's `frac_reward_zero_std` is its mean).
    """

    advantages: Tensor
    rewards: Tensor
    std_is_zero: Tensor


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Sample std (Bessel-corrected) over the non-NaN values; NaN where fewer than 2 exist."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    std = torch.where(count > 1, var, torch.full_like(var, float("nan"))).sqrt()
    return std if keepdim else std.squeeze(dim)


def _check(rewards: Tensor, weights: Tensor, num_generations: int, scale_rewards: str, aggregation: str) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, K] (completions x reward functions), got shape {tuple(rewards.shape)}")
    if weights.shape != (rewards.shape[1],):
        raise ValueError(f"weights must have one value per reward function ({rewards.shape[1]}), got {tuple(weights.shape)}")
    if num_generations < 1 or rewards.shape[0] % num_generations:
        raise ValueError(
            f"the generation batch has {rewards.shape[0]} completions, not a multiple of num_generations={num_generations}"
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _batch_std(x: Tensor) -> Tensor:
    return nanstd(x).expand_as(x) if x.numel() > 1 else torch.zeros_like(x)


def group_advantages(
    rewards: Tensor,
    weights: Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> Advantages:
    """Group-relative advantages of a generation batch, TRL 1.16's arithmetic.

    Args:
        rewards: [N, K] float, reward of each completion by each function, NaN for None;
            rows in the sampler's order (each group's completions contiguous).
        weights: [K] float, `reward_weights`.
        num_generations: G, completions per prompt (the group size).
        scale_rewards: "group" (divide by the group's std + 1e-4), "batch" (by the
            batch's std + 1e-4) or "none".
        aggregation: "sum_then_normalize": r = nansum_k w_k r_k, A = r - nanmean_group(r),
            scaled as above. "normalize_then_sum" (GDPO): each function z-scored within
            the group (std + 1e-4), weighted and summed, then z-scored over the batch.

    Formula (sum_then_normalize, scale "group"):
        A_i = (r_i - nanmean_{j in g(i)} r_j) / (nanstd_{j in g(i)} r_j + 1e-4), NaN -> 0
    """
    rewards = rewards.float()
    weights = weights.to(rewards)
    _check(rewards, weights, num_generations, scale_rewards, aggregation)
    unscorable = torch.isnan(rewards).all(dim=1)  # [N]
    G = num_generations
    if aggregation == "sum_then_normalize":
        total = (rewards * weights).nansum(dim=1).masked_fill(unscorable, float("nan"))  # [N]
        mean = torch.nanmean(total.view(-1, G), dim=1).repeat_interleave(G)
        if scale_rewards == "batch":
            std = _batch_std(total)
        elif G > 1:  # "group", and "none" (whose std only feeds frac_reward_zero_std)
            std = nanstd(total.view(-1, G), dim=1).repeat_interleave(G)
        else:
            std = torch.zeros_like(total)
        advantages = total - mean
        if scale_rewards != "none":
            advantages = advantages / (std + STD_EPS)
    else:
        grouped = rewards.view(-1, G, rewards.shape[1])  # [N/G, G, K]
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if G > 1 else torch.zeros_like(mean_k)
        z = ((grouped - mean_k) / (std_k + STD_EPS)).view(-1, rewards.shape[1])
        summed = (z * weights).nansum(dim=1).masked_fill(unscorable, float("nan"))
        std = _batch_std(summed)
        advantages = (summed - torch.nanmean(summed)) / (std + STD_EPS)
    logged = (rewards * weights).nansum(dim=1).masked_fill(unscorable, float("nan"))
    std_is_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), logged, std_is_zero)
