"""Typed prepared micro-batches: what `prepare_step` returns and the loss reads.

A step's data as dictionary keys let an absent key change the maths without a word (no
`old_logps`: ratio 1; no `sft_tokens_per_pair`: another divisor). A `StepBatch` is a frozen
dataclass whose optional parts are declared fields, and `require_parts` refuses one that
lacks a part its configuration needs, or holds one it does not use, naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

PREPARED = "_fusedalign_prepared"  # marks a dict micro-batch that went through prepare_step


class MissingPartError(ValueError):
    """A prepared micro-batch lacks a part its loss needs (or holds one the configuration does not use)."""


def require_parts(owner: str, parts: dict[str, tuple[Any, bool, str]]) -> None:
    """Refuses a missing part that is needed, or a present one that is not used.

    Args:
        owner: the batch type's name, for the message.
        parts: {name: (value or None, needed, why it is needed)}.
    """
    for name, (value, needed, why) in parts.items():
        if needed and value is None:
            raise MissingPartError(f"{owner} has no {name}, which this configuration needs: {why}")
        if not needed and value is not None:
            raise MissingPartError(f"{owner} has {name}, which this configuration does not use: {why}")


@dataclass(frozen=True)
class StepBatch:
    """A prepared micro-batch as a typed object; subclasses declare its parts as fields.

    The base passes it through unchanged (`Trainer._prepare_inputs` is for the dicts a
    collator makes) to `count_items` and `loss_and_metrics`.
    """

    def input_tokens(self) -> torch.Tensor:
        """Input tokens, padding excluded, as a 0-dim tensor on the batch's device."""
        raise NotImplementedError

    def forward_tokens(self) -> int:
        """Token positions the policy's forward runs over (padding included), from shapes alone:
        Trainer's floating-point-operation count (`6 x tokens x parameters`), as it takes
        `input_ids.numel()` of a dict. Default: the `input_ids` field's."""
        input_ids = getattr(self, "input_ids", None)
        if not isinstance(input_ids, torch.Tensor):
            raise NotImplementedError(f"{type(self).__name__} has no input_ids field: define forward_tokens()")
        return input_ids.numel()


def is_prepared(batch: Any) -> bool:
    return isinstance(batch, StepBatch) or bool(batch.get(PREPARED))


@dataclass(frozen=True)
class MicroBatchParts(StepBatch):
    """One micro-batch of the Trainer's loop that does not fit one forward under the token budget.

    Its `parts` (each a prepared micro-batch of some of its completions, one packed row each)
    are trained one after another, each forward followed by its own backward, with the
    gradient synchronisation deferred to the last part (`FusedAlignTrainer.training_step`):
    the same update as one forward of the whole micro-batch, for any loss whose sum adds up
    over completions, with the memory of one part. Completion i of the micro-batch is the
    i-th of the parts' completions taken in order.

    Attributes:
        parts: the parts, in order (at least one).
    """

    parts: tuple

    def __post_init__(self):
        if not self.parts:
            raise ValueError("MicroBatchParts needs at least one part")

    @property
    def sizes(self) -> list[int]:
        """Completions of each part."""
        return [int(p.loss_mask.shape[0]) for p in self.parts]

    @property
    def loss_mask(self) -> torch.Tensor:
        """[n, C] bool: the parts' loss masks stacked (C the widest), in completion order."""
        masks = [p.loss_mask for p in self.parts]
        width = max(m.shape[1] for m in masks)
        return torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])

    def input_tokens(self) -> torch.Tensor:
        return torch.stack([torch.as_tensor(p.input_tokens()) for p in self.parts]).sum()

    def forward_tokens(self) -> int:
        return sum(p.forward_tokens() for p in self.parts)

    def map(self, fn) -> "MicroBatchParts":
        """The same micro-batch with `fn` applied to each part (same type)."""
        return dataclasses.replace(self, parts=tuple(fn(p) for p in self.parts))

    def to(self, device: torch.device | str) -> "MicroBatchParts":
        return self.map(lambda p: p.to(device))
