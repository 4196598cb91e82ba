"""DPO and its variants as pure functions of sequence log-probs.

Per-pair losses come back unreduced ([B]); the trainer sums them and divides by the number
of pairs in the GLOBAL batch, so a step's loss does not depend on its split across ranks and
accumulation steps (except for the batch-dependent variants `aot`/`aot_pair`, and `bco_pair`
with its optional running mean). Reference-free DPO is the same call with zeros as reference logps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from torch import Tensor

from . import dpo_anchored, dpo_margin
from .dpo_fdiv import check_f_divergence
from .dpo_types import DPOOptions, PairLogps

DPOVariant = Callable[[PairLogps, DPOOptions], Tensor]

DPO_LOSSES: dict[str, DPOVariant] = {
    "sigmoid": dpo_margin.sigmoid,
    "robust": dpo_margin.robust,
    "hinge": dpo_margin.hinge,
    "ipo": dpo_margin.ipo,
    "exo_pair": dpo_margin.exo_pair,
    "nca_pair": dpo_anchored.nca_pair,
    "bco_pair": dpo_anchored.bco_pair,
    "sppo_hard": dpo_anchored.sppo_hard,
    "aot": dpo_margin.aot,
    "aot_pair": dpo_margin.aot_pair,
    "aot_unpaired": dpo_margin.aot_pair,  # TRL 1.x's name for aot_pair
    "apo_zero": dpo_anchored.apo_zero,
    "apo_down": dpo_anchored.apo_down,
    "discopop": dpo_margin.discopop,
    "sft": dpo_anchored.sft,
    "sigmoid_norm": dpo_margin.sigmoid_norm,
}


# Variants whose loss for one pair depends on other pairs of the batch: aot sorts across it.
# bco_pair joins them when it shifts by a running mean that includes this batch's rewards.
BATCH_COUPLED_LOSSES = frozenset({"aot", "aot_pair", "aot_unpaired"})


def pairwise_dpo_losses(loss_type: str | Sequence[str], bco_running_mean: bool = False) -> bool:
    """Whether each pair's loss is a function of that pair's log-probs alone (for every type)."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    coupled = BATCH_COUPLED_LOSSES | ({"bco_pair"} if bco_running_mean else set())
    return not coupled.intersection(types)


class DPOLossOutput(NamedTuple):
    losses: Tensor  # [B] weighted sum over the loss types, per pair, connected to the inputs
    chosen_rewards: Tensor  # [B] beta * (chosen - ref_chosen), detached
    rejected_rewards: Tensor  # [B] beta * (rejected - ref_rejected), detached


def check_dpo_args(
    loss_type: str | Sequence[str],
    *,
    beta: float,
    label_smoothing: float = 0.0,
    loss_weights: Sequence[float] | None = None,
    f_divergence_type: str = "reverse_kl",
    use_weighting: bool = False,
) -> list[tuple[str, float]]:
    """Validates the DPO options (call it from config checks, before training starts).

    Returns:
        The (loss type, weight) pairs, weights defaulting to 1.

    Raises:
        ValueError: naming the offending option and the accepted values.
    """
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    unknown = [t for t in types if t not in DPO_LOSSES]
    if not types or unknown:
        raise ValueError(
            f"Unknown DPO loss_type {unknown or types!r}; valid: {sorted(DPO_LOSSES)}."
        )
    weights = [1.0] * len(types) if loss_weights is None else [float(w) for w in loss_weights]
    if len(weights) != len(types):
        raise ValueError(
            f"loss_weights has {len(weights)} entries for {len(types)} loss types {types}."
        )
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got beta={beta}.")
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5] (an assumed rate of flipped labels: above 0.5, swap "
                         f"chosen and rejected), got {label_smoothing}.")
    if "robust" in types and label_smoothing >= 0.5:
        raise ValueError(
            "loss_type='robust' divides by 1 - 2 * label_smoothing: use label_smoothing < 0.5."
        )
    if "exo_pair" in types and label_smoothing <= 0.0:
        raise ValueError(
            "loss_type='exo_pair' needs label_smoothing > 0 (the EXO paper uses 1e-3)."
        )
    check_f_divergence(types, f_divergence_type)
    sorting = sorted(BATCH_COUPLED_LOSSES.intersection(types))
    if use_weighting and sorting:
        raise ValueError(f"use_weighting=True (WPO) weighs each pair's loss by that pair's weight; loss_type {sorting} "
                         "sorts the pairs across the batch, which would misalign them: use another loss type, or "
                         "use_weighting=False.")
    return list(zip(types, weights))


def dpo_losses(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    loss_type: str | Sequence[str] = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_weights: Sequence[float] | None = None,
    chosen_lengths: Tensor | float | None = None,
    rejected_lengths: Tensor | float | None = None,
    bco_delta: Tensor | float = 0.0,
    discopop_tau: float = 0.05,
    sft_tokens_per_pair: Tensor | float | None = None,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
) -> DPOLossOutput:
    """Per-pair DPO losses, summed over one or more loss types with weights.

    Args:
        chosen_logps: [B] policy log-probs of the chosen completions (sums over tokens).
        rejected_logps: [B] policy log-probs of the rejected completions.
        ref_chosen_logps: [B] reference log-probs of the chosen completions (zeros: reference-free).
        ref_rejected_logps: [B] reference log-probs of the rejected completions.
        loss_type: A key of `DPO_LOSSES`, or several.
        beta: Inverse temperature of the implicit reward, > 0.
        label_smoothing: Label-noise rate for sigmoid/robust/exo_pair/aot/aot_pair, in [0, 0.5].
        loss_weights: One weight per loss type (default 1 each).
        chosen_lengths: [B] (or a scalar) completion tokens of the chosen; needed by ipo, sigmoid_norm and sft.
        rejected_lengths: [B] (or a scalar) completion tokens of the rejected; needed by ipo and sigmoid_norm.
        bco_delta: Running reward mean for bco_pair (see `bco_reward_mean`).
        discopop_tau: DiscoPOP's gate temperature.
        sft_tokens_per_pair: the `sft` term's divisor over a whole optimizer step (see
            `DPOOptions`); None: the batch's mean chosen length (TRL's token mean over the batch).
        f_divergence_type, f_alpha_divergence_coef: the divergence to the reference (`dpo_fdiv`).

    Returns:
        DPOLossOutput with losses [B] = sum_k weight_k * loss_k and detached rewards [B].
    """
    plan = check_dpo_args(loss_type, beta=beta, label_smoothing=label_smoothing, loss_weights=loss_weights,
                          f_divergence_type=f_divergence_type)
    pairs = PairLogps(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
        chosen_lengths, rejected_lengths,
    )
    opts = DPOOptions(beta, label_smoothing, bco_delta, discopop_tau, sft_tokens_per_pair, f_divergence_type,
                      f_alpha_divergence_coef)
    return pair_losses(pairs, plan, opts)


def pair_losses(pairs: PairLogps, plan: Sequence[tuple[str, float]], opts: DPOOptions) -> DPOLossOutput:
    """`dpo_losses` for options already validated (`plan` from `check_dpo_args`, once, by the config)."""
    losses = sum(weight * DPO_LOSSES[name](pairs, opts) for name, weight in plan)
    return DPOLossOutput(
        losses=losses,
        chosen_rewards=(opts.beta * pairs.chosen_logratios).detach(),
        rejected_rewards=(opts.beta * pairs.rejected_logratios).detach(),
    )
