"""The reward-function API, TRL's: `f(prompts, completions, completion_ids, **columns) -> list[float | None]`.

Each function scores the completions of one generation batch on one rank: `prompts[i]`
(a string, or a list of messages for conversational data), `completions[i]` (a string, or
`[{"role": "assistant", "content": ...}]`), `completion_ids[i]` (token ids), and every other
dataset column by name, one value per completion. `trainer_state` (the Trainer's state) is
passed to functions that name it or take `**kwargs`. None means "does not apply" (NaN in
the advantages, which ignore it).

`RewardFunctions` holds the functions, their names and weights, checks each signature once
(before training), and turns each call into a [N, K] tensor, with one-line errors that
name the function, the row and what was expected.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

# Keywords of the call; a dataset column with one of these names cannot be passed.
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# Not passed as columns: TRL skips prompt, completion and completion_ids; the others are ours.
SKIPPED_COLUMNS = ("prompt", "completion", "completion_ids", "prompt_ids", "row_index")


class RewardError(ValueError):
    """A reward function, its output, or the columns it is given are not what the API expects."""


def reward_name(func: Callable) -> str:
    """The name a reward is logged under (`rewards/<name>/mean`)."""
    name = getattr(func, "reward_name", None)
    while name is None and isinstance(func, functools.partial):
        func = func.func
    return name or getattr(func, "__name__", None) or type(func).__name__


def _accepts(func: Callable) -> tuple[set[str], bool, list[str]]:
    """(keyword names, has **kwargs, required keyword names) of `func`'s signature."""
    target = func.forward if isinstance(func, torch.nn.Module) else func
    params = inspect.signature(target).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
    if positional_only:
        raise RewardError(f"reward function {reward_name(func)!r}: parameters {positional_only} are positional-only; "
                          "the call passes every argument by keyword")
    return names, var_kw, required


def format_completions(texts: Sequence[str], conversational: bool) -> list:
    """Completions as reward functions see them: strings, or one assistant message each."""
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else list(texts)


def reward_columns(rows: Sequence[dict]) -> dict[str, list]:
    """The columns passed to reward functions: every key of the rows but the prompt and completion ones."""
    if not rows:
        return {}
    keys = [k for k in rows[0] if k not in SKIPPED_COLUMNS]
    check_columns(keys)
    return {k: [row[k] for row in rows] for k in keys}


def check_columns(columns: Sequence[str]) -> None:
    """Refuses dataset columns that clash with the call's keywords (TRL #4825)."""
    clash = sorted(set(columns) & set(RESERVED))
    if clash:
        raise RewardError(
            f"dataset column {clash[0]!r} clashes with an argument of the reward functions ({', '.join(RESERVED)}); "
            "rename the column"
        )


