"""What every DPO variant receives: the pair's log-probs and the loss options.

Each variant in `dpo_margin.py` and `dpo_anchored.py` is `fn(pairs, opts) -> losses [B]`,
so that `dpo.DPO_LOSSES` is a plain table and a new variant is one function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


class PairLogps(NamedTuple):
    """Sequence log-probs of a batch of preference pairs (sums over completion tokens).

    Attributes:
        chosen: [B] policy log p(y_w | x).
        rejected: [B] policy log p(y_l | x).
        ref_chosen: [B] reference log p(y_w | x) (zeros when reference-free).
        ref_rejected: [B] reference log p(y_l | x) (zeros when reference-free).
        chosen_lengths: [B] or scalar, completion tokens of y_w, or None.
        rejected_lengths: [B] or scalar, completion tokens of y_l, or None.
        chosen_tokens_sum: [B] the plain sum of y_w's token log-probs where `chosen` is LD-DPO's
            weighted sum (`dpo_length`), for the `sft` term, a token mean as TRL's; None: `chosen`.
    """

    chosen: Tensor
    rejected: Tensor
    ref_chosen: Tensor
    ref_rejected: Tensor
    chosen_lengths: Tensor | None = None
    rejected_lengths: Tensor | None = None
    chosen_tokens_sum: Tensor | None = None

    @property
    def chosen_logratios(self) -> Tensor:  # [B] log pi(y_w|x) / pi_ref(y_w|x)
        return self.chosen - self.ref_chosen

    @property
    def rejected_logratios(self) -> Tensor:  # [B] log pi(y_l|x) / pi_ref(y_l|x)
        return self.rejected - self.ref_rejected

    @property
    def margin(self) -> Tensor:  # [B] the DPO "logits": h = chosen_logratios - rejected_logratios
        return self.chosen_logratios - self.rejected_logratios


@dataclass(frozen=True)
class DPOOptions:
    """Non-tensor options shared by the variants (each reads only what it needs).

    Attributes:
        beta: Inverse temperature of the implicit reward, > 0.
        label_smoothing: Assumed probability that a pair's label is flipped, in [0, 0.5].
        bco_delta: Running mean of the rewards, the reward shift of `bco_pair` (detached);
            0 is TRL 1.16's `bco_pair`.
        discopop_tau: Temperature of DiscoPOP's mixing gate.
        sft_tokens_per_pair: The `sft` term's token-mean divisor: chosen completion tokens per
            pair over the whole optimizer step (all micro-batches and ranks), so that
            sum(sft losses) / pairs = -sum(chosen log-probs) / chosen tokens of the step. None:
            the mean of `chosen_lengths` over the batch, which is TRL's token mean over the
            batch's chosen tokens.
        f_divergence_type: The divergence to the reference (`dpo_fdiv.F_DIVERGENCES`): the function
            that scores each log-ratio in the reward difference; reverse_kl scores it as itself.
        f_alpha_divergence_coef: alpha of `alpha_divergence`.
    """

    beta: float = 0.1
    label_smoothing: float = 0.0
    bco_delta: Tensor | float = 0.0
    discopop_tau: float = 0.05
    sft_tokens_per_pair: Tensor | float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5


def lengths_of(lengths: Tensor | float | None, like: Tensor, name: str, loss_type: str) -> Tensor:
    """Token counts as a tensor like `like`, at least 1 so an empty completion gives 0, not NaN."""
    if lengths is None:
        raise ValueError(
            f"loss_type={loss_type!r} normalises by completion length: pass `{name}` "
            "(number of completion tokens per example, or one global average as a scalar)."
        )
    return torch.as_tensor(lengths, dtype=like.dtype, device=like.device).clamp(min=1.0)
