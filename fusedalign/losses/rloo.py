"""RLOO: leave-one-out advantages, with the KL to the reference folded into the reward, and a
PPO-clipped loss on each completion's whole-sequence ratio (TRL 1.16's `RLOOTrainer`).

Two pure functions. `rloo_advantages` takes the rewards of the whole generation batch (every
rank, in the sampler's order) and each completion's summed KL; `rloo_loss` returns the
micro-batch's loss as a SUM over its sequences, which the trainer's base divides by the
sequences of the optimizer step on every rank: TRL's mean per micro-batch, then over the
accumulation steps, when micro-batches have equal row counts (they do: the rollout cuts them so).

Paper: https://huggingface.co/papers/2402.14740 (Ahmadian et al., 2024, "Back to Basics:
REINFORCE Style Optimization", RLOO; Kool et al., 2019, the leave-one-out baseline).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .grpo_advantages import STD_EPS, Advantages, nanstd
from .grpo_metrics import GRPOLossMetrics, clip_statistics, token_mean


def rloo_advantages(rewards: Tensor, weights: Tensor, num_generations: int, sequence_kl: Tensor | None = None, *,
                    beta: float = 0.0, reward_clip_range: tuple[float, float] | None = None,
                    normalize_advantages: bool = False) -> Advantages:
    """Leave-one-out advantages of a generation batch, TRL 1.16's arithmetic (NaN-aware as GRPO's).

    Args:
        rewards: [N, K] reward of each completion by each function, NaN for None; each group's
            G completions contiguous.
        weights: [K] `reward_weights`.
        num_generations: G.
        sequence_kl: [N] sum over each completion's loss tokens of (policy - reference)
            log-probs at generation (first-order, may be negative); required when beta != 0.
        beta: the KL coefficient.
        reward_clip_range: (min, max) clamp of the weighted reward, before the KL.
        normalize_advantages: z-score the advantages over the generation batch (std + 1e-4).

    Formula:
        r_i = clip(sum_k w_k r_ik) - beta * KL_i
        A_i = r_i - (sum_{j in g(i), j != i} r_j) / (n_g - 1)   (n_g: scored completions of the group)
        A = (A - mean A) / (std A + 1e-4) if normalize_advantages; NaN (unscored, lone) -> 0
    """
    rewards = rewards.float()
    unscorable = torch.isnan(rewards).all(dim=1)  # [N]
    logged = (rewards * weights.to(rewards)).nansum(dim=1).masked_fill(unscorable, float("nan"))
    total = logged if reward_clip_range is None else logged.clamp(*reward_clip_range)
    if beta != 0.0:
        if sequence_kl is None:
            raise ValueError("beta != 0 needs each completion's summed KL (sequence_kl)")
        total = total - beta * sequence_kl.to(total)
    G = num_generations
    grouped = total.view(-1, G)  # [N/G, G]
    if G > 1:
        scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        baseline = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
        advantages = (grouped - baseline).view(-1)
        std = nanstd(grouped, dim=1).repeat_interleave(G)
    else:  # evaluation with num_generations_eval=1: no sibling, no signal
        advantages, std = torch.zeros_like(total), torch.zeros_like(total)
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPS)
    std_is_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), logged, std_is_zero)


class RLOOLossOutput(NamedTuple):
    """Attributes: loss_sum (0-dim, with gradient), items (0-dim: the micro-batch's rows), metrics."""

    loss_sum: Tensor
    items: Tensor
    metrics: GRPOLossMetrics


def rloo_loss(logps: Tensor, mask: Tensor, advantages: Tensor, *, old_logps: Tensor | None = None,
              epsilon: float = 0.2, epsilon_high: float | None = None,
              entropy: Tensor | None = None) -> RLOOLossOutput:
    """The micro-batch's RLOO loss, summed over its sequences.

    Args:
        logps: [B, T] policy log-probs of the completion tokens (with gradient).
        mask: [B, T] the loss tokens (truncated rows off with mask_truncated_completions).
        advantages: [B] leave-one-out advantages (`rloo_advantages`).
        old_logps: [B, T] the generating policy's log-probs, or None: logps.detach() (r == 1).
        epsilon, epsilon_high: the clip range [1 - epsilon, 1 + epsilon_high] (None: epsilon).
        entropy: [B, T] per-token entropy, for the `entropy` metric only.

    Formula:
        r_i = exp(sum_t m_it (logp_it - logp_old_it))
        L = sum_i -min(r_i A_i, clip(r_i, 1 - eps, 1 + eps_high) A_i)
    """
    m = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(((logps - old) * m).sum(-1))  # [B]
    high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.to(ratio.dtype)
    per_sequence = -torch.min(ratio * adv, ratio.clamp(1 - epsilon, 1 + high) * adv)
    clip = clip_statistics(ratio.detach()[:, None], adv[:, None], mask, 1 - epsilon, 1 + high, per_sequence=True)
    metrics = GRPOLossMetrics(entropy=None if entropy is None else token_mean(entropy, mask), **clip)
    return RLOOLossOutput(per_sequence.sum(), torch.tensor(float(mask.shape[0]), device=mask.device), metrics)
