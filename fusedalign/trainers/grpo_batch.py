"""GRPO's prepared micro-batch: a frozen, typed object whose optional parts are declared.

Before this type the step's data travelled as dictionary keys, and an absent key changed
the maths without a word (no `old_logps`: ratio 1, no clipping; no `entropy_weight`: no
entropy bonus). Here each optional part is a field that is either a tensor or None, what
None means is stated below, and `require` refuses a batch that lacks a part the run's
configuration needs, naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fusedalign.head import IGNORE_INDEX
from fusedalign.trainers.step_batch import MissingPartError, StepBatch, require_parts

__all__ = ["GRPOMicroBatch", "MissingPartError"]


@dataclass(frozen=True)
class GRPOMicroBatch(StepBatch):
    """One micro-batch of completions, ready for the loss.

    Attributes:
        input_ids: [b, T] prompt + completion, right-padded.
        attention_mask: [b, T] 1 on real tokens.
        labels: [b, T] the completion token predicted at each position, IGNORE_INDEX elsewhere
            (and on rows left out of the loss, e.g. truncated ones with mask_truncated_completions).
        advantages: [b] group-relative advantages.
        old_logps: [b, T] the generating policy's log-probs, or None: the batch is trained on
            by the policy that generated it (ratio exactly 1).
        ref_logps: [b, T] the reference's log-probs, or None: no KL term (beta 0).
        entropy_weight: [] the entropy bonus weight of the whole optimizer step
            (`losses.entropy_weight`), or None: no bonus (entropy_coef 0).
    """

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    advantages: Tensor
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    entropy_weight: Tensor | None = None

    def __post_init__(self):
        shape = tuple(self.labels.shape)
        for name in ("input_ids", "attention_mask", "old_logps", "ref_logps"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"GRPOMicroBatch.{name} has shape {tuple(value.shape)}; labels have {shape}")
        if self.advantages.shape[0] != shape[0]:
            raise ValueError(f"GRPOMicroBatch.advantages has {self.advantages.shape[0]} rows; labels have {shape[0]}")

    @property
    def loss_mask(self) -> Tensor:
        """[b, T] bool: the completion tokens in the loss."""
        return self.labels != IGNORE_INDEX

    @property
    def model_inputs(self) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}

    def input_tokens(self) -> Tensor:
        return self.attention_mask.sum()

    def forward_args(self, model: Any) -> tuple[dict[str, Tensor], Tensor]:
        """The forward's keyword arguments and its targets (the same for the policy, old policy and reference)."""
        return self.model_inputs, self.labels

    @property
    def micro_batch_tokens(self) -> None:
        """A padded micro-batch is never in parts: bnpo divides by its own loss tokens."""
        return None

    def per_completion(self, values: Tensor | None) -> Tensor | None:
        """Per-token values of the forward [b, T] as the loss reads them (here: as they are)."""
        return values

    def replace(self, **parts: Any) -> "GRPOMicroBatch":
        return dataclasses.replace(self, **parts)

    def to(self, device: torch.device | str) -> "GRPOMicroBatch":
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return GRPOMicroBatch(**{k: None if v is None else v.to(device) for k, v in moved.items()})

    def require(self, *, old_logps: bool, ref_logps: bool, entropy_weight: bool) -> "GRPOMicroBatch":
        """Refuses a batch whose optional parts are not exactly those the configuration needs."""
        require_parts("GRPOMicroBatch", {name: (getattr(self, name), needed, _WHY[name]) for name, needed in (
            ("old_logps", old_logps), ("ref_logps", ref_logps), ("entropy_weight", entropy_weight))})
        return self

    def state(self) -> dict[str, Tensor | None]:
        """Its tensors on the CPU (for a checkpoint)."""
        return {f.name: None if (v := getattr(self, f.name)) is None else v.detach().cpu()
                for f in dataclasses.fields(self)}

    @staticmethod
    def from_state(state: dict[str, Any]) -> "GRPOMicroBatch":
        """A micro-batch from `state()` (a packed one's state names its rows, one in parts its parts)."""
        if "rows" in state or "parts" in state:
            from fusedalign.trainers.grpo_packed_batch import PackedGRPOMicroBatch, PackedGRPOParts

            return (PackedGRPOParts if "parts" in state else PackedGRPOMicroBatch).from_state(state)
        return GRPOMicroBatch(**state)


_WHY = {
    "old_logps": "the policy changes between a generation and its use when gradient_accumulation_steps is not a "
                 "multiple of steps_per_generation x num_iterations",
    "ref_logps": "the KL term is on when beta != 0",
    "entropy_weight": "the entropy bonus is on when entropy_coef != 0",
}
