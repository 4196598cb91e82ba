"""Distillation's prepared micro-batch: the sampled completions, nothing else.

The teacher's distribution is computed in the loss (inside both heads' forwards), so unlike
GRPO's micro-batch this one has no optional part: no advantage, no old-policy or reference
log-probs that an absent field could silently switch off.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fusedalign.head import IGNORE_INDEX
from fusedalign.trainers.grpo_batch import GRPOMicroBatch
from fusedalign.trainers.step_batch import StepBatch


@dataclass(frozen=True)
class DistillationBatch(StepBatch):
    """One micro-batch of prompts and the student's completions.

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

    @classmethod
    def of(cls, batch: GRPOMicroBatch) -> "DistillationBatch":
        """From the rollout's micro-batch, which must carry no log-probs (nothing fixed at generation)."""
        batch.require(old_logps=False, ref_logps=False, entropy_weight=False)
        return cls(batch.input_ids, batch.attention_mask, batch.labels)

    @property
    def loss_mask(self) -> Tensor:
        """[b, T] bool: the completion tokens in the loss."""
        return self.labels != IGNORE_INDEX

    @property
    def model_inputs(self) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def input_tokens(self) -> Tensor:
        return self.attention_mask.sum()
