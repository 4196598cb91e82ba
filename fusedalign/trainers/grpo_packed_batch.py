"""GRPO's prepared micro-batch on a packed row (`padding_free`): GRPOMicroBatch's parts, per completion.

The forward reads one packed row (`data.packed_rows.PackedRows`, made by
`data.grpo_packing.pack_completions`): completions with their prompts, or with
`share_prompt` a group's completions after one copy of its prompt. The loss reads the
per-token values of that forward gathered back per completion, `[n, C]` (completion i's
token t in column t), so `losses.grpo_loss` and `losses.rloo_loss` run unchanged on the same
numbers, in the same order, as on padded rows. The old-policy and reference log-probs were
computed on the same row at generation and are stored the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fusedalign.data.packed_rows import PackedRows
from fusedalign.trainers.grpo_batch import _WHY
from fusedalign.trainers.step_batch import MicroBatchParts, StepBatch, require_parts

_ROW_FIELDS = [f.name for f in dataclasses.fields(PackedRows) if f.name != "_forward"]
_TENSOR_FIELDS = ("positions", "advantages", "old_logps", "ref_logps", "entropy_weight", "micro_batch_tokens")


def rows_to(rows: PackedRows, device: torch.device | str) -> PackedRows:
    """The rows on `device` (the same object when already there: its forward arguments stay cached)."""
    moved = {name: getattr(rows, name) for name in _ROW_FIELDS}
    if all(v is None or v.device == torch.device(device) for v in moved.values()):
        return rows
    return PackedRows(**{k: None if v is None else v.to(device) for k, v in moved.items()})


@dataclass(frozen=True)
class PackedGRPOMicroBatch(StepBatch):
    """One micro-batch of n completions in a packed row, ready for the loss.

    Attributes:
        rows: the packed row the policy, old policy and reference read (sequence i: completion i).
        positions: [n, C] long, where in the flattened row completion i's token t is scored;
            -1 past its end (and on every token of a completion left out of the loss).
        advantages: [n].
        old_logps, ref_logps: [n, C] or None, as GRPOMicroBatch's.
        entropy_weight: [] or None, as GRPOMicroBatch's.
        micro_batch_tokens: [] the loss tokens of the whole micro-batch when this is one of its parts
            (`PackedGRPOParts`, which sets it on every part: bnpo's divisor); None for a whole one.
    """

    rows: PackedRows
    positions: Tensor
    advantages: Tensor
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    entropy_weight: Tensor | None = None
    micro_batch_tokens: Tensor | None = None

    def __post_init__(self):
        shape = tuple(self.positions.shape)
        for name in ("old_logps", "ref_logps"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"PackedGRPOMicroBatch.{name} has shape {tuple(value.shape)}; positions have {shape}")
        if self.advantages.shape[0] != shape[0] or self.rows.num_sequences != shape[0]:
            raise ValueError(f"PackedGRPOMicroBatch: {self.advantages.shape[0]} advantages and "
                             f"{self.rows.num_sequences} sequences for {shape[0]} completions")

    @property
    def loss_mask(self) -> Tensor:
        """[n, C] bool: the completion tokens in the loss."""
        return self.positions >= 0

    def forward_args(self, model: Any) -> tuple[dict[str, Any], Tensor]:
        """The row's forward arguments for `model` (built once per model signature) and its targets."""
        return self.rows.model_inputs(model), self.rows.labels

    def per_completion(self, values: Tensor | None) -> Tensor | None:
        """Per-token values of the forward [1, L] as [n, C] per completion, 0 past each end; differentiable."""
        if values is None:
            return None
        mask = self.loss_mask
        gathered = values.reshape(-1)[self.positions.clamp(min=0).to(values.device)]
        return torch.where(mask.to(values.device), gathered, torch.zeros((), dtype=values.dtype, device=values.device))

    def input_tokens(self) -> Tensor:
        return self.rows.input_tokens()

    def forward_tokens(self) -> int:
        return self.rows.forward_tokens()

    def replace(self, **parts: Any) -> "PackedGRPOMicroBatch":
        return dataclasses.replace(self, **parts)

    def to(self, device: torch.device | str) -> "PackedGRPOMicroBatch":
        tensors = {k: getattr(self, k) for k in _TENSOR_FIELDS}
        return dataclasses.replace(self, rows=rows_to(self.rows, device),
                                   **{k: None if v is None else v.to(device) for k, v in tensors.items()})

    def require(self, *, old_logps: bool, ref_logps: bool, entropy_weight: bool) -> "PackedGRPOMicroBatch":
        """Refuses a batch whose optional parts are not exactly those the configuration needs."""
        require_parts("PackedGRPOMicroBatch", {name: (getattr(self, name), needed, _WHY[name]) for name, needed in (
            ("old_logps", old_logps), ("ref_logps", ref_logps), ("entropy_weight", entropy_weight))})
        return self

    def state(self) -> dict[str, Any]:
        """Its tensors on the CPU (for a checkpoint); `rows` holds the row's."""
        cpu = lambda v: None if v is None else v.detach().cpu()  # noqa: E731
        state = {k: cpu(getattr(self, k)) for k in _TENSOR_FIELDS}
        state["rows"] = {name: cpu(getattr(self.rows, name)) for name in _ROW_FIELDS}
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PackedGRPOMicroBatch":
        parts = dict(state)
        return cls(rows=PackedRows(**parts.pop("rows")), **parts)


@dataclass(frozen=True)
class PackedGRPOParts(MicroBatchParts):
    """A micro-batch of completions in several packed rows, one `PackedGRPOMicroBatch` each, trained
    as one forward and backward per row (`step_batch.MicroBatchParts`)."""

    parts: tuple[PackedGRPOMicroBatch, ...]

    def __post_init__(self):
        super().__post_init__()
        if any(p.micro_batch_tokens is None for p in self.parts):  # its value is set by `of` (no device read here)
            raise ValueError("PackedGRPOParts: every part must carry the micro-batch's loss tokens "
                             "(micro_batch_tokens); build it with PackedGRPOParts.of")

    @classmethod
    def of(cls, parts: list[PackedGRPOMicroBatch]) -> "PackedGRPOParts":
        """The micro-batch of these parts, each told the whole micro-batch's loss tokens."""
        total = sum(p.loss_mask.sum() for p in parts)
        return cls(tuple(p.replace(micro_batch_tokens=total) for p in parts))

    def replace(self, **parts: Any) -> "PackedGRPOParts":
        """`advantages` [n] are cut per part in completion order; every other part is given to each."""
        advantages = parts.pop("advantages", None)
        cut = [None] * len(self.parts) if advantages is None else list(torch.split(advantages, self.sizes))
        return dataclasses.replace(self, parts=tuple(
            p.replace(**parts, **({} if a is None else {"advantages": a})) for p, a in zip(self.parts, cut)))

    def require(self, **needed: bool) -> "PackedGRPOParts":
        for part in self.parts:
            part.require(**needed)
        return self

    def state(self) -> dict[str, Any]:
        return {"parts": [p.state() for p in self.parts]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PackedGRPOParts":
        return cls(tuple(PackedGRPOMicroBatch.from_state(p) for p in state["parts"]))
