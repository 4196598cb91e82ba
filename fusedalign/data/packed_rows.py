"""The one row layout every forward of a trainer reads: sequences in rows, as segments.

A batch the model sees is R rows of L positions. Each position belongs to a *segment*, a
run of tokens with consecutive positions; it sees its own earlier tokens and all of one
other segment, its *parent* (the rule is in `fusedalign.attention.masks`). Each scored
position adds its label's log-prob to one *sequence*; each sequence belongs to a *group*
(a DPO pair, a KTO example, a GRPO prompt). Three shapes of work fit this one structure:

- pairs (DPO) and single sequences (KTO, SFT): a group of K = 2 or K = 1 completions, each
  after its prompt (a root segment from position 0), or with `share_prompt` after one copy
  of the prompt (`pack_groups`, the layout's picture is in `data.preference_batches`);
- prompt groups (GRPO, RLOO): one prompt and G completions, each attending to the prompt and
  itself only, its positions continuing from the prompt (`pack_groups(share_prompt=True)`
  with K = G; `pack_prompt_groups` fills several rows up to a token budget);
- padded rows (`from_padded`): one sequence a row, padding after it; no segment structure
  reaches the model, which is given an `attention_mask`, exactly as before packing existed.

What differs between packed and padded rows is only what the data says: how attention is
confined (`model_inputs`: an attention mask, restarting positions, or a mask of the
segments' tree) and whether a row holds one sequence (its sums are the row's). Both sum
per-position values per sequence in fp64 and round once, as the loss-aware head sums, so
equal log-probs give equal sums whatever the layout.

Attention cost: `fusedalign.attention.attention_inputs` gives restarting positions (every
implementation splits the row there; flash kernels as varlen, whose cost follows the
segments) or, with a parent, a FlexAttention `BlockMask` on `flex_attention` (empty blocks
skipped, so the cost follows the segments) or a dense mask on eager and sdpa (L x L: for
short rows and CPU tests only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .collators import position_labels
from .formats import DataError
from .packing import _bins

IGNORE_INDEX = -100
ROW_INPUTS = ("input_ids", "position_ids", "segment_ids", "parent_ids")


class _Row:
    """The lists of one packed row, filled segment by segment."""

    def __init__(self):
        self.cols: dict[str, list[int]] = {k: [] for k in
                                           ("input_ids", "position_ids", "completion_mask", "labels",
                                            "segment_ids", "parent_ids", "sequence_ids")}
        self.segments = 0

    def add(self, ids: list[int], scored: list[int], start: int, parent: int, sequence: int) -> int:
        """Appends a segment; returns its id (-1 for an empty one, which is not added)."""
        if not ids:
            return -1
        segment, self.segments = self.segments, self.segments + 1
        labels = [ids[t + 1] if scored[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
        c = self.cols
        c["input_ids"] += ids
        c["position_ids"] += range(start, start + len(ids))
        c["completion_mask"] += scored
        c["labels"] += labels
        c["segment_ids"] += [segment] * len(ids)
        c["parent_ids"] += [parent] * len(ids)
        c["sequence_ids"] += [sequence if label != IGNORE_INDEX else -1 for label in labels]
        return segment


def group_tokens(prompt: int, completions: Sequence[int], share_prompt: bool) -> int:
    """Tokens a group (a prompt of `prompt` tokens and its completions) occupies in a packed row."""
    if share_prompt and prompt:
        return prompt - 1 + sum(1 + c for c in completions)
    return sum(prompt + c for c in completions)


def pack_groups(groups: Sequence[tuple[list[int], list[list[int]]]], *, share_prompt: bool = False,
                pad_token_id: int = 0, pad_to_multiple_of: int | None = None) -> dict[str, Tensor]:
    """Packs groups (a prompt and the completions that share it) into one row.

    Args:
        groups: B (prompt ids, [completion ids, ...]) with the same number K of completions each.
        share_prompt: one prefix per group (see `data.preference_batches`) instead of a prompt per completion.
        pad_token_id: the id of padding tokens (only with `pad_to_multiple_of`).
        pad_to_multiple_of: round L up with a padding segment (fixed shapes for compiled layers).

    Returns:
        input_ids, position_ids, completion_mask, labels, segment_ids, parent_ids,
        sequence_ids: [1, L] long. sequence_pair, sequence_role, scored_tokens: [S] long
        (S = K * B; completion k of group i is sequence k * B + i). sequence_tokens: [S]
        long, prompt + completion of each sequence (the tokens a padded row holds, whatever
        the layout). pair_tokens: [B] long, the tokens each group occupies.

    Raises:
        DataError: no groups, or groups with different numbers of completions.
    """
    if not groups:
        raise DataError("a packed batch needs at least one row, got none")
    k = len(groups[0][1])
    if any(len(c) != k for _, c in groups):
        raise DataError(f"every row of a packed batch needs {k} completion(s); got {[len(c) for _, c in groups]}")
    b, row = len(groups), _Row()
    pair_tokens = []
    sequence_tokens = [len(prompt) + len(completions[j]) for j in range(k) for prompt, completions in groups]
    for i, (prompt, completions) in enumerate(groups):
        before = len(row.cols["input_ids"])
        sequences = [j * b + i for j in range(k)]
        if share_prompt and prompt:
            parent = row.add(prompt[:-1], [0] * (len(prompt) - 1), 0, -1, -1)
            for s, comp in zip(sequences, completions):
                row.add(prompt[-1:] + comp, [0] + [1] * len(comp), len(prompt) - 1, parent, s)
        else:
            for s, comp in zip(sequences, completions):
                row.add(prompt + comp, [0] * len(prompt) + [1] * len(comp), 0, -1, s)
        pair_tokens.append(len(row.cols["input_ids"]) - before)
    if pad_to_multiple_of:
        extra = -len(row.cols["input_ids"]) % pad_to_multiple_of
        row.add([pad_token_id] * extra, [0] * extra, 0, -1, -1)
    batch = {key: torch.tensor([values], dtype=torch.long) for key, values in row.cols.items()}
    seq = batch["sequence_ids"][0]
    batch["scored_tokens"] = torch.bincount(seq[seq >= 0], minlength=k * b)
    batch["sequence_pair"] = torch.arange(b).repeat(k)
    batch["sequence_role"] = torch.arange(k).repeat_interleave(b)
    batch["pair_tokens"] = torch.tensor(pair_tokens, dtype=torch.long)
    batch["sequence_tokens"] = torch.tensor(sequence_tokens, dtype=torch.long)
    return batch


def segment_sums(values: Tensor, sequence_ids: Tensor, num_sequences: int) -> Tensor:
    """Per-sequence sums [S] of per-position values [R, L] (0 where unscored), in fp64, rounded once.

    Unscored positions carry exactly 0 and add it to sequence 0: no host sync for a mask.
    """
    ids = sequence_ids.reshape(-1).to(values.device)
    sums = torch.zeros(num_sequences, dtype=torch.float64, device=values.device)
    return sums.index_add(0, ids.clamp(min=0), values.reshape(-1).double()).to(values.dtype)


@dataclass(frozen=True, eq=False)  # compared by identity: the forward arguments are cached on it
class PackedRows:
    """Sequences in rows (module docstring): what the model is given and how its outputs are summed.

    Attributes:
        input_ids, position_ids: [R, L] long, what the model reads.
        segment_ids, parent_ids: [R, L] long, the attention structure (a position sees its own
            segment and its parent's; parent -1: none).
        labels: [R, L] long, the next token where it is scored, IGNORE_INDEX elsewhere.
        sequence_ids: [R, L] long, the sequence each scored position's log-prob is summed into
            (-1 where unscored).
        scored_tokens: [S] long, scored positions of each sequence.
        sequence_group: [S] long, the group of each sequence (pair, example, prompt).
        sequence_tokens: [S] long, prompt + completion tokens of each sequence (what a padded
            row holds: TRL's `num_tokens`, whatever the layout).
        padding_mask: [R, L] 1 on tokens, for padded rows (one sequence a row, sequence s in
            row s); None: packed rows, whose segments confine attention.
    """

    input_ids: Tensor
    position_ids: Tensor
    segment_ids: Tensor
    parent_ids: Tensor
    labels: Tensor
    sequence_ids: Tensor
    scored_tokens: Tensor
    sequence_group: Tensor
    sequence_tokens: Tensor
    padding_mask: Tensor | None = None
    # Forward arguments built once per model signature: the reference's forward in the step's
    # preparation and the policy's later share them (a dense mask is L x L).
    _forward: dict = field(default_factory=dict, compare=False, repr=False)

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_packed(cls, batch: Mapping[str, Tensor], prefix: str = "") -> "PackedRows":
        """The rows of a packed collated batch (`pack_groups`' keys, under `prefix`)."""
        get = lambda key: batch[prefix + key]  # noqa: E731
        return cls(get("input_ids"), get("position_ids"), get("segment_ids"), get("parent_ids"), get("labels"),
                   get("sequence_ids"), get("scored_tokens"), get("sequence_pair"), get("sequence_tokens"))

    @classmethod
    def from_padded(cls, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                    per_group: int = 1) -> "PackedRows":
        """Padded rows [R, T], one sequence each; `per_group` K: sequence s is of group s mod R / K
        (DPO's chosen rows then rejected rows: K = 2)."""
        labels = position_labels(input_ids, completion_mask)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        scored = labels != IGNORE_INDEX
        tokens = attention_mask.bool()
        return cls(
            input_ids=input_ids, position_ids=(attention_mask.long().cumsum(-1) - 1).clamp(min=0),
            segment_ids=torch.where(tokens, 0, -1), parent_ids=torch.full_like(input_ids, -1), labels=labels,
            sequence_ids=torch.where(scored, rows[:, None], -1), scored_tokens=scored.sum(-1),
            sequence_group=rows % max(input_ids.shape[0] // per_group, 1), sequence_tokens=attention_mask.sum(-1),
            padding_mask=attention_mask,
        )

    @classmethod
    def from_collated(cls, batch: Mapping[str, Tensor], *, packed: bool, prefix: str = "",
                      per_group: int = 1) -> "PackedRows":
        """A collator's batch as rows: packed (`from_packed`) or padded (`input_ids`, `attention_mask`,
        `completion_mask` under `prefix`)."""
        if packed:
            return cls.from_packed(batch, prefix)
        return cls.from_padded(batch[prefix + "input_ids"], batch[prefix + "attention_mask"],
                               batch[prefix + "completion_mask"], per_group)

    # ---------------------------------------------------------------- reading

    @property
    def num_sequences(self) -> int:
        return self.scored_tokens.shape[0]

    @property
    def one_sequence_a_row(self) -> bool:
        return self.padding_mask is not None

    def lengths(self) -> Tensor:
        """Scored tokens of each sequence [S]."""
        return self.scored_tokens

    def sums(self, values: Tensor) -> Tensor:
        """Per-sequence sums [S] of per-position values [R, L] (0 where unscored), in fp64, rounded once
        to the values' dtype (float32 for booleans); differentiable. Row sums when each row is one
        sequence: the loss-aware head sums those rows the same way."""
        values = values if values.is_floating_point() else values.float()
        if self.one_sequence_a_row:
            return values.double().sum(-1).to(values.dtype)
        return segment_sums(values, self.sequence_ids, self.num_sequences)

    def input_tokens(self) -> Tensor:
        """Tokens of the sequences as padded rows hold them, as a 0-dim tensor (TRL's `num_tokens`)."""
        return self.sequence_tokens.sum()

    def forward_tokens(self) -> int:
        """Positions the forward runs over, padding included."""
        return self.input_ids.numel()

    def model_inputs(self, model: Any) -> dict[str, Any]:
        """The forward's keyword arguments, built once per model signature (module docstring)."""
        from fusedalign.attention import attention_inputs, mask_signature

        if self.one_sequence_a_row:
            return {"input_ids": self.input_ids, "attention_mask": self.padding_mask}
        key = mask_signature(model)
        if key not in self._forward:
            self._forward[key] = attention_inputs(model, {k: getattr(self, k) for k in ROW_INPUTS})
        return self._forward[key]

    def row_loss(self, grad: Any) -> Any:
        """The loss-aware head's declaration: each group's sequences summed together (`head.RowLoss`)."""
        from fusedalign.head import RowLoss

        return RowLoss(self.sequence_group, grad, segments=None if self.one_sequence_a_row else self.sequence_ids)


def pack_prompt_groups(groups: Sequence[tuple[list[int], list[list[int]]]], max_tokens: int, *,
                       share_prompt: bool = True, pad_token_id: int = 0,
                       pad_to_multiple_of: int | None = None) -> list[tuple[list[int], PackedRows]]:
    """Packs prompt groups (a prompt and its G completions) into rows of at most `max_tokens` tokens.

    Best-fit decreasing over the groups' packed sizes (`data.packing`); a group is never split.
    With `share_prompt` (the default) each group's prompt is computed once and every completion
    attends to it and to itself only, at positions continuing from the prompt.

    Returns:
        [(the indices of the groups a row holds, in that row's order, the row)], one per row;
        within a row, completion k of its i-th group is sequence k * B + i (B groups in the row).

    Raises:
        DataError: a group occupies more than `max_tokens` tokens, or groups differ in G.
    """
    sizes = [group_tokens(len(p), [len(c) for c in comps], share_prompt) for p, comps in groups]
    for i, n in enumerate(sizes):
        if n > max_tokens:
            raise DataError(f"group {i}: {n} tokens in a packed row, over the budget of {max_tokens} tokens")
    packed = []
    for members in _bins(sizes, max_tokens):
        members = sorted(members)
        batch = pack_groups([groups[i] for i in members], share_prompt=share_prompt, pad_token_id=pad_token_id,
                            pad_to_multiple_of=pad_to_multiple_of)
        packed.append((members, PackedRows.from_packed(batch)))
    return packed
