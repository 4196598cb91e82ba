"""Collators: pad tokenised rows into tensors, and position-aligned labels.

Every collator pads on the right with `pad_token_id` and returns `attention_mask` (1 on
real tokens) and `completion_mask` (1 on the tokens a loss is taken on). Labels are not
built here: a trainer calls `position_labels` on what it is about to score.

Scalar per-row values the trainer added to the dataset (precomputed reference log-probs,
say `ref_chosen_logps`) pass through as `[B]` tensors under their own names.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Number

import torch
from torch import Tensor

from .formats import DataError


def pad(sequences: Sequence[Sequence[int]], value: int, pad_to_multiple_of: int | None = None) -> Tensor:
    """Right-pads lists of ints into a `[B, T]` long tensor.

    Args:
        sequences: B lists of ints.
        value: the padding value.
        pad_to_multiple_of: round T up to a multiple of this.

    Returns:
        `[B, T]` with T the longest length (rounded up).
    """
    length = max((len(s) for s in sequences), default=0)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    out = torch.full((len(sequences), length), value, dtype=torch.long)
    for i, s in enumerate(sequences):
        if len(s):
            out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


def position_labels(input_ids: Tensor, completion_mask: Tensor, ignore_index: int = -100,
                    position_ids: Tensor | None = None) -> Tensor:
    """Labels aligned to positions: what each position predicts, where it is scored.

    `labels[b, t] = input_ids[b, t + 1]` if `completion_mask[b, t + 1]` else
    `ignore_index`; the last column is `ignore_index`. With packed rows
    (`position_ids` restarting at 0 per sequence), a position never predicts the first
    token of the next sequence.

    Args:
        input_ids: [B, T] token ids.
        completion_mask: [B, T] 1 (or True) on scored tokens; 0 on prompt and padding.
        ignore_index: the label of unscored positions.
        position_ids: [B, T] optional, for packed rows.

    Returns:
        labels: [B, T] long.
    """
    scored = completion_mask[:, 1:].bool()  # [B, T-1]: is the *next* token scored?
    if position_ids is not None:
        scored = scored & (position_ids[:, 1:] != 0)
    labels = torch.full_like(input_ids, ignore_index)
    labels[:, :-1] = torch.where(scored, input_ids[:, 1:], torch.full_like(input_ids[:, 1:], ignore_index))
    return labels


def row_keys(features: Sequence[Mapping], fields: Sequence[str]) -> Tensor:
    """A 64-bit hash of each row's token lists `fields`, `[B]` int64.

    Identifies a row by its content (the same tokens give the same key whatever the
    dataset, order or rank), so that per-row values can be stored without adding a
    column to the user's dataset.
    """
    keys = []
    for f in features:
        digest = hashlib.blake2b(digest_size=8)
        for name in fields:
            digest.update(array("q", f[name]).tobytes())
            digest.update(b"|")
        keys.append(int.from_bytes(digest.digest(), "little", signed=True))
    return torch.tensor(keys, dtype=torch.long)


def _scalars(features: Sequence[Mapping], used: set[str]) -> dict[str, Tensor]:
    """Per-row numbers other than the token lists, as [B] tensors."""
    out = {}
    for key, value in features[0].items():
        if key in used or not isinstance(value, (Number, bool)):
            continue
        out[key] = torch.tensor([f[key] for f in features])
    return out


def _concat(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]):
    ids = [list(p) + list(c) for p, c in zip(prompts, completions)]
    masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)]
    return ids, masks


def _padded(ids: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], pad_token_id: int,
            multiple: int | None, prefix: str = "") -> dict[str, Tensor]:
    return {
        f"{prefix}input_ids": pad(ids, pad_token_id, multiple),
        f"{prefix}attention_mask": pad([[1] * len(s) for s in ids], 0, multiple),
        f"{prefix}completion_mask": pad(masks, 0, multiple),
    }


@dataclass
class DPOCollator:
    """Batches DPO rows: chosen and rejected in one forward.

    Input rows: `prompt_ids, chosen_ids, rejected_ids` (from `tokenize_dpo_row`).

    Output:
        input_ids: [2B, T] prompt + chosen for rows 0..B-1, then prompt + rejected.
        attention_mask: [2B, T].
        completion_mask: [2B, T] 1 on completion tokens.
        row_key: [B] int64, a hash of each row's token ids (only with `row_keys`): the key
            of precomputed reference log-probs.
        plus any scalar columns as [B] tensors.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    row_keys: bool = False

    def __call__(self, features: Sequence[Mapping]) -> dict[str, Tensor]:
        prompts = [f["prompt_ids"] for f in features]
        ids, masks = _concat(prompts + prompts,
                             [f["chosen_ids"] for f in features] + [f["rejected_ids"] for f in features])
        batch = _padded(ids, masks, self.pad_token_id, self.pad_to_multiple_of)
        batch.update(_scalars(features, {"prompt_ids", "chosen_ids", "rejected_ids"}))
        if self.row_keys:
            batch["row_key"] = row_keys(features, ("prompt_ids", "chosen_ids", "rejected_ids"))
        return batch


