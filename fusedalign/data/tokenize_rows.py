"""One row to token ids, for each trainer.

Row functions (`tokenize_dpo_row`, `tokenize_kto_row`, `tokenize_sft_row`,
`tokenize_prompt_row`) take one row and return plain lists of token ids, so they work with
`Dataset.map`; each checks its row first (`fusedalign.data.formats.check_row`) and reports
whether a length limit cut it. How text and conversations become ids, and how a prompt and
its completions are cut, is `fusedalign.data.token_ids`; `completion_only` is SFT's rule for
which tokens the loss is taken on.
"""

from __future__ import annotations

from typing import Any, Mapping

from .formats import DataError, DataFormat, check_row, detect_format, row_name
from .token_ids import _chat, _check_mode, _ids, _split_chat, _with_eos, extract_prompt, truncate_pair


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
