"""GRPO's completions as packed rows: which completions share a micro-batch, and the row they make.

A rank's generation window holds `per_device_train_batch_size x steps_per_generation`
completions. Padded, they are shuffled (seeded) and cut into `steps_per_generation`
micro-batches; the trainer runs `gradient_accumulation_steps` of them per optimizer step.
The number of micro-batches per optimizer step is the Trainer's (one per dataloader item,
the same on every rank), so packing never changes it: it changes only what each holds.

What an optimizer step means is the set of completions it trains on. Every optimizer step
boundary inside a window falls on a multiple of `gcd(steps_per_generation,
gradient_accumulation_steps)` micro-batches (a window starts at a multiple of
`steps_per_generation`), so completions may move freely between the micro-batches of one
such *chunk* and no step changes: `plan_micro_batches` regroups each chunk's completions by
prompt (so that with `share_prompt` a group's completions share one copy of the prompt) and
packs the groups into rows, best-fit decreasing under `max_tokens_per_batch`. While the
chunk's micro-batches are at least as many as its rows, each micro-batch is one row (the
fullest rows split until there are as many). When the rows are more, each micro-batch holds
k of them (k the fewest that hold the chunk's rows on the rank that has the most, so that
every rank runs as many forwards, as DeepSpeed and FSDP2 need; the others split their rows
further) and is trained as k forwards, each with its own backward
(`trainers.step_batch.MicroBatchParts`): memory stays that of one row of the budget, however
long the completions. bnpo's token mean is defined per micro-batch: its micro-batches keep
their completions (regrouped within, and in parts when over the budget, each part divided by
the whole micro-batch's tokens); top_entropy_quantile's threshold is taken over a micro-batch
in one forward, so its padded micro-batches stay one row each (with a warning when one is over
the budget).

`pack_completions` lays one micro-batch out as a row (`data.packed_rows`): sequence i is
the micro-batch's i-th completion, whatever its place in the row.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch

from .formats import DataError, row_name
from .packed_rows import PackedRows, _Row, group_tokens
from .packing import _bins

OVER_BUDGET = ("max_tokens_per_batch: top_entropy_quantile < 1 takes its entropy threshold over each whole "
               "micro-batch, which is then kept in one row, and a micro-batch here has more tokens than the budget. "
               "Raise max_tokens_per_batch or lower per_device_train_batch_size.")


def check_budget(prompt_lengths: Sequence[int], max_completion_length: int, budget: int | None) -> None:
    """Refuses a budget that cannot hold the longest prompt of the split with a completion of
    max_completion_length (the rows are planned after generation, when nothing can be done).

    Raises:
        DataError: naming the row of the longest prompt, and the budget it needs.
    """
    if budget is None or not len(prompt_lengths):
        return
    row = max(range(len(prompt_lengths)), key=lambda i: (prompt_lengths[i], -i))
    need = int(prompt_lengths[row]) + max_completion_length
    if need > budget:
        raise DataError(
            f"{row_name(row)}: its prompt of {prompt_lengths[row]} tokens and a completion of up to "
            f"max_completion_length={max_completion_length} need {need} tokens in a packed row, over "
            f"max_tokens_per_batch={budget}; raise max_tokens_per_batch to at least {need}, or shorten the "
            "prompts (max_prompt_length)", row=row)


def _parts(members: Sequence[int], groups: Sequence[int]) -> list[list[int]]:
    """The completions of `members` by group, groups in order of first appearance."""
    by_group: dict[int, list[int]] = {}
    for i in members:
        by_group.setdefault(groups[i], []).append(i)
    return list(by_group.values())


def plan_micro_batches(order: Sequence[int], micro: int, chunk: int, groups: Sequence[int], prompt_lengths: Sequence[int],
                       completion_lengths: Sequence[int], *, share_prompt: bool, budget: int | None,
                       keep_membership: bool, one_row: bool = False,
                       rows_needed: Callable[[list[int]], list[int]] | None = None) -> list[list[list[int]]]:
    """The micro-batches of a window, each as its rows, each row a list of completion indices (module docstring).

    Args:
        order: the window's completions in the padded order (shuffled or not).
        micro: completions per padded micro-batch.
        chunk: micro-batches between which completions may move (gcd of steps_per_generation and
            gradient_accumulation_steps; 1: none).
        groups: the prompt group of each completion.
        prompt_lengths, completion_lengths: tokens of each completion's prompt and completion.
        share_prompt: a group's completions in one row share one copy of the prompt.
        budget: max_tokens_per_batch, or None.
        keep_membership: keep each padded micro-batch's completions together (a loss term defined per
            micro-batch: bnpo's token mean), regrouped by prompt and, over the budget, in parts.
        one_row: keep each padded micro-batch as it is, one row (top_entropy_quantile's threshold is taken
            over the whole micro-batch in one forward), with a warning when one is over the budget.
        rows_needed: with a budget, maps this rank's rows of the budget per chunk to the largest number
            any rank has (every rank must run as many forwards); default: this rank's (one process).
    """
    padded = [list(order[i:i + micro]) for i in range(0, len(order), micro)]

    def tokens(part: list[int]) -> int:
        return group_tokens(prompt_lengths[part[0]], [completion_lengths[i] for i in part], share_prompt)

    if one_row:
        if budget is not None and any(sum(tokens(p) for p in _parts(r, groups)) > budget for r in padded):
            warnings.warn(OVER_BUDGET, stacklevel=2)
        return [[r] for r in padded]
    if keep_membership:
        chunk = 1

    chunks = []
    for first in range(0, len(padded), chunk):
        count = len(padded[first:first + chunk])
        parts = _parts([i for r in padded[first:first + chunk] for i in r], groups)
        if budget is None:
            bins = [parts]
        else:
            parts = [piece for p in parts for piece in _within(p, budget, tokens)]
            bins = [[parts[j] for j in sorted(b)] for b in _bins([tokens(p) for p in parts], budget)]
        chunks.append((bins, count))
    needed = [len(bins) for bins, _ in chunks]
    if budget is not None and rows_needed is not None:
        needed = [int(n) for n in rows_needed(needed)]
    planned = []
    for (bins, count), need in zip(chunks, needed):
        per = -(-max(need, 1) // count)  # rows per micro-batch: 1 while the chunk's forwards hold the budget's rows
        planned += _deal(_split_to(bins, count * per, tokens), count, per, tokens)
    return [[[i for p in row for i in p] for row in batch] for batch in planned]


def _within(part: list[int], budget: int, tokens) -> list[list[int]]:
    """A group's completions in pieces of at most `budget` tokens (each with its own copy of the
    prompt), in order; the group whole when it fits. A completion over the budget alone stays alone
    (the trainer refuses such a budget when it is made)."""
    if tokens(part) <= budget:
        return [part]
    pieces: list[list[int]] = [[]]
    for i in part:
        if pieces[-1] and tokens(pieces[-1] + [i]) > budget:
            pieces.append([])
        pieces[-1].append(i)
    return pieces


def _split_to(bins: list[list[list[int]]], count: int, tokens) -> list[list[list[int]]]:
    """`count` rows: the fullest splittable row split in two while there are fewer (its groups halved,
    or a lone group's completions); each half holds at most the tokens of the row it came from."""
    size = lambda b: sum(tokens(p) for p in b)  # noqa: E731
    bins = list(bins)
    while len(bins) < count:
        splittable = [j for j, b in enumerate(bins) if sum(len(p) for p in b) > 1]
        j = max(splittable, key=lambda j: (size(bins[j]), -j))
        b = bins[j]
        if len(b) > 1:
            halves = [b[:len(b) // 2], b[len(b) // 2:]]
        else:
            half = len(b[0]) // 2
            halves = [[b[0][:half]], [b[0][half:]]]
        bins[j:j + 1] = halves
    return bins


def _deal(bins: list[list[list[int]]], count: int, per: int, tokens) -> list[list[list[list[int]]]]:
    """`count` micro-batches of `per` rows each from `count * per` rows: fullest row first, to the
    micro-batch with the fewest tokens that has room (their forwards take similar time)."""
    size = lambda b: sum(tokens(p) for p in b)  # noqa: E731
    batches: list[list[list[list[int]]]] = [[] for _ in range(count)]
    loads = [0] * count
    for b in sorted(bins, key=lambda b: -size(b)):
        j = min((j for j in range(count) if len(batches[j]) < per), key=lambda j: (loads[j], j))
        batches[j].append(b)
        loads[j] += size(b)
    return batches


def pack_completions(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], groups: Sequence[int],
                     scored: Sequence[bool], *, share_prompt: bool) -> tuple[PackedRows, torch.Tensor]:
    """One micro-batch's completions as one packed row.

    Args:
        prompts, completions, groups: per completion of the micro-batch (n of them).
        scored: per completion, whether its tokens enter the loss (False: a truncated completion
            with mask_truncated_completions; it is still in the row).
        share_prompt: the completions of one group share one copy of its prompt.

    Returns:
        the row (sequence i: completion i; groups: the micro-batch's distinct groups), and
        positions [n, C] long: where in the flattened row completion i's token t is scored
        (C its longest scored completion; -1 past a completion's end).
    """
    row, n = _Row(), len(completions)
    order = _parts(range(n), groups)
    for part in order:
        prompt = list(prompts[part[0]])
        parent = -1
        if share_prompt and len(prompt) > 1:
            parent = row.add(prompt[:-1], [0] * (len(prompt) - 1), 0, -1, -1)
        for i in part:
            comp, s = list(completions[i]), int(bool(scored[i]))
            if parent >= 0:
                row.add(prompt[-1:] + comp, [0] + [s] * len(comp), len(prompt) - 1, parent, i)
            else:
                row.add(prompt + comp, [0] * len(prompt) + [s] * len(comp), 0, -1, i)
    cols = {k: torch.tensor([v], dtype=torch.long) for k, v in row.cols.items()}
    seq = cols["sequence_ids"][0]
    scored_tokens = torch.bincount(seq[seq >= 0], minlength=n)
    group_of = {g: j for j, g in enumerate(dict.fromkeys(groups))}
    rows = PackedRows(
        cols["input_ids"], cols["position_ids"], cols["segment_ids"], cols["parent_ids"], cols["labels"],
        cols["sequence_ids"], scored_tokens, torch.tensor([group_of[g] for g in groups], dtype=torch.long),
        torch.tensor([len(p) + len(c) for p, c in zip(prompts, completions)], dtype=torch.long))
    width = max(int(scored_tokens.max()) if n else 0, 1)
    positions = torch.full((n, width), -1, dtype=torch.long)
    flat = torch.arange(seq.numel())
    for i in range(n):
        where = flat[seq == i]
        positions[i, :where.numel()] = where
    return rows, positions


def window_chunk(steps_per_generation: int, gradient_accumulation_steps: int) -> int:
    """Micro-batches of a window between which completions may move without changing any optimizer step."""
    return math.gcd(steps_per_generation, gradient_accumulation_steps)
