"""Prompt-only data for GRPO: validated and tokenised once, every other column kept for the rewards.

Rows are standard (`prompt` a string) or conversational (`prompt` a list of messages; the chat
template is applied with the generation prompt). A `completion` column is accepted and, as in
TRL, not passed to reward functions; any other column is, by name, so it must not clash with
the reward call's keywords (`prompts`, `completions`, `completion_ids`, ...). Each row gets
`prompt_ids` (the last `max_prompt_length` tokens) and `row_index` (its index in the dataset:
the stable key of its completions, for generation and replay).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping

from fusedalign.rewards.api import RESERVED

from .formats import DataError, DataFormat, validate_dataset
from .tokenize import TokenizeStats
from .tokenize_rows import tokenize_prompt_row

PROMPT_KINDS = ("prompt_only", "prompt_completion")


def _row(row: Mapping, index: int, tokenizer: Any, fmt: DataFormat, max_prompt_length: int | None) -> dict:
    out = tokenize_prompt_row(row, tokenizer, max_prompt_length=max_prompt_length, index=index, fmt=fmt)
    return {**out, "row_index": index}


def prepare_prompt_dataset(dataset: Any, tokenizer: Any, *, max_prompt_length: int | None = None,
                           map_kwargs: dict | None = None):
    """Validates and tokenises a prompt dataset for GRPO.

    Returns:
        (dataset with its columns plus `prompt_ids` and `row_index`, `TokenizeStats`).

    Raises:
        DataError: no `prompt` column, another format's columns, a bad row, a column that
            clashes with the reward functions' arguments, or an empty dataset (before training).
    """
    if len(dataset) == 0:
        raise DataError("the dataset is empty: expected at least one row")
    if "prompt" not in dataset.column_names:
        raise DataError(f"missing column 'prompt' (all rows): GRPO expects prompts (a string or a list of messages); "
                        f"dataset columns: {sorted(dataset.column_names)}")
    clash = sorted(set(dataset.column_names) & set(RESERVED + ("prompt_ids", "row_index")))
    if clash:
        raise DataError(f"column {clash[0]!r} clashes with an argument of the reward functions or a column GRPO "
                        f"adds ({', '.join(RESERVED + ('prompt_ids', 'row_index'))}); rename it")
    if max_prompt_length is not None and max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be >= 1 or None; got {max_prompt_length}")
    fmt = validate_dataset(dataset, PROMPT_KINDS, tokenizer, check_rows=False)
    prompt_fmt = DataFormat("prompt_only", fmt.conversational)  # the completion column is not generated from
    fn = partial(_row, tokenizer=tokenizer, fmt=prompt_fmt, max_prompt_length=max_prompt_length)
    kwargs = {"desc": f"Tokenizing prompts ({fmt.name})", **(map_kwargs or {})}
    out = dataset.map(fn, with_indices=True, **kwargs)
    num_truncated = int(sum(out["truncated"]))
    return out.remove_columns("truncated"), TokenizeStats(fmt, len(out), num_truncated)
