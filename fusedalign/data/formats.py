"""Dataset formats: detection and validation, with errors that name row, column and expectation.

The formats and column names are TRL's:

======================  ===============================  ==========================
kind                    columns                          trainers
======================  ===============================  ==========================
language_modeling       text (standard) / messages       SFT
prompt_only             prompt                           GRPO
prompt_completion       prompt, completion               SFT
preference              prompt, chosen, rejected         DPO
implicit_preference     chosen, rejected                 DPO
unpaired_preference     prompt, completion, label        KTO
======================  ===============================  ==========================

Each is *standard* (strings) or *conversational* (lists of `{"role", "content"}`
messages, rendered with the tokenizer's chat template). Columns outside the table are
ignored; a table column that does not belong to the detected format is an error, since it
means the data was meant for something else.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

KIND_COLUMNS: dict[str, tuple[str, ...]] = {
    "language_modeling": ("text",),
    "prompt_only": ("prompt",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "implicit_preference": ("chosen", "rejected"),
    "unpaired_preference": ("prompt", "completion", "label"),
}
FORMAT_COLUMNS = frozenset({"text", "messages", "prompt", "completion", "chosen", "rejected", "label"})
PROMPT_KINDS = frozenset({"prompt_only", "prompt_completion"})  # what the generating trainers read

# Which kinds each trainer reads.
TRAINER_KINDS: dict[str, tuple[str, ...]] = {
    "sft": ("language_modeling", "prompt_completion"),
    "dpo": ("preference", "implicit_preference"),
    "kto": ("unpaired_preference",),
    "grpo": ("prompt_only", "prompt_completion"),
    "rloo": ("prompt_only", "prompt_completion"),
    "distillation": ("prompt_only", "prompt_completion"),
}

_GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


class DataError(ValueError):
    """Bad training data: the message names the row (counted from 0), the column and what was expected.

    Attributes:
        row: the dataset index of the bad row, when one row is to blame (the CLI turns it
            into a file line for local JSON Lines files).
    """

    def __init__(self, message: str, *, row: int | None = None):
        super().__init__(message)
        self.row = row


def row_name(index: int | None) -> str:
    """How messages name a row: its dataset index, saying the base."""
    return "a row" if index is None else f"row {index} (from 0)"


# Roles a chat template is expected to know; a completion is the assistant's (tool turns
# may follow it). Anything else is most likely a typo, which templates render silently.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})
COMPLETION_ROLES = frozenset({"assistant", "tool"})


class DataFormat(NamedTuple):
    """A dataset's format.

    Attributes:
        kind: one of the keys of `KIND_COLUMNS`.
        conversational: rows hold message lists rather than strings.
    """

    kind: str
    conversational: bool

    @property
    def columns(self) -> tuple[str, ...]:
        """The format's columns, in order."""
        if self.kind == "language_modeling" and self.conversational:
            return ("messages",)
        return KIND_COLUMNS[self.kind]

    @property
    def text_columns(self) -> tuple[str, ...]:
        """The columns holding strings or message lists (all but `label`)."""
        return tuple(c for c in self.columns if c != "label")

    @property
    def name(self) -> str:
        """TRL's config name, e.g. `conversational_implicit_prompt_preference`."""
        kind = "implicit_prompt_preference" if self.kind == "implicit_preference" else self.kind
        return ("conversational_" if self.conversational else "standard_") + kind


def _describe(kind: str) -> str:
    cols = ", ".join(KIND_COLUMNS[kind]) + (" (or messages)" if kind == "language_modeling" else "")
    return f"{kind} ({cols})"


def is_conversational_value(value: Any) -> bool:
    """Whether a cell holds a message list (rather than a string)."""
    return isinstance(value, list) and (len(value) == 0 or isinstance(value[0], Mapping))


def _columns_and_row(data: Any) -> tuple[list[str], Mapping | None]:
    if isinstance(data, Mapping):
        return list(data.keys()), data
    column_names = getattr(data, "column_names", None)
    if column_names is not None:  # a datasets.Dataset / IterableDataset
        try:
            row = next(iter(data))
        except StopIteration:
            raise DataError("the dataset is empty: expected at least one row") from None
        return list(column_names), row
    return list(data), None


