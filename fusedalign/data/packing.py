"""Packing: several tokenised sequences per row, best-fit decreasing, with position_ids."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any


def _bins(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Best-fit decreasing: longest first, each into the fullest bin it still fits in."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (space left, bin id)
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))  # the first bin with at least n tokens free
        if at < len(free):
            space, b = free.pop(at)
        else:
            space, b = max_length, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (space - n, b))
    return bins


def pack_sequences(examples: Sequence[Mapping[str, Any]], max_length: int) -> list[dict]:
    """Packs tokenised sequences into rows of at most `max_length` tokens.

    Args:
        examples: rows with `input_ids` and, optionally, `completion_mask` (all ones if
            absent); other keys are dropped.
        max_length: the most tokens in a packed row.

    Returns:
        One dict per packed row: `input_ids`, `completion_mask`, `position_ids`
        (restarting at 0 at each sequence) and `seq_lengths`, for
        `SFTCollator(padding_free=True)`.

    Raises:
        ValueError: a sequence is empty or longer than `max_length` (truncate first).
    """
    lengths = [len(e["input_ids"]) for e in examples]
    for i, n in enumerate(lengths):
        if n == 0 or n > max_length:
            raise ValueError(
                f"row {i}: sequence of {n} tokens cannot be packed into rows of max_length={max_length}; "
                "expected 1..max_length tokens (truncate with max_length when tokenising)"
            )
    packed = []
    for members in _bins(lengths, max_length):
        row = {"input_ids": [], "completion_mask": [], "position_ids": [], "seq_lengths": []}
        for i in members:
            ids = list(examples[i]["input_ids"])
            row["input_ids"] += ids
            mask = examples[i]["completion_mask"] if "completion_mask" in examples[i] else [1] * len(ids)
            row["completion_mask"] += list(mask)
            row["position_ids"] += list(range(len(ids)))
            row["seq_lengths"].append(len(ids))
        packed.append(row)
    return packed


def pack_dataset(dataset: Any, max_length: int):
    """`pack_sequences` over a `datasets.Dataset`; returns a new `Dataset`."""
    from datasets import Dataset

    columns = [c for c in ("input_ids", "completion_mask") if c in dataset.column_names]
    return Dataset.from_list(pack_sequences(dataset.select_columns(columns).to_list(), max_length))
