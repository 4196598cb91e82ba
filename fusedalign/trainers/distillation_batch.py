"""Distillation's prepared micro-batch: the sampled completions, nothing else; padded or packed.

The teacher's distribution is computed in the loss (inside both heads' forwards), so unlike
GRPO's micro-batch this one has no optional part: no advantage, no old-policy or reference
log-probs that an absent field could silently switch off.

Two layouts, one interface (`forward_args`, `per_completion`, `loss_mask`): padded rows
(`DistillationBatch`) or, with `padding_free`, one packed row of the micro-batch's prompt +
completion sequences (`PackedDistillationBatch`, made by GRPO's `PackedLayout` with one
completion a prompt). The teacher and the student read the same row, each with the forward
arguments built for its own attention (`PackedRows.model_inputs`), and the loss reads the
per-token divergence gathered back per completion, `[n, C]`: the same numbers the padded
layout gives, so the same loss and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fusedalign.data.packed_rows import PackedRows
from fusedalign.head import IGNORE_INDEX
from fusedalign.trainers.grpo_batch import GRPOMicroBatch
from fusedalign.trainers.grpo_packed_batch import PackedGRPOMicroBatch, PackedGRPOParts
from fusedalign.trainers.step_batch import MicroBatchParts, StepBatch


def distillation_batch(batch: GRPOMicroBatch | PackedGRPOMicroBatch | PackedGRPOParts,
                       ) -> "DistillationBatch | PackedDistillationBatch | MicroBatchParts":
    """The rollout's micro-batch, which must carry no log-probs (nothing is fixed at generation), in its layout
    (a micro-batch in parts: each part's)."""
    batch.require(old_logps=False, ref_logps=False, entropy_weight=False)
    if isinstance(batch, PackedGRPOParts):
        return MicroBatchParts(tuple(distillation_batch(part) for part in batch.parts))
    if isinstance(batch, PackedGRPOMicroBatch):
        return PackedDistillationBatch(batch.rows, batch.positions)
    return DistillationBatch(batch.input_ids, batch.attention_mask, batch.labels)


@dataclass(frozen=True)
class DistillationBatch(StepBatch):
    """One micro-batch of prompts and the student's completions, right-padded.

    Attributes:
        input_ids: [b, T] prompt + completion, right-padded.
        attention_mask: [b, T] 1 on real tokens.
        labels: [b, T] the completion token predicted at each position (position-aligned),
            IGNORE_INDEX elsewhere: the positions the divergence is summed over.
    """

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor

    def __post_init__(self):
        for name in ("input_ids", "attention_mask"):
            if tuple(getattr(self, name).shape) != tuple(self.labels.shape):
                raise ValueError(f"DistillationBatch.{name} has shape {tuple(getattr(self, name).shape)}; labels "
                                 f"have {tuple(self.labels.shape)}")

    @property
    def loss_mask(self) -> Tensor:
        """[b, T] bool: the completion tokens in the loss."""
        return self.labels != IGNORE_INDEX

    @property
    def model_inputs(self) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def forward_args(self, model: Any) -> tuple[dict[str, Tensor], Tensor]:
        """The forward's keyword arguments (the same for the teacher and the student) and the labels [b, T]."""
        return self.model_inputs, self.labels

    def per_completion(self, values: Tensor) -> Tensor:
        """Per-token values of the forward [b, T] as the loss reads them (here: as they are)."""
        return values

    def input_tokens(self) -> Tensor:
        return self.attention_mask.sum()


@dataclass(frozen=True)
class PackedDistillationBatch(StepBatch):
    """One micro-batch of n prompt + completion sequences in one packed row (`padding_free`).

    Attributes:
        rows: the packed row both models read (sequence i: completion i, after its own prompt).
        positions: [n, C] long, where in the flattened row completion i's token t is scored;
            -1 past its end.
    """

    rows: PackedRows
    positions: Tensor

    def __post_init__(self):
        if self.rows.num_sequences != self.positions.shape[0]:
            raise ValueError(f"PackedDistillationBatch: {self.rows.num_sequences} sequences in the row for "
                             f"{self.positions.shape[0]} completions")

    @property
    def loss_mask(self) -> Tensor:
        """[n, C] bool: the completion tokens in the loss."""
        return self.positions >= 0

    def forward_args(self, model: Any) -> tuple[dict[str, Any], Tensor]:
        """The row's forward arguments for `model` (built once per attention signature) and its labels [1, L]."""
        return self.rows.model_inputs(model), self.rows.labels

    def per_completion(self, values: Tensor) -> Tensor:
        """Per-token values of the forward [1, L] as [n, C] per completion, 0 past each end; differentiable."""
        mask = self.loss_mask.to(values.device)
        gathered = values.reshape(-1)[self.positions.clamp(min=0).to(values.device)]
        return torch.where(mask, gathered, torch.zeros((), dtype=values.dtype, device=values.device))

    def input_tokens(self) -> Tensor:
        return self.rows.input_tokens()

    def forward_tokens(self) -> int:
        return self.rows.forward_tokens()
