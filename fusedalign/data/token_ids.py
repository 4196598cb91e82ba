"""From text and conversations to token ids, and the cuts made to them.

The rules every trainer's rows share. Standard rows: the prompt is tokenised with the
tokenizer's special tokens (a BOS where the tokenizer adds one), each completion without,
followed by EOS (`_ids`, `_with_eos`). Conversational rows: the prompt is rendered with the
chat template and `add_generation_prompt=True`; a completion is the rendered conversation
(prompt + completion messages) minus that prefix, which must be a token-level prefix
(`_split_chat`: checked; an error otherwise).

Also here, because they act on a prompt and its completions before or after those rules:
`extract_prompt`, which splits an implicit-prompt preference row into its common prompt and
the two completions, and `truncate_pair`, which cuts a prompt and the completions sharing it
to the length limits by TRL's `truncation_mode`.
"""

from __future__ import annotations

from typing import Any, Mapping

from .formats import DataError, row_name

TRUNCATION_MODES = ("keep_end", "keep_start")


def _ids(tokenizer: Any, text: str, special: bool) -> list[int]:
    # verbose=False: the tokenizer would warn about rows longer than the model's limit, rows that
    # `truncate_pair` below then cuts; `tokenize._prepare` warns itself about the rows it does not cut.
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
