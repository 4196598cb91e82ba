"""On-policy distillation loss: the generalised JSD per completion token, over a GLOBAL token count.

Paper: On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes
(Agarwal et al., 2023), https://huggingface.co/papers/2306.13649 — the generalised JSD of GKD.

Formula (TRL's `DistillationTrainer` and `DistillationConfig` at huggingface/trl 02061a9 / 07d63cd,
read 2026-12-04; beta defaults to 1, temperature to 1; D from `ops/divergence.py`):

    p = softmax(z_student / T),  q = softmax(z_teacher / T)      (after each model's softcap / scale)
    D_t = KL(q || p)                               beta = 0   (forward KL)
    D_t = KL(p || q)                               beta = 1   (reverse KL, TRL's default)
    D_t = beta KL(q || m) + (1 - beta) KL(p || m), m = (1 - beta) p + beta q   (otherwise)
    loss = sum_{t in completion tokens} D_t / num_items_in_batch

num_items_in_batch is the number of completion tokens of the whole generation batch (all ranks,
all accumulation steps), so that any split trains as one batch; TRL divides it by the
process count and lets DDP average, which is the same. TRL logs the student's mean per-token
entropy at T (nats) as `entropy`: the same mean over the same tokens here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fusedalign.metrics import Mean, MetricSet, logged_as


def distillation_loss(divergence: Tensor, mask: Tensor, num_tokens: Tensor | int | float) -> Tensor:
    """The summed divergence of the scored tokens over a global token count.

    Args:
        divergence: [B, T] or [N] per-token D (`distill_head.token_divergence`).
        mask: same shape, True where a completion token is scored.
        num_tokens: scored tokens in the global batch; values < 1 count as 1 (nothing to
            score gives 0, not NaN).

    Returns:
        Scalar loss, connected to `divergence` even when `mask` is all False.
    """
    picked = torch.where(mask.bool(), divergence, divergence.new_zeros(()))
    denom = torch.as_tensor(num_tokens, dtype=divergence.dtype, device=divergence.device)
    return picked.sum() / denom.clamp(min=1)


@dataclass(frozen=True)
class DistillationMetrics(MetricSet):
    """Token means over the scored tokens, per example (`[B]`)."""

    entropy: Mean = logged_as("entropy")


def distillation_batch_loss(divergence: Tensor, mask: Tensor, entropy: Tensor) -> tuple[Tensor, DistillationMetrics]:
    """One micro-batch: the divergence SUM of its scored tokens (the trainer divides by the step's
    global token count) and the student's entropy, per example.

    Args:
        divergence, entropy: [B, T] per token (entropy detached); mask: [B, T] scored tokens.
    """
    mask = mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    per_row = lambda x: torch.where(mask, x.detach().double(), zero).sum(-1)  # noqa: E731
    return distillation_loss(divergence, mask, 1), DistillationMetrics(Mean(per_row(entropy), mask.double().sum(-1)))
