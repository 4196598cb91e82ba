"""DPO variants that score the chosen and rejected log-ratios separately (anchored to 0 or a shift).

Every function maps `(PairLogps, DPOOptions)` to per-pair losses [B]; `dpo.DPO_LOSSES` lists them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .dpo_types import DPOOptions, PairLogps, lengths_of


def nca_pair(p: PairLogps, o: DPOOptions) -> Tensor:
    """NCA for pairs: noise-contrastive alignment on absolute rewards.

    Paper: https://huggingface.co/papers/2402.05369

    Formula:
        r_w = beta * chosen_logratios,  r_l = beta * rejected_logratios
        loss = -log sigma(r_w) - 0.5 * log sigma(-r_w) - 0.5 * log sigma(-r_l)
    """
    r_w, r_l = o.beta * p.chosen_logratios, o.beta * p.rejected_logratios
    return -F.logsigmoid(r_w) - 0.5 * F.logsigmoid(-r_w) - 0.5 * F.logsigmoid(-r_l)


def bco_pair(p: PairLogps, o: DPOOptions) -> Tensor:
    """BCO for pairs: binary classification of each reward against a running-mean shift delta.

    `delta` is the running mean of the rewards (see `dpo.bco_reward_mean`); TRL updates it with
    the current batch before computing the loss. With delta = 0 this is TRL 1.x's `bco_pair`.

    Paper: https://huggingface.co/papers/2404.04656

    Formula:
        r_w = beta * chosen_logratios,  r_l = beta * rejected_logratios
        loss = -log sigma(r_w - delta) - log sigma(-(r_l - delta))
    """
    delta = torch.as_tensor(o.bco_delta, dtype=p.chosen.dtype, device=p.chosen.device).detach()
    r_w, r_l = o.beta * p.chosen_logratios, o.beta * p.rejected_logratios
    return -F.logsigmoid(r_w - delta) - F.logsigmoid(-(r_l - delta))


def sppo_hard(p: PairLogps, o: DPOOptions) -> Tensor:
    """SPPO with hard win probabilities (P = 1 for the chosen, 0 for the rejected).

    Paper: https://huggingface.co/papers/2405.00675 (Eq. 4.7)

    Formula:
        loss = (chosen_logratios - 1 / (2 * beta)) ** 2
             + (rejected_logratios + 1 / (2 * beta)) ** 2
    """
    target = 0.5 / o.beta
    return (p.chosen_logratios - target) ** 2 + (p.rejected_logratios + target) ** 2


def apo_zero(p: PairLogps, o: DPOOptions) -> Tensor:
    """APO-zero: raise the chosen likelihood, lower the rejected (chosen better than the model).

    Paper: https://huggingface.co/papers/2408.06266 (Eq. 7)

    Formula:
        loss = 1 - sigma(beta * chosen_logratios) + sigma(beta * rejected_logratios)
    """
    r_w, r_l = o.beta * p.chosen_logratios, o.beta * p.rejected_logratios
    return 1 - torch.sigmoid(r_w) + torch.sigmoid(r_l)


def apo_down(p: PairLogps, o: DPOOptions) -> Tensor:
    """APO-down: lower both likelihoods, the rejected more (chosen worse than the model).

    Paper: https://huggingface.co/papers/2408.06266 (Eq. 8)

    Formula:
        loss = sigma(beta * chosen_logratios) + 1 - sigma(beta * h)
    """
    return torch.sigmoid(o.beta * p.chosen_logratios) + 1 - torch.sigmoid(o.beta * p.margin)


def sft(p: PairLogps, o: DPOOptions) -> Tensor:
    """Negative log-likelihood of the chosen completions, a token mean (MPO's generation term).

    TRL's definition: one mean over all chosen completion tokens, not a mean of per-sequence
    means. Each pair's share is -log pi(y_w|x) / n, n the chosen tokens per pair (of the batch,
    or of the optimizer step: `DPOOptions.sft_tokens_per_pair`), so that the mean over the pairs
    is -sum log pi(y_w|x) / sum |y_w|. Every token counts once under LD-DPO too (as TRL's token
    mean): the plain sum `chosen_tokens_sum` when `chosen` is the weighted one.

    Paper: https://huggingface.co/papers/2411.10442 (MPO)

    Formula:
        loss_i = -log pi(y_w,i | x_i) / n,   n = sum_j |y_w,j| / B
    """
    if o.sft_tokens_per_pair is not None:
        per_pair = o.sft_tokens_per_pair
    else:
        lengths = lengths_of(p.chosen_lengths, p.chosen, "chosen_lengths", "sft")
        per_pair = lengths.mean() if lengths.dim() else lengths
    chosen = p.chosen if p.chosen_tokens_sum is None else p.chosen_tokens_sum
    return -chosen / torch.as_tensor(per_pair, dtype=p.chosen.dtype, device=p.chosen.device).clamp(min=1.0)
