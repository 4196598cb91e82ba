"""Deterministic GRPO completions for tests: uneven lengths, some truncated, and a reward that
varies within every group, so that every loss type's normalisation and every metric is exercised."""

from __future__ import annotations

from collections.abc import Collection

import torch

from fusedalign.generation import Replay


def uneven_replay(num_rows: int, num_generations: int, eos_token_id: int, *, vocab: int = 512, seed: int = 0,
                  truncate_every: int = 4, max_length: int = 11, truncate_rows: Collection[int] = ()) -> Replay:
    """Completion (row, g): 1..max_length tokens; no EOS (truncated) for every `truncate_every`-th
    (0: none) and for every completion of the dataset rows in `truncate_rows`."""
    gen = torch.Generator().manual_seed(seed)
    records = {}
    for row in range(num_rows):
        for g in range(num_generations):
            n = 1 + (row * 7 + g * 3) % max_length
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            truncated = row in truncate_rows or (truncate_every > 0 and (row + g) % truncate_every == 0)
            records[(row, g)] = (ids if truncated else ids + [eos_token_id], truncated, None)
    return Replay(records)


def token_sum_reward(completion_ids, **kwargs) -> list[float]:
    """A reward of the token ids alone, different within each group."""
    return [(sum(c) % 7) / 7.0 for c in completion_ids]
