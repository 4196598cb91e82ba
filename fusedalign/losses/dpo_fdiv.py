"""f-DPO: the divergence to the reference, chosen by the function that scores each log-ratio.

DPO's implicit reward beta * log(pi/pi_ref) comes from a reverse-KL penalty; another
f-divergence gives the reward beta * f'(pi/pi_ref), and the losses built on the chosen-rejected
reward difference take these scores where they took the log-ratios (TRL 1.16's
`f_divergence_type`). The reparameterisation leaves a beta * log Z(x) term that cancels only in
that difference, so the variants that score one completion against 0 or a shift (nca_pair,
bco_pair, sppo_hard, apo_*) or sort across the batch (aot*) have no f-divergence form and are
refused with another divergence; `sft` does not read the log-ratios and accepts any.
The reported rewards stay beta * log-ratio, as TRL's.

Paper: https://huggingface.co/papers/2309.16240 (f-DPO, Table 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .dpo_types import DPOOptions, PairLogps

# The loss types whose loss is a function of the chosen-rejected score difference (and sft).
F_DIVERGENCE_LOSS_TYPES = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"})


def reverse_kl(logratios: Tensor, coef: float) -> Tensor:
    """DPO's own divergence. Formula: f'(u) = log u,  score = logratio"""
    return logratios


def forward_kl(logratios: Tensor, coef: float) -> Tensor:
    """Formula: f'(u) = 1 - 1/u,  score = 1 - exp(-logratio)"""
    return 1 - torch.exp(-logratios)


def js_divergence(logratios: Tensor, coef: float) -> Tensor:
    """Jensen-Shannon. Formula: f'(u) = log(2u / (1 + u)),  score = log 2 + log sigma(logratio)"""
    return math.log(2) + F.logsigmoid(logratios)


def alpha_divergence(logratios: Tensor, coef: float) -> Tensor:
    """alpha-divergence; alpha = 1 (within 1e-6) is its limit, the reverse KL.

    The exponent is clamped (at 80; 11 in float16) and exponentiated in at least float32, as
    TRL's, so that the score stays finite in the log-ratios' dtype.

    Formula: f'(u) = (u^(alpha-1) - 1) / (alpha-1),  score = (exp((alpha-1) * logratio) - 1) / (alpha-1)
    """
    if abs(coef - 1.0) < 1e-6:
        return logratios
    t = (coef - 1.0) * logratios
    wide = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    clamped = wide.clamp(max=11.0 if t.dtype == torch.float16 else 80.0)
    return (torch.exp(clamped) - 1.0).to(t.dtype) * (1.0 / (coef - 1.0))


F_DIVERGENCES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "reverse_kl": reverse_kl,
    "forward_kl": forward_kl,
    "js_divergence": js_divergence,
    "alpha_divergence": alpha_divergence,
}


def pair_scores(p: PairLogps, o: DPOOptions) -> tuple[Tensor, Tensor]:
    """([B] chosen, [B] rejected) scores f'(pi/pi_ref): the log-ratios themselves under reverse_kl."""
    score = F_DIVERGENCES[o.f_divergence_type]
    return score(p.chosen_logratios, o.f_alpha_divergence_coef), score(p.rejected_logratios, o.f_alpha_divergence_coef)


def score_margin(p: PairLogps, o: DPOOptions) -> Tensor:
    """[B] chosen score - rejected score: the margin h under reverse_kl (the same tensor ops)."""
    chosen, rejected = pair_scores(p, o)
    return chosen - rejected


def check_f_divergence(types: Sequence[str], f_divergence_type: str) -> None:
    """Refuses an unknown divergence, or one but reverse_kl with a loss type that has no f-divergence form."""
    if f_divergence_type not in F_DIVERGENCES:
        raise ValueError(f"f_divergence_type must be one of {', '.join(map(repr, F_DIVERGENCES))}; "
                         f"got {f_divergence_type!r}.")
    other = sorted(set(types) - F_DIVERGENCE_LOSS_TYPES)
    if f_divergence_type != "reverse_kl" and other:
        raise ValueError(f"f_divergence_type={f_divergence_type!r} needs loss types built on the chosen-rejected "
                         f"reward difference ({', '.join(sorted(F_DIVERGENCE_LOSS_TYPES))}); loss_type {other} has "
                         "no f-divergence form: use f_divergence_type='reverse_kl' with it.")
