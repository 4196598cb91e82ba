"""Conversions between formats, applied only when asked for."""

from __future__ import annotations

from typing import Any

from .formats import detect_format
from .token_ids import extract_prompt


def unpair_preference_dataset(dataset: Any):
    """Turns paired preference data into unpaired data for KTO.

    Row i `{prompt, chosen, rejected}` (or implicit `{chosen, rejected}`) becomes rows
    2i `{prompt, completion: chosen, label: True}` and 2i+1 `{prompt, completion:
    rejected, label: False}`; standard or conversational as the input. Other columns are
    dropped.

    Args:
        dataset: a `datasets.Dataset` in preference or implicit-preference format.

    Returns:
        A `datasets.Dataset` in unpaired-preference format, twice as long.

    Raises:
        DataError: the dataset is not paired preference data, or an implicit prompt cannot
            be extracted (naming the row).
    """
    fmt = detect_format(dataset, "dpo")

    def unpair(batch: dict, indices: list[int]) -> dict:
        out = {"prompt": [], "completion": [], "label": []}
        for j, index in enumerate(indices):
            row = {k: batch[k][j] for k in fmt.columns}
            if fmt.kind == "implicit_preference":
                row = extract_prompt(row, index)
            out["prompt"] += [row["prompt"], row["prompt"]]
            out["completion"] += [row["chosen"], row["rejected"]]
            out["label"] += [True, False]
        return out

    return dataset.map(unpair, batched=True, with_indices=True, remove_columns=dataset.column_names,
                       desc="Unpairing preference data")
