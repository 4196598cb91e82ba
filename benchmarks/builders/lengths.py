"""Preference pairs at real lengths: prompt, chosen and rejected lengths drawn (seeded)
from log-normal fits to public datasets, truncated as the trainers truncate.

Each length is fitted by its median m and 95th percentile q (tokens, Qwen2.5 tokenizer,
chat template on the prompt; shared/research/dpo_lengths.md §3.1): ln L ~ Normal(mu, s)
with mu = ln m and s = ln(q / m) / z95. The three lengths of a pair are drawn
independently (the fits say nothing of their correlation).

Truncation follows TRL 1.16's DPO with truncation_mode="keep_start": a pair whose prompt
alone fills max_length is dropped (TRL filters it out before training), and each
completion keeps at most max_length - prompt tokens. The rows given to the trainers are
already truncated, so no trainer truncates anything and all see the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.6448536269514722  # the standard normal's 95th percentile


@dataclass(frozen=True)
class LengthFit:
    """A log-normal length: its median and 95th percentile in tokens."""

    median: float
    p95: float

    @property
    def mu(self) -> float:
        return math.log(self.median)

    @property
    def sigma(self) -> float:
        return math.log(self.p95 / self.median) / Z95


@dataclass(frozen=True)
class PairLengths:
    """A dataset's prompt, chosen and rejected length fits."""

    name: str
    prompt: LengthFit
    chosen: LengthFit
    rejected: LengthFit


DATASETS = {
    "ultrafeedback": PairLengths("UltraFeedback", LengthFit(107, 631), LengthFit(200, 727), LengthFit(183, 642)),
    "hh-rlhf": PairLengths("HH-RLHF", LengthFit(118, 364), LengthFit(27, 114), LengthFit(35, 139)),
}


BLOCK = 1024  # pairs drawn at a time: the first n pairs are the same whatever n


def sample_pairs(lengths: PairLengths, n: int, *, seed: int, max_length: int | None) -> dict[str, list[int]]:
    """n pairs' (prompt, chosen, rejected) lengths, truncated at max_length as TRL does.

    Pairs are drawn in blocks and kept in order, so a larger n only adds pairs after the
    first n of a smaller one (a run that needs more pairs trains the same first ones).

    Returns:
        {"prompt": [n], "chosen": [n], "rejected": [n], "dropped": pairs drawn and dropped
        because the prompt filled max_length, "truncated": kept pairs whose chosen or
        rejected was cut}.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    fits = (lengths.prompt, lengths.chosen, lengths.rejected)
    kept: dict[str, list[int]] = {"prompt": [], "chosen": [], "rejected": []}
    dropped = truncated = 0
    while len(kept["prompt"]) < n:
        z = rng.standard_normal(size=(BLOCK, 3))
        p, c, r = (np.maximum(1, np.rint(np.exp(f.mu + f.sigma * z[:, k]))).astype(np.int64)
                   for k, f in enumerate(fits))
        if max_length is not None:
            keep = p < max_length
            p, c, r = p[keep], c[keep], r[keep]
            room = max_length - p
            cut = (c > room) | (r > room)
            c, r = np.minimum(c, room), np.minimum(r, room)
        else:
            keep, cut = np.ones(BLOCK, dtype=bool), np.zeros(BLOCK, dtype=bool)
        take = min(len(p), n - len(kept["prompt"]))
        dropped += int((~keep[:np.flatnonzero(keep)[take - 1] + 1]).sum()) if take else int((~keep).sum())
        truncated += int(cut[:take].sum())
        kept["prompt"] += p[:take].tolist()
        kept["chosen"] += c[:take].tolist()
        kept["rejected"] += r[:take].tolist()
    return {**kept, "dropped": dropped, "truncated": truncated}


def token_rows(pairs: dict[str, list[int]], vocab: int, seed: int) -> dict[str, list[list[int]]]:
    """Token ids of those lengths, each pair from its own seeded stream (pair i's ids do not
    depend on how many pairs there are): prompt ids from the whole vocabulary, chosen from
    its lower half, rejected from its upper half (a preference to learn); id 0 (pad/eos) never."""
    import numpy as np

    half = vocab // 2
    rows: dict[str, list[list[int]]] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for i, (p, c, r) in enumerate(zip(pairs["prompt"], pairs["chosen"], pairs["rejected"])):
        rng = np.random.default_rng([seed, 1, i])
        rows["prompt_ids"].append(rng.integers(1, vocab, size=p).tolist())
        rows["chosen_ids"].append(rng.integers(1, half, size=c).tolist())
        rows["rejected_ids"].append(rng.integers(half, vocab, size=r).tolist())
    return rows


def padded_tokens(pairs: dict[str, list[int]], order: list[int], micro_batch: int) -> int:
    """Tokens a padded trainer runs through the backbone for these pairs in this order:
    each micro-batch's 2 x micro_batch rows padded to its longest (prompt + completion)."""
    total = 0
    for start in range(0, len(order), micro_batch):
        batch = order[start:start + micro_batch]
        longest = max(pairs["prompt"][i] + max(pairs["chosen"][i], pairs["rejected"][i]) for i in batch)
        total += 2 * len(batch) * longest
    return total


def unique_tokens(pairs: dict[str, list[int]], index: list[int]) -> int:
    """Each pair counted once: prompt + chosen + rejected."""
    return sum(pairs["prompt"][i] + pairs["chosen"][i] + pairs["rejected"][i] for i in index)