def detect_format(data: Any, expected: Iterable[str] | str | None = None) -> DataFormat:
    """Detects a dataset's format from its columns and first row.

    Args:
        data: a `datasets.Dataset` (columns and first row are read), a row (a mapping), or
            an iterable of column names (then only `messages` marks conversational data).
        expected: the kinds the caller accepts (a kind or an iterable of kinds), or a
            trainer name (`"sft"`, `"dpo"`, `"kto"`, `"grpo"`, `"rloo"`, `"distillation"`); None accepts any kind.

    Returns:
        The format.

    Raises:
        DataError: no format matches, columns are missing or unexpected for the accepted
            kinds, or the dataset is empty. The message lists the columns found and expected.
    """
    trainer = expected if isinstance(expected, str) and expected in TRAINER_KINDS else None
    if trainer:
        kinds = TRAINER_KINDS[trainer]
    else:
        kinds = (expected,) if isinstance(expected, str) else tuple(expected or KIND_COLUMNS)
    unknown = [k for k in kinds if k not in KIND_COLUMNS]
    if unknown:
        raise ValueError(f"unknown format kind(s) {unknown}; expected trainer names {list(TRAINER_KINDS)} "
                         f"or kinds {list(KIND_COLUMNS)}")
    columns, row = _columns_and_row(data)
    present = set(columns) & FORMAT_COLUMNS
    if "text" in present and "messages" in present:
        raise DataError("columns 'text' and 'messages' both present: expected one of them (all rows)")
    lm = "messages" if "messages" in present else "text"
    required = {k: set(KIND_COLUMNS[k]) if k != "language_modeling" else {lm} for k in kinds}

    who = f"{trainer.upper() if len(trainer) <= 4 else trainer} expects" if trainer else "expected"
    wanted = " or ".join(_describe(k) for k in kinds)
    found = f"dataset columns: {sorted(columns)}"
    kind = next((k for k in kinds if required[k] == present), None)
    if kind is None:
        fits = [k for k in kinds if required[k] <= present]
        if fits:
            k = max(fits, key=lambda k: len(required[k]))
            extra = sorted(present - required[k])
            other = next((o for o in KIND_COLUMNS if o not in kinds and _fits(o, present)), None)
            if set(kinds) <= PROMPT_KINDS and other is None:
                # GRPO, RLOO, distillation read the prompt (TRL: every other column goes to the reward
                # functions, 'text' and 'label' too), unless the columns are another trainer's data.
                kind = k
            else:
                hint = f" (the columns fit format {other})" if other else ""
                raise DataError(
                    f"unexpected column(s) {extra} for format {_describe(k)} (all rows): {who} {wanted}; {found}{hint}"
                )
    if kind is None:
        # Name what is missing for the closest accepted kind.
        k = min(kinds, key=lambda k: (len(required[k] - present), len(present - required[k])))
        missing = sorted(required[k] - present)
        other = next((o for o in KIND_COLUMNS if o not in kinds and _fits(o, present)), None)
        hint = f" (the columns fit format {other})" if other else ""
        if other in ("preference", "implicit_preference") and kinds == ("unpaired_preference",):
            hint += "; paired data can be converted with unpair_preference_dataset"
        raise DataError(f"missing column(s) {missing} (all rows): {who} {wanted}; {found}{hint}")

    if kind == "language_modeling":
        conversational = lm == "messages"
    elif row is None:
        conversational = False
    else:
        first = KIND_COLUMNS[kind][0]
        conversational = is_conversational_value(row[first])
    return DataFormat(kind, conversational)


def _fits(kind: str, present: set[str]) -> bool:
    if kind == "language_modeling":
        return present in ({"text"}, {"messages"})
    return set(KIND_COLUMNS[kind]) == present


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_messages(value: Any, index: int | None, column: str, *, completion: bool = False) -> None:
    """Checks one cell of a conversational column.

    Args:
        value: the cell.
        index: the row's index (for the message).
        column: the column's name.
        completion: the cell is a completion (chosen, rejected, completion after a
            prompt column): it must start with an assistant message.

    Raises:
        DataError: the cell is not a non-empty list of `{"role": str, "content": str}`
            messages, a role is not one of `CHAT_ROLES` (or, in a completion, not the
            assistant's), or all its contents are empty.
    """
    where = f"{row_name(index)}, column {column!r}"
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: expected a non-empty list of {{'role', 'content'}} messages, got {_short(value)}", row=index
        )
    for j, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise DataError(
                f"{where}, message {j} (from 0): expected a mapping with string 'role' and 'content', "
                f"got {_short(message)}", row=index,
            )
        role = message["role"]
        allowed = COMPLETION_ROLES if completion else CHAT_ROLES
        if role not in allowed or (completion and j == 0 and role != "assistant"):
            expected = ("'assistant' (a completion is the assistant's answer; tool turns may follow)" if completion
                        else f"one of {sorted(CHAT_ROLES)}")
            raise DataError(f"{where}, message {j} (from 0): role {role!r}; expected {expected}", row=index)
    if not any(m["content"].strip() for m in value):
        raise DataError(f"{where}: empty {column}; expected at least one message with non-empty content", row=index)


