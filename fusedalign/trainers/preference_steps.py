"""DPO's and KTO's prepared micro-batches: frozen, typed, their optional parts declared.

Before these types the step's data travelled as keys added to the collated dict, and an
absent key changed the maths without a word (DPO's `sft_tokens_per_pair` absent: the sft
term divided by the micro-batch's own chosen tokens instead of the step's; KTO's `kl`
absent would have been a KeyError only by luck of the code path). Here each part the loss
reads is a field; a required one cannot be left out (the dataclass refuses), an optional
one is a tensor or None with its meaning stated, and `require` refuses a batch whose
optional parts are not exactly those the run's configuration needs, naming the part.

The rows are the collated batch read as the one row layout (`data.packed_rows.PackedRows`,
padded or packed), the same object the step's reference forward ran on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from fusedalign.data.packed_rows import PackedRows
from fusedalign.data.shared_length import SharedLengthSplit
from fusedalign.losses import valid_pairs
from fusedalign.trainers.step_batch import StepBatch, require_parts


def _check_shape(owner: str, name: str, value: Tensor | None, shape: tuple[int, ...]) -> None:
    if value is not None and tuple(value.shape) != shape:
        raise ValueError(f"{owner}.{name} has shape {tuple(value.shape)}; expected {shape}")


@dataclass(frozen=True)
class DPOStepBatch(StepBatch):
    """One DPO micro-batch, ready for the loss.

    Attributes:
        rows: the B pairs' 2B sequences (chosen 0..B-1, then rejected), padded or packed.
        ref_logps: [2B] the reference's summed completion log-probs, chosen then rejected
            (zeros when reference-free, as TRL's).
        sft_tokens_per_pair: [] the optimizer step's chosen completion tokens per valid pair
            (all micro-batches, all ranks), the divisor of the `sft` term; None: no `sft` term.
        ld_split: each sequence cut at its pair's shared length, the parts LD-DPO weighs (the
            reference's `ref_logps` already weighted by them); None: no `ld_alpha` weighting.
    """

    rows: PackedRows
    ref_logps: Tensor
    sft_tokens_per_pair: Tensor | None = None
    ld_split: SharedLengthSplit | None = None

    def __post_init__(self):
        _check_shape("DPOStepBatch", "ref_logps", self.ref_logps, (self.rows.num_sequences,))
        _check_shape("DPOStepBatch", "sft_tokens_per_pair", self.sft_tokens_per_pair, ())
        if self.ld_split is not None:
            _check_shape("DPOStepBatch", "ld_split.parts", self.ld_split.parts, tuple(self.rows.labels.shape))
            _check_shape("DPOStepBatch", "ld_split.groups", self.ld_split.groups, (2 * self.rows.num_sequences,))

    def input_tokens(self) -> Tensor:
        return self.rows.input_tokens()

    def forward_tokens(self) -> int:
        return self.rows.forward_tokens()

    def require(self, *, sft: bool, ld: bool) -> "DPOStepBatch":
        """Refuses a batch whose `sft_tokens_per_pair` (`ld_split`) is absent though the loss has an `sft` term
        (LD-DPO's weighting), or present though it has none."""
        require_parts("DPOStepBatch", {
            "sft_tokens_per_pair": (self.sft_tokens_per_pair, sft, "the sft term (a loss_type with 'sft') divides "
                                    "by the optimizer step's chosen tokens per pair"),
            "ld_split": (self.ld_split, ld, "ld_alpha weighs the tokens past each pair's shared length")})
        return self


@dataclass(frozen=True)
class KTOStepBatch(StepBatch):
    """One KTO micro-batch, ready for the loss.

    Attributes:
        rows: the B examples' completions, padded or packed (their KL partners served the step's z0).
        desirable: [B] bool, each example's label.
        ref_logps: [B] the reference's summed completion log-probs.
        kl: [] the optimizer step's KL reference point z0 (clamped, detached); None: a loss
            type without it (`apo_zero_unpaired`).
    """

    rows: PackedRows
    desirable: Tensor
    ref_logps: Tensor
    kl: Tensor | None = None

    def __post_init__(self):
        b = self.rows.num_sequences
        _check_shape("KTOStepBatch", "desirable", self.desirable, (b,))
        _check_shape("KTOStepBatch", "ref_logps", self.ref_logps, (b,))
        _check_shape("KTOStepBatch", "kl", self.kl, ())

    def input_tokens(self) -> Tensor:
        return self.rows.input_tokens()

    def forward_tokens(self) -> int:
        return self.rows.forward_tokens()

    def require(self, *, kl: bool) -> "KTOStepBatch":
        """Refuses a batch whose `kl` is absent though the loss type needs z0 (or present though it does not)."""
        require_parts("KTOStepBatch", {"kl": (self.kl, kl, "loss_type 'kto' subtracts the KL reference point z0; "
                                         "'apo_zero_unpaired' has none")})
        return self


def check_step_batch(owner: str, inputs: Any, kind: type) -> None:
    """Refuses anything but the trainer's own step batch in `loss_and_metrics` (e.g. a collated dict)."""
    if not isinstance(inputs, kind):
        raise TypeError(f"{owner}.loss_and_metrics takes a {kind.__name__} (made by prepare_step), "
                        f"got {type(inputs).__name__}")


def chosen_tokens_per_pair(rows: list[PackedRows], device: torch.device,
                           reduce_sum: Callable[[Tensor], Tensor]) -> Tensor:
    """The optimizer step's chosen completion tokens per valid pair, `[]`: every micro-batch's `rows`
    (B pairs each, chosen first), summed over the ranks by `reduce_sum`; the divisor of DPO's `sft` term."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for r in rows:
        lengths = r.lengths()
        half, valid = lengths.shape[0] // 2, valid_pairs(lengths)
        totals += torch.stack([(lengths[:half] * valid).sum(), valid.sum()]).to(totals)
    totals = reduce_sum(totals)
    return totals[0] / totals[1].clamp(min=1)
