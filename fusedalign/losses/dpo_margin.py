"""DPO variants that are functions of the reward margin h = chosen_logratios - rejected_logratios.

Every function maps `(PairLogps, DPOOptions)` to per-pair losses [B]; `dpo.DPO_LOSSES` lists them.
Those TRL 1.16 generalises to another f-divergence (`dpo_fdiv`) read the scores f'(pi/pi_ref)
where the formulas below say log-ratio: h = score_w - score_l (`score_margin`), ipo's and
sigmoid_norm's per-token log-ratios score_w / |y_w| and score_l / |y_l|. The aot variants are
refused with another divergence and keep the log-ratios.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .dpo_fdiv import pair_scores, score_margin
from .dpo_types import DPOOptions, PairLogps, lengths_of


def _smoothed_logistic(z: Tensor, eps: float) -> Tensor:
    # Binary cross-entropy of sigmoid(z) against the soft label (1 - eps, eps).
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def sigmoid(p: PairLogps, o: DPOOptions) -> Tensor:
    """DPO, and conservative DPO when label_smoothing > 0.

    Paper: https://huggingface.co/papers/2305.18290 (cDPO: https://ericmitchell.ai/cdpo.pdf)

    Formula:
        loss = -(1 - eps) * log sigma(beta * h) - eps * log sigma(-beta * h)
    """
    return _smoothed_logistic(o.beta * score_margin(p, o), o.label_smoothing)


def robust(p: PairLogps, o: DPOOptions) -> Tensor:
    """Robust DPO: an unbiased loss under label noise of rate eps (eps < 0.5).

    Paper: https://huggingface.co/papers/2403.00409

    Formula:
        loss = (-(1 - eps) * log sigma(beta * h) + eps * log sigma(-beta * h)) / (1 - 2 * eps)
    """
    eps, z = o.label_smoothing, o.beta * score_margin(p, o)
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def hinge(p: PairLogps, o: DPOOptions) -> Tensor:
    """RSO's hinge loss on the normalised likelihood.

    Paper: https://huggingface.co/papers/2309.06657

    Formula:
        loss = max(0, 1 - beta * h)
    """
    return torch.relu(1 - o.beta * score_margin(p, o))


def ipo(p: PairLogps, o: DPOOptions) -> Tensor:
    """IPO, on per-token (length-normalised) log-ratios as TRL computes it; beta is the paper's tau.

    Paper: https://huggingface.co/papers/2310.12036 (Eq. 17)

    Formula:
        h_avg = chosen_logratios / |y_w| - rejected_logratios / |y_l|
        loss = (h_avg - 1 / (2 * beta)) ** 2
    """
    len_w = lengths_of(p.chosen_lengths, p.chosen, "chosen_lengths", "ipo")
    len_l = lengths_of(p.rejected_lengths, p.rejected, "rejected_lengths", "ipo")
    chosen, rejected = pair_scores(p, o)
    h_avg = chosen / len_w - rejected / len_l
    return (h_avg - 1 / (2 * o.beta)) ** 2


def sigmoid_norm(p: PairLogps, o: DPOOptions) -> Tensor:
    """DPO on per-token (length-normalised) log-ratios, as TRL 1.16's `sigmoid_norm`; label_smoothing unused.

    Paper: https://huggingface.co/papers/2305.18290 (DPO), with the per-token log-ratios of `ipo`

    Formula:
        h_avg = chosen_logratios / |y_w| - rejected_logratios / |y_l|
        loss = -log sigma(beta * h_avg)
    """
    len_w = lengths_of(p.chosen_lengths, p.chosen, "chosen_lengths", "sigmoid_norm")
    len_l = lengths_of(p.rejected_lengths, p.rejected, "rejected_lengths", "sigmoid_norm")
    chosen, rejected = pair_scores(p, o)
    return -F.logsigmoid(o.beta * (chosen / len_w - rejected / len_l))


def exo_pair(p: PairLogps, o: DPOOptions) -> Tensor:
    """EXO for pairs: KL(q || p_eps) from the policy's pair distribution to the smoothed label.

    Paper: https://huggingface.co/papers/2402.00856 (Eq. 16)

    Formula:
        q_w = sigma(beta * h), q_l = sigma(-beta * h)
        loss = q_w * (log q_w - log(1 - eps)) + q_l * (log q_l - log eps),   eps > 0
    """
    eps, z = o.label_smoothing, o.beta * score_margin(p, o)
    return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - math.log(eps)
    )


def discopop(p: PairLogps, o: DPOOptions) -> Tensor:
    """DiscoPOP (log-ratio modulated loss): a gate blends the logistic and exponential losses.

    Paper: https://huggingface.co/papers/2406.08414 (Eq. 5)

    Formula:
        z = beta * h,  g = sigma(z / tau)
        loss = (1 - g) * -log sigma(z) + g * exp(-z)
    """
    z = o.beta * score_margin(p, o)
    gate = torch.sigmoid(z / o.discopop_tau)
    return (1 - gate) * -F.logsigmoid(z) + gate * torch.exp(-z)


def aot(p: PairLogps, o: DPOOptions) -> Tensor:
    """AOT (paired): distributional alignment via optimal transport, by sorting across the batch.

    Inherently batch-dependent: example i's loss pairs the i-th smallest policy log-ratio with
    the i-th smallest reference log-ratio of the SAME (micro-)batch, so the result depends on
    how a global batch is split across ranks and accumulation steps.

    Paper: https://huggingface.co/papers/2406.05882

    Formula:
        d = sort(log pi(y_w) - log pi(y_l)) - sort(log pi_ref(y_w) - log pi_ref(y_l))
        loss = -(1 - eps) * log sigma(beta * d) - eps * log sigma(-beta * d)
    """
    policy_sorted = torch.sort(p.chosen - p.rejected, dim=0).values
    ref_sorted = torch.sort(p.ref_chosen - p.ref_rejected, dim=0).values
    return _smoothed_logistic(o.beta * (policy_sorted - ref_sorted), o.label_smoothing)


def aot_pair(p: PairLogps, o: DPOOptions) -> Tensor:
    """AOT (unpaired, TRL 1.x's "aot_unpaired"): sorts chosen and rejected log-ratios separately.

    Inherently batch-dependent, like `aot`.

    Paper: https://huggingface.co/papers/2406.05882

    Formula:
        d = sort(chosen_logratios) - sort(rejected_logratios)
        loss = -(1 - eps) * log sigma(beta * d) - eps * log sigma(-beta * d)
    """
    chosen_sorted = torch.sort(p.chosen_logratios, dim=0).values
    rejected_sorted = torch.sort(p.rejected_logratios, dim=0).values
    return _smoothed_logistic(o.beta * (chosen_sorted - rejected_sorted), o.label_smoothing)
