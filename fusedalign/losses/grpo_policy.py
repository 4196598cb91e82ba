"""GRPO's per-token policy terms, one function per loss family (TRL 1.16's `_compute_loss`).

Every term maps `(PolicyInputs, GRPOOptions)` to the per-token loss `L` before masks,
`[B, T]`, or `[B, 1]` when the importance weight is per sequence and the term has no
per-token factor (it broadcasts over the completion when masked). `grpo.GRPO_POLICY_TERMS`
lists them by `loss_type`. The ratio r is exp(logp - old_logp) per token, or, at the
sequence level (GSPO), exp of the masked mean of the per-token log-ratios; old_logp is
logp.detach() when no old log-probs were computed, so r == 1 with the gradient of logp.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .grpo_options import CLIPPED, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, GRPOOptions  # noqa: F401 (re-exported)


class PolicyInputs(NamedTuple):
    """Tensors the policy terms read.

    Attributes:
        logps: [B, T] log-probs of the completion tokens under the policy (with gradient).
        advantages: [B, 1] advantages.
        mask: [B, T] float, the tokens that count.
        log_ratio: [B, T] logps - old_logps.
        coef: [B, T] (token level) or [B, 1] (sequence level), the importance weight r.
        is_ratio: the generator's importance-sampling weight ([B, T] or [B, 1]) or None.
    """

    logps: Tensor
    advantages: Tensor
    mask: Tensor
    log_ratio: Tensor
    coef: Tensor
    is_ratio: Tensor | None


def importance_weights(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """r = exp(log_ratio) per token [B, T], or exp(masked mean of log_ratio) per sequence [B, 1]."""
    if level == "sequence":
        return torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
    return torch.exp(log_ratio)


def capped_ratio(coef: Tensor, o: GRPOOptions) -> Tensor:
    """The unclipped branch's ratio: r, capped at delta when the two-sided clip is on."""
    return coef if o.delta is None else torch.clamp(coef, max=o.delta)


def _by_sign(cond: Tensor, pos: float, neg: float, like: Tensor) -> Tensor:
    # torch.where with Python scalars would compute in float32 whatever the inputs' dtype.
    return torch.where(cond, torch.full_like(like, pos), torch.full_like(like, neg))


def clipped(p: PolicyInputs, o: GRPOOptions) -> Tensor:
    """PPO's clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo differ only in aggregation).

    Paper: https://huggingface.co/papers/2402.03300 (GRPO); DAPO's epsilon_high:
    https://huggingface.co/papers/2503.14476; two-sided clip (delta): INTELLECT-2.

    Formula:
        L = -min(min(r, delta) * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    """
    clipped_coef = torch.clamp(p.coef, 1 - o.epsilon_low, 1 + o.eps_high)
    return -torch.min(capped_ratio(p.coef, o) * p.advantages, clipped_coef * p.advantages)


def cispo(p: PolicyInputs, o: GRPOOptions) -> Tensor:
    """CISPO: clip the importance weight, not the update; the gradient flows through log p.

    Paper: https://huggingface.co/papers/2506.13585 (MiniMax-M1)

    Formula:
        L = -sg(min(r, eps_high)) * A * logp
    """
    return -torch.clamp(p.coef, max=o.eps_high).detach() * p.advantages * p.logps


def sapo(p: PolicyInputs, o: GRPOOptions) -> Tensor:
    """SAPO: a smooth sigmoid gate in place of the hard clip, sharper for negative advantages.

    Paper: https://huggingface.co/papers/2511.20347

    Formula:
        tau = tau_pos if A > 0 else tau_neg;  L = -sigmoid(tau * (r - 1)) * 4 / tau * A
    """
    tau = _by_sign(p.advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg, p.advantages)
    return -torch.sigmoid(tau * (p.coef - 1)) * 4 / tau * p.advantages


@torch.no_grad()
def vespo_weights(p: PolicyInputs, o: GRPOOptions) -> Tensor:
    """VESPO's detached gamma weight phi(w) of the sequence ratio w, [B, 1].

    Formula:
        log w = clamp(sum_t m * clamp(log r_t, -20, 20) (+ sum_t log is_ratio), log 1e-8, 20)
        phi(w) = exp(lambda + k log w - lambda w), (k, lambda) by the sign of A; nan/inf -> 0
    """
    floor = math.log(1e-8)
    seq = (torch.clamp(p.log_ratio, -20.0, 20.0) * p.mask).sum(-1, keepdim=True)
    if p.is_ratio is not None:
        seq = seq + torch.clamp(torch.log(p.is_ratio), floor, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, floor, 20.0)
    nonneg = p.advantages >= 0
    k = _by_sign(nonneg, o.vespo_k_pos, o.vespo_k_neg, log_w)
    lam = _by_sign(nonneg, o.vespo_lambda_pos, o.vespo_lambda_neg, log_w).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo(p: PolicyInputs, o: GRPOOptions) -> Tensor:
    """VESPO: a soft, asymmetric gamma weight of the sequence ratio scales the log-prob gradient.

    Paper: https://huggingface.co/papers/2602.10693

    Formula:
        L = -phi(w) * A * logp   (phi detached; the generator's IS weight is folded into w)
    """
    return -vespo_weights(p, o) * p.advantages * p.logps


def k3_kl(logps: Tensor, ref_logps: Tensor, coef: Tensor | None) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref), [B, T], times r when bias-corrected.

    Formula:
        kl = exp(ref - logp) - (ref - logp) - 1;  kl *= r (differentiable) with use_bias_correction_kl
    """
    d = ref_logps - logps
    kl = torch.exp(d) - d - 1
    return kl if coef is None else kl * coef