def check_row(row: Mapping, index: int | None, fmt: DataFormat) -> None:
    """Checks one row against its dataset's format.

    Args:
        row: the row.
        index: its index in the dataset, from 0 (for the error message).
        fmt: the dataset's format, from `detect_format`.

    Raises:
        DataError: naming the row, the column and what was expected, for a missing value, an
            empty string, a string where messages were expected (or the reverse), malformed
            messages, or a non-boolean `label`.
    """
    for column in fmt.text_columns:
        if column not in row:
            raise DataError(f"{row_name(index)}: missing column {column!r} for format {fmt.name}", row=index)
        value = row[column]
        if fmt.conversational:
            completion = column in ("chosen", "rejected", "completion") and "prompt" in fmt.columns
            check_messages(value, index, column, completion=completion)
        elif not isinstance(value, str):
            raise DataError(
                f"{row_name(index)}, column {column!r}: expected a string (the dataset is {fmt.name}), "
                f"got {_short(value)}", row=index,
            )
        elif not value.strip():
            raise DataError(f"{row_name(index)}, column {column!r}: empty {column}; expected a non-empty string",
                            row=index)
    if fmt.kind == "unpaired_preference":
        label = row.get("label")
        if not isinstance(label, bool):
            raise DataError(
                f"{row_name(index)}, column 'label': expected a boolean (true = desirable, false = "
                f"undesirable), got {_short(label)} ({type(label).__name__})", row=index,
            )


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks assistant turns with `{% generation %}`."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return isinstance(template, str) and bool(_GENERATION_MARKER.search(template))


def check_tokenizer(tokenizer: Any, fmt: DataFormat, *, assistant_only_loss: bool = False) -> None:
    """Checks that the tokenizer can render the dataset.

    Raises:
        DataError: conversational data with a tokenizer that has no chat template, or
            `assistant_only_loss` without `{% generation %}` markers in the template.
    """
    if fmt.conversational and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"the dataset is conversational (column {fmt.columns[0]!r} holds message lists, format "
            f"{fmt.name}) but the tokenizer has no chat template: set tokenizer.chat_template, use a "
            "tokenizer that has one (e.g. builtin:tokenizer), or use standard (string) data"
        )
    if assistant_only_loss:
        if not fmt.conversational:
            raise DataError(
                f"assistant_only_loss needs conversational data, but the dataset is {fmt.name}"
            )
        if not has_generation_markers(tokenizer):
            raise DataError(
                "assistant_only_loss needs a chat template that wraps assistant turns in "
                "{% generation %}...{% endgeneration %}; the tokenizer's template has no such markers"
            )


def validate_dataset(
    dataset: Any,
    expected: Iterable[str] | str | None = None,
    tokenizer: Any = None,
    *,
    assistant_only_loss: bool = False,
    check_rows: bool = True,
) -> DataFormat:
    """Validates a whole dataset before training: columns, tokenizer, then every row.

    Args:
        dataset: a `datasets.Dataset` (or a list of rows).
        expected: accepted kinds or a trainer name, as for `detect_format`.
        tokenizer: if given, checked with `check_tokenizer`.
        assistant_only_loss: also require generation markers in the chat template.
        check_rows: run `check_row` over every row (the `prepare_*` functions do it
            while tokenising instead).

    Returns:
        The dataset's format.

    Raises:
        DataError: see `detect_format`, `check_tokenizer`, `check_row`.
    """
    if isinstance(dataset, list):
        if not dataset:
            raise DataError("the dataset is empty: expected at least one row")
        fmt = detect_format(dataset[0], expected)
    else:
        fmt = detect_format(dataset, expected)
    if tokenizer is not None:
        check_tokenizer(tokenizer, fmt, assistant_only_loss=assistant_only_loss)
    if check_rows:
        for index, row in enumerate(dataset):
            check_row(row, index, fmt)
    return fmt
