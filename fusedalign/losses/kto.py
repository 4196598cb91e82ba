"""KTO and its unpaired APO variant as pure functions of sequence log-probs.

Losses come back per example ([B], weights applied); the trainer sums them and divides by the
number of examples in the GLOBAL batch. The KL reference point z0 comes in already estimated,
averaged over ranks and clamped: see `kto_stats.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .kto_stats import KTOMetrics


class KTOBranches(NamedTuple):
    desirable: Tensor  # [B] the loss if the example were desirable
    undesirable: Tensor  # [B] the loss if the example were undesirable


def kto(logratios: Tensor, kl: Tensor, beta: float) -> KTOBranches:
    """KTO with a detached KL reference point z0.

    Paper: https://huggingface.co/papers/2402.01306 (Eq. 7)

    Formula:
        r = log pi(y|x) - log pi_ref(y|x)
        desirable:   1 - sigma(beta * (r - z0))
        undesirable: 1 - sigma(beta * (z0 - r))
    """
    return KTOBranches(
        desirable=1 - torch.sigmoid(beta * (logratios - kl)),
        undesirable=1 - torch.sigmoid(beta * (kl - logratios)),
    )


def apo_zero_unpaired(logratios: Tensor, kl: Tensor, beta: float) -> KTOBranches:
    """APO-zero for unpaired data (z0 unused): raise desirable, lower undesirable likelihoods.

    Paper: https://huggingface.co/papers/2408.06266 (unpaired form of Eq. 7)

    Formula:
        desirable:   1 - sigma(beta * r)
        undesirable: sigma(beta * r)
    """
    return KTOBranches(
        desirable=1 - torch.sigmoid(beta * logratios), undesirable=torch.sigmoid(beta * logratios)
    )


KTO_LOSSES: dict[str, Callable[[Tensor, Tensor, float], KTOBranches]] = {
    "kto": kto,
    "apo_zero_unpaired": apo_zero_unpaired,
}


class KTOLossOutput(NamedTuple):
    losses: Tensor  # [B] weighted per-example losses, connected to policy_logps
    rewards: Tensor  # [B] beta * (policy - ref), detached
    desirable: Tensor  # [B] bool, which rewards are "chosen" (True) or "rejected" (False)


def check_kto_args(
    loss_type: str, *, beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
) -> None:
    """Validates the KTO options; raises ValueError naming the option and what is accepted."""
    if loss_type not in KTO_LOSSES:
        raise ValueError(f"Unknown KTO loss_type {loss_type!r}; valid: {sorted(KTO_LOSSES)}.")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got beta={beta}.")
    weights = {"desirable_weight": desirable_weight, "undesirable_weight": undesirable_weight}
    for name, w in weights.items():
        if not w >= 0:
            raise ValueError(f"{name} must be >= 0, got {name}={w}.")


def kto_losses(
    policy_logps: Tensor,
    ref_logps: Tensor,
    kl: Tensor | float,
    desirable: Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> KTOLossOutput:
    """Per-example KTO losses; a batch of one class only is fine (no NaN, graph connected).

    Args:
        policy_logps: [B] policy log-probs of the completions (sums over tokens).
        ref_logps: [B] reference log-probs of the same completions.
        kl: scalar z0, already rank-averaged and clamped (`kto_stats.kl_from_sums`); detached
            here, so it only shifts the losses.
        desirable: [B] bool, True for desirable (label True) examples.
        beta: Inverse temperature, > 0.
        desirable_weight: Weight of the desirable losses (lambda_D).
        undesirable_weight: Weight of the undesirable losses (lambda_U).
        loss_type: A key of `KTO_LOSSES`.

    Returns:
        KTOLossOutput; the trainer divides `losses.sum()` by the global number of examples.
    """
    check_kto_args(
        loss_type, beta=beta, desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
    )
    if desirable.dtype != torch.bool:
        raise ValueError(f"desirable must be a bool tensor (the labels), got {desirable.dtype}.")
    return example_losses(policy_logps, ref_logps, kl, desirable, KTOOptions(beta, desirable_weight, undesirable_weight,
                                                                             loss_type))


class KTOOptions(NamedTuple):
    """KTO's options, validated once by the config (`check_kto_args`)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"


def example_losses(policy_logps: Tensor, ref_logps: Tensor, kl: Tensor | float, desirable: Tensor,
                   opts: KTOOptions) -> KTOLossOutput:
    """`kto_losses` for validated options and bool labels."""
    kl = torch.as_tensor(kl, dtype=policy_logps.dtype, device=policy_logps.device).detach()
    logratios = policy_logps - ref_logps  # [B]
    branch = KTO_LOSSES[opts.loss_type](logratios, kl, opts.beta)
    # where() routes each example to its branch; the other branch gets a zero gradient.
    losses = torch.where(
        desirable, opts.desirable_weight * branch.desirable, opts.undesirable_weight * branch.undesirable
    )
    return KTOLossOutput(losses, (opts.beta * logratios).detach(), desirable)


def kto_batch_loss(policy_logps: Tensor, ref_logps: Tensor, kl: Tensor, desirable: Tensor, valid: Tensor,
                   opts: KTOOptions, **stats: Tensor) -> tuple[Tensor, "KTOMetrics"]:
    """One KTO micro-batch: the sum of its valid examples' losses and its metrics.

    Args:
        policy_logps: [B] policy sequence log-probs, with gradient.
        ref_logps: [B] reference sequence log-probs.
        kl: scalar z0 of the optimizer step.
        desirable: [B] bool labels.
        valid: [B] bool, examples with a completion token (the others contribute zero but
            stay in the graph).
        **stats: `logit_sums`, `entropy_sums`, `tokens` [B] for the metrics (`kto_metrics`).
    """
    from .kto_stats import kto_metrics

    result = example_losses(policy_logps, ref_logps.to(policy_logps), kl, desirable.bool(), opts)
    loss_sum = (result.losses * valid.to(result.losses.dtype)).sum()
    # A loss type without z0 (apo_zero_unpaired) logs kl 0, as TRL does.
    z0 = kl if opts.loss_type == "kto" else torch.zeros((), dtype=policy_logps.dtype, device=policy_logps.device)
    return loss_sum, kto_metrics(result.rewards, policy_logps, result.desirable, valid, z0, **stats)