@dataclass
class KTOCollator:
    """Batches KTO rows (the KL partners of KTO's reference point are added by `data.kto`).

    Input rows: `prompt_ids, completion_ids, label` (from `tokenize_kto_row`).

    Output:
        input_ids, attention_mask, completion_mask: [B, T] prompt i + completion i.
        label: [B] bool.
        plus any other scalar columns as [B] tensors.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[Mapping]) -> dict[str, Tensor]:
        prompts = [f["prompt_ids"] for f in features]
        completions = [f["completion_ids"] for f in features]
        batch = _padded(*_concat(prompts, completions), self.pad_token_id, self.pad_to_multiple_of)
        batch["label"] = torch.tensor([bool(f["label"]) for f in features], dtype=torch.bool)
        batch.update(_scalars(features, {"prompt_ids", "completion_ids", "label"}))
        return batch


@dataclass
class SFTCollator:
    """Batches SFT rows (`input_ids, completion_mask`), padded or padding-free.

    Padded output: `input_ids, attention_mask, completion_mask` [B, T].

    Padding-free output (`padding_free=True`, and for packed rows): every row is
    concatenated into one, `input_ids, completion_mask, position_ids` [1, L], with
    `position_ids` restarting at 0 at each sequence (and each sequence inside a packed row)
    and **no** `attention_mask`: transformers then builds a block-diagonal causal mask from
    `position_ids` (only when `attention_mask` is None and no KV cache is used, so call
    the model with `use_cache=False`), and no token attends across a sequence boundary.
    Labels must come from `position_labels` with these `position_ids`;
    `example_ids` [1, L] says which input row each position came from.

    Raises:
        DataError: packed rows (with `position_ids`) in padded mode, which would let
            packed sequences attend to each other.
    """

    pad_token_id: int
    padding_free: bool = False
    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[Mapping]) -> dict[str, Tensor]:
        ids = [f["input_ids"] for f in features]
        masks = [f["completion_mask"] if "completion_mask" in f else [1] * len(f["input_ids"])
                 for f in features]
        if not self.padding_free:
            if any("position_ids" in f for f in features):
                raise DataError(
                    "packed rows (with position_ids) need SFTCollator(padding_free=True): padded "
                    "batches carry an attention_mask, under which packed sequences would attend "
                    "to each other"
                )
            batch = _padded(ids, masks, self.pad_token_id, self.pad_to_multiple_of)
        else:
            positions = [f["position_ids"] if "position_ids" in f else range(len(f["input_ids"]))
                         for f in features]
            batch = {
                "input_ids": torch.tensor([[t for s in ids for t in s]], dtype=torch.long),
                "completion_mask": torch.tensor([[m for s in masks for m in s]], dtype=torch.long),
                "position_ids": torch.tensor([[p for s in positions for p in s]], dtype=torch.long),
                # which example (dataset row) each position came from: per-example metrics
                "example_ids": torch.tensor([[i for i, s in enumerate(ids) for _ in s]], dtype=torch.long),
            }
        batch.update(_scalars(features, {"input_ids", "completion_mask", "position_ids", "seq_lengths"}))
        return batch
