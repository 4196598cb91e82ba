"""A trainer's view of a dataset split: validated, tokenised (or taken as tokenised), truncation reported.

A split whose columns are already token ids (DPO: `prompt_ids`, `chosen_ids`,
`rejected_ids`; KTO: `prompt_ids`, `completion_ids`, `label`; SFT: `input_ids` and
optionally `completion_mask`, which `completion_only_loss=False` sets aside) is used as it
is: no text tokenisation, the same truncation rules, no column added.
"""

from __future__ import annotations

import logging
from typing import Any

from .formats import DataError
from .token_ids import truncate_pair
from .tokenize import prepare_dpo_dataset, prepare_kto_dataset, prepare_sft_dataset

logger = logging.getLogger(__name__)

TOKENISED_COLUMNS: dict[str, tuple[str, ...]] = {
    "dpo": ("prompt_ids", "chosen_ids", "rejected_ids"),
    "kto": ("prompt_ids", "completion_ids", "label"),
    "sft": ("input_ids",),
}
_PREPARE = {"dpo": prepare_dpo_dataset, "kto": prepare_kto_dataset, "sft": prepare_sft_dataset}


def is_tokenised(dataset: Any, kind: str) -> bool:
    """Whether `dataset` already holds the token-id columns of trainer `kind` (GRPO takes prompts only)."""
    return kind in TOKENISED_COLUMNS and set(TOKENISED_COLUMNS[kind]) <= set(dataset.column_names)


def prepare_split(kind: str, dataset: Any, tokenizer: Any, split: str, **options: Any) -> Any:
    """The split ready for trainer `kind` ("dpo", "kto", "sft"); None stays None.

    Args:
        kind: the trainer.
        dataset: a `datasets.Dataset`, text (any format the trainer reads) or tokenised.
        tokenizer: the policy's tokenizer.
        split: "train" or "eval", for messages.
        **options: the tokenisation options of `data.prepare_<kind>_dataset` (truncation).

    Raises:
        DataError: bad columns or rows (naming the split, row and column).
    """
    if dataset is None:
        return None
    if is_tokenised(dataset, kind):
        dataset, truncated = _truncate_tokenised(kind, dataset, split, options)
        rows = len(dataset)
    else:
        dataset, stats = _PREPARE[kind](dataset, tokenizer, **options)
        truncated, rows = stats.num_truncated, stats.num_rows
    if truncated:
        logger.warning("%s split: %d of %d rows were truncated to fit max_length/max_prompt_length (none were dropped).",
                       split, truncated, rows)
    _check_something_trains(kind, dataset, split)
    return dataset


def _lengths(dataset: Any, column: str) -> list[int]:
    """Each row's length of a list column, read in Arrow (the rows as the dataset orders them)."""
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.with_format("arrow")[column]).to_pylist()


_WHAT_DECIDES = {"sft": "max_length, truncation_mode and completion_only_loss/assistant_only_loss",
                 "dpo": "max_length, max_prompt_length and truncation_mode",
                 "kto": "max_length, max_prompt_length and truncation_mode"}


def _check_something_trains(kind: str, dataset: Any, split: str) -> None:
    """The rows with no token to learn from, after tokenisation and truncation: SFT, no loss token past
    the first (which nothing predicts); DPO, neither answer has a token; KTO, the completion has none.
    They add nothing to the loss: some are said, all of a split is refused.

    Raises:
        DataError: no row of the split has a token to learn from.
    """
    if kind == "dpo":
        empty = [c == 0 and r == 0 for c, r in zip(_lengths(dataset, "chosen_ids"), _lengths(dataset, "rejected_ids"))]
    elif kind == "kto":
        empty = [n == 0 for n in _lengths(dataset, "completion_ids")]
    else:
        empty = [not any(mask[1:]) for mask in dataset["completion_mask"]]
    count = sum(empty)
    if count and count == len(empty):
        raise DataError(f"{split} split: none of its {count} rows has a token to learn from after tokenisation and "
                        f"truncation (the completion is empty or was cut off); check {_WHAT_DECIDES[kind]}.")
    if count:
        logger.warning("%s split: %d of %d rows have no token to learn from (kept; they add nothing to the loss).",
                       split, count, len(empty))


def _truncate_tokenised(kind: str, dataset: Any, split: str, options: dict[str, Any]) -> tuple[Any, int]:
    columns = TOKENISED_COLUMNS[kind]
    if len(dataset) == 0:
        raise DataError(f"{split} split is empty: expected at least one row")
    completions = {"dpo": ("chosen_ids", "rejected_ids"), "kto": ("completion_ids",), "sft": ()}[kind]
    keep = [c for c in dataset.column_names if c in columns or c in ("completion_mask", "kl_completion_ids")]

    def truncate(row: dict, index: int) -> dict:
        for column in columns:
            value = row[column]
            ok = isinstance(value, bool) if column == "label" else (
                isinstance(value, list) and all(isinstance(t, int) for t in value))
            if not ok:
                what = "a boolean" if column == "label" else "a list of token ids (ints)"
                raise DataError(f"{split} split, row {index} (from 0), column {column!r}: expected {what}, "
                                f"got {type(value).__name__}")
        if kind == "sft":
            return _truncate_sft(row, options)
        prompt, outs, cut = truncate_pair(
            row["prompt_ids"], [row[c] for c in completions], max_prompt_length=options.get("max_prompt_length"),
            max_completion_length=options.get("max_completion_length"), max_length=options.get("max_length"),
            truncation_mode=options.get("truncation_mode", "keep_end"),
        )
        return {"prompt_ids": prompt, **dict(zip(completions, outs)), "_truncated": cut}

    out = dataset.select_columns(keep).map(truncate, with_indices=True, desc=f"Truncating ({split})")
    truncated = int(sum(out["_truncated"]))
    return out.remove_columns("_truncated"), truncated


def _truncate_sft(row: dict, options: dict[str, Any]) -> dict:
    ids = row["input_ids"]
    # completion_only_loss=False learns every token, whatever completion_mask the rows carry.
    keep_mask = options.get("completion_only_loss") is not False
    mask = (row.get("completion_mask") if keep_mask else None) or [1] * len(ids)
    limit = options.get("max_length")
    cut = limit is not None and len(ids) > limit
    if cut:
        part = slice(0, limit) if options.get("truncation_mode", "keep_start") == "keep_start" else slice(len(ids) - limit, None)
        ids, mask = ids[part], mask[part]
    return {"input_ids": ids, "completion_mask": mask, "_truncated": cut}
