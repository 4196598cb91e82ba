"""Tokenisation for each trainer.

Row functions (`tokenize_dpo_row`, `tokenize_kto_row`, `tokenize_sft_row`) take one
row and return plain lists of token ids, so they work with `Dataset.map`; each checks its
row first (`fusedalign.data.formats.check_row`). The `prepare_*` wrappers validate
the whole dataset's columns and the tokenizer, map the row function over it, and count the
rows that were truncated, so that every data error surfaces before training starts.

Standard rows: the prompt is tokenised with the tokenizer's special tokens (a BOS where the
tokenizer adds one), each completion without, followed by EOS. Conversational rows: the
prompt is rendered with the chat template and `add_generation_prompt=True`; a completion
is the rendered conversation (prompt + completion messages) minus that prefix, which must
be a token-level prefix (checked; an error otherwise).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable, Mapping, NamedTuple

from .formats import DataError, DataFormat, check_row, detect_format, row_name, validate_dataset

TRUNCATION_MODES = ("keep_end", "keep_start")
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


# ----------------------------------------------------------------------------- helpers


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    # verbose=False: the tokenizer would warn about rows longer than the model's limit, rows that
    # the truncation below then cuts; `_prepare` warns itself about the rows it does not cut.
    return list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


def _with_eos(tokenizer: Any, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos token: completions must end with one")
    return ids + [eos]


def _chat(tokenizer: Any, messages: list, *, add_generation_prompt: bool = False,
          assistant_mask: bool = False) -> tuple[list[int], list[int] | None]:
    out = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        add_generation_prompt=add_generation_prompt,
        return_assistant_tokens_mask=assistant_mask,
        tokenizer_kwargs={"verbose": False},  # as in _ids
    )
    ids = list(out["input_ids"])
    return ids, (list(out["assistant_masks"]) if assistant_mask else None)


def _split_chat(tokenizer: Any, prompt: list, completion: list, index: int | None, column: str,
                assistant_mask: bool = False, prompt_ids: list[int] | None = None,
                ) -> tuple[list[int], list[int], list[int] | None]:
    """(prompt ids, completion ids, assistant mask of the whole conversation or None)."""
    if prompt_ids is None:
        prompt_ids, _ = _chat(tokenizer, prompt, add_generation_prompt=True)
    full_ids, mask = _chat(tokenizer, list(prompt) + list(completion), assistant_mask=assistant_mask)
    n = len(prompt_ids)
    if full_ids[:n] != prompt_ids:
        raise DataError(
            f"{row_name(index)}, column {column!r}: the chat template renders the prompt (with "
            "add_generation_prompt=True) differently from the start of prompt + completion, so "
            "the completion tokens cannot be told apart; use a chat template whose generation "
            "prompt is a prefix of the rendered conversation", row=index,
        )
    if len(full_ids) == n:
        raise DataError(f"{row_name(index)}, column {column!r}: the completion renders to no tokens", row=index)
    return prompt_ids, full_ids[n:], mask


def _check_mode(truncation_mode: str) -> None:
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {truncation_mode!r}")


def truncate_pair(
    prompt_ids: list[int],
    completions: list[list[int]],
    *,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    max_length: int | None = None,
    truncation_mode: str = "keep_end",
) -> tuple[list[int], list[list[int]], bool]:
    """Truncates a prompt and the completions that share it.

    In order: the prompt keeps its last `max_prompt_length` tokens; each completion its
    first `max_completion_length`; then, if prompt + the longest completion exceeds
    `max_length`, as TRL's `truncation_mode`: `"keep_end"` drops tokens from the
    start of the prompt (then, if a completion alone is too long, from that completion's
    start); `"keep_start"` drops tokens from the end of the completions (and of the prompt
    if it alone is too long, leaving no completion). The prompt stays shared, so with
    `"keep_end"` a shorter completion may lose more prompt than it strictly needed to.

    Returns:
        (prompt ids, completion ids, whether anything was cut).
    """
    _check_mode(truncation_mode)
    before = (len(prompt_ids), [len(c) for c in completions])
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids = prompt_ids[len(prompt_ids) - max_prompt_length:]
    if max_completion_length is not None:
        completions = [c[:max_completion_length] for c in completions]
    if max_length is not None:
        longest = max(len(c) for c in completions)
        if len(prompt_ids) + longest > max_length:
            if truncation_mode == "keep_start":
                prompt_ids = prompt_ids[:max_length]
                completions = [c[: max_length - len(prompt_ids)] for c in completions]
            else:
                keep = max(0, max_length - longest)
                prompt_ids = prompt_ids[len(prompt_ids) - keep:]
                completions = [c[len(c) - max_length:] if len(c) > max_length else c for c in completions]
    after = (len(prompt_ids), [len(c) for c in completions])
    return prompt_ids, completions, after != before


def extract_prompt(row: Mapping, index: int | None = None) -> dict:
    """Splits an implicit-prompt preference row into prompt, chosen and rejected.

    The prompt is the longest common prefix of `chosen` and `rejected`: whole messages
    for conversational rows; for strings, cut back to a whitespace boundary so that each
    completion starts with its separator (as `" ugly."` after `"... better than"`).

    Raises:
        DataError: chosen equals rejected, no common prefix, or nothing left of a completion.
    """
    chosen, rejected = row["chosen"], row["rejected"]
    if chosen == rejected:
        raise DataError(f"{row_name(index)}, columns 'chosen'/'rejected': identical; expected them to differ",
                        row=index)
    if isinstance(chosen, list):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        cut = n
    else:
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        cut = next((i for i in range(n, 0, -1)
                    if chosen[i:i + 1].isspace() and rejected[i:i + 1].isspace()), n)
    if cut == 0:
        raise DataError(
            f"{row_name(index)}, columns 'chosen'/'rejected': no common prefix to use as the prompt; "
            "expected both to start with the same prompt (or add a 'prompt' column)", row=index,
        )
    out = {"prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}
    for column in ("chosen", "rejected"):
        if not out[column] or (isinstance(out[column], str) and not out[column].strip()):
            raise DataError(
                f"{row_name(index)}, column {column!r}: empty after removing the common prompt; "
                "expected chosen and rejected to differ after the prompt", row=index,
            )
    return out


# ---------------------------------------------------------------------------- row maps


def _row_format(row: Mapping, fmt: DataFormat | None, expected: str) -> DataFormat:
    return fmt if fmt is not None else detect_format(row, expected)


def _prompt_and_completions(row: Mapping, tokenizer: Any, fmt: DataFormat, columns: tuple[str, ...],
                            index: int | None) -> tuple[list[int], list[list[int]]]:
    if fmt.conversational:
        prompt_ids, _ = _chat(tokenizer, row["prompt"], add_generation_prompt=True)
        splits = [_split_chat(tokenizer, row["prompt"], row[c], index, c, prompt_ids=prompt_ids)
                  for c in columns]
        return prompt_ids, [s[1] for s in splits]
    prompt_ids = _ids(tokenizer, row["prompt"], special=True)
    if not prompt_ids:
        raise DataError(f"{row_name(index)}, column 'prompt': the prompt tokenises to nothing", row=index)
    return prompt_ids, [_with_eos(tokenizer, _ids(tokenizer, row[c], special=False)) for c in columns]


def tokenize_dpo_row(
    row: Mapping,
    tokenizer: Any,
    *,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    max_length: int | None = None,
    truncation_mode: str = "keep_end",
    index: int | None = None,
    fmt: DataFormat | None = None,
) -> dict:
    """Tokenises a preference row (explicit or implicit prompt, standard or conversational).

    Args:
        row: `{prompt, chosen, rejected}` or `{chosen, rejected}`.
        tokenizer: a tokenizer (with a chat template for conversational rows).
        max_prompt_length, max_completion_length, max_length, truncation_mode: see
            `truncate_pair`.
        index: the row's index, for error messages.
        fmt: the dataset format (detected from the row if None).

    Returns:
        `{"prompt_ids", "chosen_ids", "rejected_ids": list[int], "truncated": bool}`.
    """
    fmt = _row_format(row, fmt, "dpo")
    check_row(row, index, fmt)
    if fmt.kind == "implicit_preference":
        row = extract_prompt(row, index)
    prompt_ids, completions = _prompt_and_completions(row, tokenizer, fmt, ("chosen", "rejected"), index)
    prompt_ids, (chosen_ids, rejected_ids), truncated = truncate_pair(
        prompt_ids, completions, max_prompt_length=max_prompt_length,
        max_completion_length=max_completion_length, max_length=max_length,
        truncation_mode=truncation_mode,
    )
    return {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids,
            "truncated": truncated}


def tokenize_kto_row(
    row: Mapping,
    tokenizer: Any,
    *,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    max_length: int | None = None,
    truncation_mode: str = "keep_end",
    index: int | None = None,
    fmt: DataFormat | None = None,
) -> dict:
    """Tokenises an unpaired preference row `{prompt, completion, label}`.

    Returns:
        `{"prompt_ids", "completion_ids": list[int], "label": bool, "truncated": bool}`.
    """
    fmt = _row_format(row, fmt, "kto")
    check_row(row, index, fmt)
    prompt_ids, completions = _prompt_and_completions(row, tokenizer, fmt, ("completion",), index)
    prompt_ids, (completion_ids,), truncated = truncate_pair(
        prompt_ids, completions, max_prompt_length=max_prompt_length,
        max_completion_length=max_completion_length, max_length=max_length,
        truncation_mode=truncation_mode,
    )
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "label": row["label"],
            "truncated": truncated}


def completion_only(completion_only_loss: bool | None, fmt: DataFormat) -> bool:
    """Whether SFT learns the completion alone, by TRL's rule for `completion_only_loss`.

    None (the default) learns the completion of prompt-completion data and every token of
    language-modeling data; False learns every token.

    Raises:
        DataError: True on language-modeling data, which has no completion to learn alone.
    """
    if fmt.kind != "language_modeling":
        return completion_only_loss is not False
    if completion_only_loss:
        raise DataError(
            f"completion_only_loss=True needs prompt-completion data (prompt and completion columns), but the "
            f"dataset is {fmt.name}; leave it unset (None: every token of language-modeling data) or set it to false"
        )
    return False


def tokenize_sft_row(
    row: Mapping,
    tokenizer: Any,
    *,
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    index: int | None = None,
    fmt: DataFormat | None = None,
) -> dict:
    """Tokenises a language-modeling or prompt-completion row for SFT.

    `completion_mask` marks the tokens the loss is taken on: every token for language
    modeling; for prompt-completion data, the completion only unless `completion_only_loss`
    is False (see `completion_only`); with `assistant_only_loss` (conversational data), only
    tokens inside the template's `{% generation %}` markers (intersected with the above).

    Args:
        max_length: keep the first (`"keep_start"`) or last (`"keep_end"`) tokens.

    Returns:
        `{"input_ids", "completion_mask": list[int], "truncated": bool}`.
    """
    _check_mode(truncation_mode)
    fmt = _row_format(row, fmt, "sft")
    check_row(row, index, fmt)
    prompt_mask = int(not completion_only(completion_only_loss, fmt))
    if assistant_only_loss and not fmt.conversational:
        raise DataError(f"assistant_only_loss needs conversational data, but the dataset is {fmt.name}")
    if fmt.kind == "language_modeling":
        if fmt.conversational:
            ids, mask = _chat(tokenizer, row["messages"], assistant_mask=assistant_only_loss)
            mask = mask if mask is not None else [1] * len(ids)
        else:
            ids = _ids(tokenizer, row["text"], special=True)
            if not ids or ids[-1] != tokenizer.eos_token_id:
                ids = _with_eos(tokenizer, ids)
            mask = [1] * len(ids)
    elif fmt.conversational:
        prompt_ids, completion_ids, assistant = _split_chat(
            tokenizer, row["prompt"], row["completion"], index, "completion", assistant_only_loss)
        ids = prompt_ids + completion_ids
        mask = [prompt_mask] * len(prompt_ids) + [1] * len(completion_ids)
        if assistant is not None:
            mask = [m & a for m, a in zip(mask, assistant)]
    else:
        prompt_ids, (completion_ids,) = _prompt_and_completions(row, tokenizer, fmt, ("completion",), index)
        ids = prompt_ids + completion_ids
        mask = [prompt_mask] * len(prompt_ids) + [1] * len(completion_ids)
    if assistant_only_loss and not any(mask):
        raise DataError(
            f"{row_name(index)}, column {fmt.columns[-1]!r}: no assistant tokens to learn from with "
            "assistant_only_loss; expected at least one assistant message", row=index,
        )
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        keep = slice(0, max_length) if truncation_mode == "keep_start" else slice(len(ids) - max_length, None)
        ids, mask = ids[keep], mask[keep]
    return {"input_ids": ids, "completion_mask": mask, "truncated": truncated}


def tokenize_prompt_row(row: Mapping, tokenizer: Any, *, max_prompt_length: int | None = None,
                        index: int | None = None, fmt: DataFormat | None = None) -> dict:
    """Tokenises a prompt-only row (for generation); conversational prompts get the
    generation prompt appended. Keeps the last `max_prompt_length` tokens.

    Returns:
        `{"prompt_ids": list[int], "truncated": bool}`.
    """
    fmt = _row_format(row, fmt, ("prompt_only",))
    check_row(row, index, fmt)
    if fmt.conversational:
        ids, _ = _chat(tokenizer, row["prompt"], add_generation_prompt=True)
    else:
        ids = _ids(tokenizer, row["prompt"], special=True)
    truncated = max_prompt_length is not None and len(ids) > max_prompt_length
    return {"prompt_ids": ids[len(ids) - max_prompt_length:] if truncated else ids, "truncated": truncated}


# ------------------------------------------------------------------------------ datasets


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
