"""LD-DPO's cut of each sequence at its group's shared length, in any row layout.

LD-DPO weighs a completion's tokens past the shorter completion of its pair by alpha. A
weighted sum is not a plain sum per sequence, which is what the loss-aware head sums
(`ops.SequenceLoss`); so each sequence is cut in two *parts*, two plain sums: its first
`shared` completion tokens (`shared` = the fewest scored tokens of its group) and the rest.
The loss combines them (`losses.dpo_length`); the head, told that both parts of a pair's
two sequences are one group, forms the same gradient as the unfused path. Padded and packed
rows give the same parts: a position's rank counts the scored positions of its own sequence
before it, in row order, whichever rows hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .packed_rows import PackedRows, segment_sums


@dataclass(frozen=True)
class SharedLengthSplit:
    """The parts of the S sequences of some rows (module docstring).

    Attributes:
        parts: [R, L] long, the part each scored position sums into: its sequence s while its
            completion position (1-based) is at most its group's shared length, S + s past it;
            -1 where unscored.
        groups: [2S] long, the group of each part (both parts of a sequence in its group).
    """

    parts: Tensor
    groups: Tensor

    @classmethod
    def of(cls, rows: PackedRows) -> "SharedLengthSplit":
        """The parts of `rows`; no host sync."""
        ids = rows.sequence_ids.reshape(-1)  # [N], -1 unscored
        s = rows.num_sequences
        lengths, group = rows.scored_tokens.to(ids.device), rows.sequence_group.to(ids.device)
        # [G] the fewest scored tokens in each group (groups < S), then [S] each sequence's.
        fewest = torch.full((s,), torch.iinfo(torch.long).max, dtype=torch.long, device=ids.device)
        shared = fewest.scatter_reduce(0, group, lengths, "amin").index_select(0, group)
        # Rank of each scored position within its sequence: a stable sort by sequence keeps row order.
        key = torch.where(ids >= 0, ids, s)  # unscored sorted last
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(s + 1, dtype=torch.long, device=ids.device).index_add_(0, key, torch.ones_like(key))
        starts = counts.cumsum(0) - counts  # [S + 1] first sorted index of each sequence
        rank = torch.empty_like(key).index_copy_(
            0, order, torch.arange(key.numel(), device=ids.device) - starts.index_select(0, key.index_select(0, order)))
        safe = ids.clamp(min=0)
        within = rank + 1 <= shared.index_select(0, safe)
        parts = torch.where(ids < 0, -1, torch.where(within, safe, safe + s))
        return cls(parts.view_as(rows.sequence_ids), torch.cat([group, group]))

    @property
    def num_parts(self) -> int:
        return self.groups.shape[0]

    def sums(self, values: Tensor) -> Tensor:
        """[2S] per-part sums of per-position values [R, L] (0 where unscored): the S sequences' sums
        within their shared length, then past it; fp64, rounded once, as the loss-aware head sums."""
        values = values if values.is_floating_point() else values.float()
        return segment_sums(values, self.parts, self.num_parts)

    def row_loss(self, grad: Any) -> Any:
        """The loss-aware head's declaration over the parts: `grad` maps part sums [2S] to their gradient."""
        from fusedalign.head import RowLoss

        return RowLoss(self.groups, grad, segments=self.parts)