class RewardFunctions:
    """Several reward functions with weights, called on one generation batch.

    Args:
        funcs: callables (or `nn.Module`s with such a forward, e.g. `SequenceClassifierReward`).
        weights: one per function (TRL's `reward_weights`); None: all 1.0.
    """

    def __init__(self, funcs: Sequence[Callable], weights: Sequence[float] | None = None):
        if not funcs:
            raise RewardError("no reward function: pass at least one (e.g. --reward_funcs zen_words)")
        self.funcs = list(funcs)
        if weights is not None and len(weights) != len(self.funcs):
            raise RewardError(f"reward_weights has {len(weights)} values for {len(self.funcs)} reward functions "
                              f"({', '.join(map(reward_name, self.funcs))}); give one weight per function")
        self.weights = torch.tensor([1.0] * len(self.funcs) if weights is None else list(weights), dtype=torch.float32)
        names: list[str] = []
        for f in self.funcs:
            base, n = reward_name(f), 2
            name = base
            while name in names:  # two functions of one name would share their metrics
                name, n = f"{base}_{n}", n + 1
            names.append(name)
        self.names = names
        self._signatures = [_accepts(f) for f in self.funcs]

    def check_call(self, columns: Sequence[str]) -> None:
        """Checks, before training, that every function can take the call with these dataset columns."""
        check_columns(columns)
        offered = {"prompts", "completions", "completion_ids", *columns}
        for name, (accepted, var_kw, required) in zip(self.names, self._signatures):
            missing = [r for r in required if r not in offered and r != "trainer_state"]
            if missing:
                raise RewardError(f"reward function {name!r} requires {missing[0]!r}, which is neither an argument of "
                                  f"the call nor a dataset column (columns: {sorted(columns) or 'none'})")
            if not var_kw:
                extra = sorted(offered - accepted)
                if extra:
                    raise RewardError(
                        f"reward function {name!r} cannot take the call f(prompts, completions, completion_ids, "
                        f"**columns): it has no parameter {extra[0]!r} and no **kwargs; add **kwargs to its signature"
                    )

    def __call__(self, prompts: Sequence, completions: Sequence, completion_ids: Sequence[Sequence[int]],
                 columns: dict[str, Sequence] | None = None, *, trainer_state: Any = None,
                 row_ids: Sequence[Any] | None = None) -> Tensor:
        """[N, K] float32 rewards of N completions by the K functions, NaN for None.

        Args:
            row_ids: how each completion is named in errors (e.g. "dataset row 17, generation 3");
                default its index in the batch.
        """
        columns = dict(columns or {})
        self.check_call(list(columns))
        n = len(completions)
        for key, values in columns.items():
            if len(values) != n:
                raise RewardError(f"column {key!r} has {len(values)} values for {n} completions")
        row_ids = list(row_ids) if row_ids is not None else [f"row {i}" for i in range(n)]
        out = torch.empty(n, len(self.funcs), dtype=torch.float32)
        for k, (func, name) in enumerate(zip(self.funcs, self.names)):
            accepted, var_kw, _ = self._signatures[k]
            kwargs = {"prompts": list(prompts), "completions": list(completions),
                      "completion_ids": [list(c) for c in completion_ids], **columns}
            if var_kw or "trainer_state" in accepted:
                kwargs["trainer_state"] = trainer_state
            values = self._call_one(func, name, kwargs, row_ids)
            out[:, k] = torch.tensor(values, dtype=torch.float32)
        return out

    def _call_one(self, func: Callable, name: str, kwargs: dict, row_ids: list) -> list[float]:
        n = len(row_ids)
        try:
            values = func(**kwargs)
        except Exception as error:  # noqa: BLE001 - named and re-raised with the row
            raise RewardError(f"reward function {name!r} raised {type(error).__name__}: {error} "
                              f"({_failing_row(func, kwargs, row_ids)})") from error
        if isinstance(values, Tensor):
            values = values.detach().flatten().tolist()
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"reward function {name!r} returned {type(values).__name__}; expected a list of "
                              f"{n} floats or None, one per completion") from None
        if len(values) != n:
            raise RewardError(f"reward function {name!r} returned {len(values)} values for {n} completions; "
                              "expected one float or None per completion")
        return [_number(v, name, row_ids[i]) for i, v in enumerate(values)]


def unscored_warning(rewards: Tensor, names: Sequence[str], where: str, example: Any = None) -> str | None:
    """A one-line warning when every reward function returned None (or NaN) for some completions, else None.

    Such a completion gets advantage 0, so it teaches nothing (TRL warns too). When that holds for
    the whole generation batch, nothing is learned from it at all: said so plainly, but not refused,
    since a reward may be undefined for a whole batch on purpose (a verifier for one kind of prompt).

    Args:
        rewards: [N, K] the generation batch's rewards (NaN where a function returned None).
        names: the K functions' names.
        where: what the batch is, e.g. "step 3".
        example: how to name one such completion (e.g. "dataset row 7 (from 0), generation 2"), if known.
    """
    unscored = int(torch.isnan(rewards).all(dim=1).sum())
    if not unscored:
        return None
    funcs = f"every reward function ({', '.join(names)})" if len(names) > 1 else f"the reward function {names[0]!r}"
    n = rewards.shape[0]
    if unscored == n:
        return (f"{where}: no completion of the generation batch has a reward: {funcs} returned None or NaN for all "
                f"{n}, so every advantage is 0 and nothing is learned from this batch; check the reward functions "
                "if this repeats.")
    e_g = f" (e.g. {example})" if example is not None else ""
    return (f"{where}: {funcs} returned None or NaN for {unscored} of {n} completions{e_g}; they get advantage 0 and "
            "teach nothing.")


def _number(value: Any, name: str, row: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        return float(value)
    raise RewardError(f"reward function {name!r} returned {value!r} ({type(value).__name__}) for {row}; "
                      "expected a float, an int or None")


def _failing_row(func: Callable, kwargs: dict, row_ids: list) -> str:
    """Calls `func` on one completion at a time to find the first that raises (error path only)."""
    for i, row in enumerate(row_ids):
        one = {k: ([v[i]] if isinstance(v, list) and len(v) == len(row_ids) else v) for k, v in kwargs.items()}
        try:
            func(**one)
        except Exception:  # noqa: BLE001
            return f"on {row}"
    return f"on the batch of {len(row_ids)} completions; no single completion raises alone"
