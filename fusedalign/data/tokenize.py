"""Tokenisation of a whole dataset for each trainer.

The `prepare_*` functions validate the whole dataset's columns and the tokenizer, map the
row function (`fusedalign.data.tokenize_rows`) over it, and count the rows that were
truncated, so that every data error surfaces before training starts; they warn once about
rows still longer than the tokenizer's `model_max_length`.

The row functions and the token-id helpers (`fusedalign.data.token_ids`) are re-exported
here under their old names, so `from fusedalign.data.tokenize import ...` keeps working.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Mapping, NamedTuple

from .formats import DataError, DataFormat, detect_format, validate_dataset
from .token_ids import TRUNCATION_MODES, _check_mode, extract_prompt, truncate_pair
from .tokenize_rows import completion_only, tokenize_dpo_row, tokenize_kto_row, tokenize_prompt_row, tokenize_sft_row

__all__ = [
    "TRUNCATION_MODES", "TokenizeStats", "completion_only", "extract_prompt", "prepare_dpo_dataset",
    "prepare_kto_dataset", "prepare_sft_dataset", "tokenize_dpo_row", "tokenize_kto_row", "tokenize_prompt_row",
    "tokenize_sft_row", "truncate_pair",
]
logger = logging.getLogger(__name__)


class TokenizeStats(NamedTuple):
    """What a `prepare_*` function did.

    Attributes:
        format: the detected dataset format.
        num_rows: rows in the tokenised dataset.
        num_truncated: rows shortened by a length limit (none is ever dropped).
    """

    format: DataFormat
    num_rows: int
    num_truncated: int


def _prepare(dataset: Any, tokenizer: Any, expected: str, row_fn: Callable, *,
             map_kwargs: dict | None = None, **options: Any):
    if len(dataset) == 0:
        raise DataError("the dataset is empty: expected at least one row")
    fmt = validate_dataset(dataset, expected, tokenizer,
                           assistant_only_loss=options.get("assistant_only_loss", False), check_rows=False)
    fn = partial(_indexed, row_fn=row_fn, tokenizer=tokenizer, fmt=fmt, **options)
    kwargs = {"desc": f"Tokenizing ({fmt.name})", **(map_kwargs or {})}
    out = dataset.map(fn, with_indices=True, remove_columns=dataset.column_names, **kwargs)
    num_truncated = int(sum(out["truncated"]))
    _warn_over_model_limit(out, tokenizer)
    return out.remove_columns("truncated"), TokenizeStats(fmt, len(out), num_truncated)


def _warn_over_model_limit(out: Any, tokenizer: Any) -> None:
    """Warns once about rows that stay longer than the tokenizer's model_max_length after truncation."""
    limit = getattr(tokenizer, "model_max_length", None)
    if not isinstance(limit, int) or not 0 < limit < 10**9:  # transformers' "no limit" is ~1e30
        return
    prompt = out["prompt_ids"] if "prompt_ids" in out.column_names else None
    others = [out[c] for c in out.column_names if c.endswith("_ids") and c != "prompt_ids"]
    lengths = [max(len(ids[i]) for ids in others) + (len(prompt[i]) if prompt is not None else 0)
               for i in range(len(out))]
    over = sum(n > limit for n in lengths)
    if over:
        logger.warning(
            "%d of %d rows are longer than the model's limit (model_max_length=%d tokens, longest %d) after "
            "truncation; set max_length to at most %d unless the model handles longer inputs.",
            over, len(lengths), limit, max(lengths), limit)


def _indexed(row: Mapping, index: int, row_fn: Callable, **kwargs: Any) -> dict:
    return row_fn(row, index=index, **kwargs)


def prepare_dpo_dataset(dataset: Any, tokenizer: Any, *, max_prompt_length: int | None = None,
                        max_completion_length: int | None = None, max_length: int | None = None,
                        truncation_mode: str = "keep_end", map_kwargs: dict | None = None):
    """Validates and tokenises a preference dataset for DPO.

    Returns:
        (dataset with columns `prompt_ids, chosen_ids, rejected_ids`, `TokenizeStats`).

    Raises:
        DataError: bad columns, rows or tokenizer (before any training).
    """
    _check_mode(truncation_mode)
    return _prepare(dataset, tokenizer, "dpo", tokenize_dpo_row, map_kwargs=map_kwargs,
                    max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                    max_length=max_length, truncation_mode=truncation_mode)


def prepare_kto_dataset(dataset: Any, tokenizer: Any, *, max_prompt_length: int | None = None,
                        max_completion_length: int | None = None, max_length: int | None = None,
                        truncation_mode: str = "keep_end", map_kwargs: dict | None = None):
    """Validates and tokenises an unpaired preference dataset for KTO.

    Returns:
        (dataset with columns `prompt_ids, completion_ids, label`, `TokenizeStats`).
    """
    _check_mode(truncation_mode)
    return _prepare(dataset, tokenizer, "kto", tokenize_kto_row, map_kwargs=map_kwargs,
                    max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                    max_length=max_length, truncation_mode=truncation_mode)


def prepare_sft_dataset(dataset: Any, tokenizer: Any, *, completion_only_loss: bool | None = None,
                        assistant_only_loss: bool = False, max_length: int | None = None,
                        truncation_mode: str = "keep_start", map_kwargs: dict | None = None):
    """Validates and tokenises a language-modeling or prompt-completion dataset for SFT.

    Returns:
        (dataset with columns `input_ids, completion_mask`, `TokenizeStats`).

    Raises:
        DataError: as `_prepare`; and `completion_only_loss=True` on language-modeling data,
            once for the dataset rather than at its first row.
    """
    _check_mode(truncation_mode)
    if completion_only_loss and len(dataset):
        completion_only(completion_only_loss, detect_format(dataset, "sft"))
    return _prepare(dataset, tokenizer, "sft", tokenize_sft_row, map_kwargs=map_kwargs,
                    assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss,
                    max_length=max_length, truncation_mode=truncation_mode)
