"""The generator interface: prompt token ids of one generation batch -> completions.

A generator gets the rows of a generation batch as prompt token ids with a stable key per
row, `(dataset row index, generation index)`, and returns each completion's token ids (up to
and including the first EOS, no padding), whether it was truncated (no EOS within the
budget), and, when the generator has them, the sampler's log-probs of the chosen tokens
(for importance-sampling corrections). It never sees ranks or backends: the trainer calls it
inside `fusedalign.distributed.generation_weights`, on the model that context yields (a
server-backed generator would ignore the model and sync weights its own way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

RowKey = tuple[int, int]  # (dataset row index, generation index)


class GenerationError(ValueError):
    """A generator cannot produce what was asked (e.g. a replay without that row)."""


@dataclass(frozen=True)
class GenerationOutput:
    """Completions of one generation batch, in the order of the request's rows.

    Attributes:
        completion_ids: per row, the completion's token ids, up to and including the first EOS.
        truncated: per row, True where no EOS came within max_new_tokens.
        logprobs: per row, the sampler's log-prob of each completion token (after its
            temperature and filtering), or None when the generator does not give them.
    """

    completion_ids: list[list[int]]
    truncated: list[bool]
    logprobs: list[list[float]] | None = None

    def __post_init__(self):
        if len(self.completion_ids) != len(self.truncated):
            raise ValueError("completion_ids and truncated must have one entry per row")


class Generator(Protocol):
    """What the GRPO trainer needs from a generator."""

    def generate(self, model: Any, prompt_ids: Sequence[Sequence[int]], row_keys: Sequence[RowKey], *,
                 step: int = 0) -> GenerationOutput:
        """Completions of `prompt_ids` (one per row key); `step` is the trainer's generation step."""
        ...


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """(input_ids [B, P], attention_mask [B, P]), prompts left-padded to the longest, as generate wants."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise GenerationError("every prompt needs at least one token")
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), P), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), P), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, P - len(p):] = 1
    return ids, mask


def cut_after_eos(tokens: Tensor, eos_token_ids: Sequence[int]) -> tuple[list[list[int]], list[bool]]:
    """Each row of generated `tokens` [B, L] up to and including its first EOS, and whether it had none."""
    is_eos = torch.isin(tokens, torch.tensor(list(eos_token_ids), device=tokens.device))
    has_eos = is_eos.any(dim=1)
    end = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, torch.full_like(has_eos, tokens.shape[1], dtype=torch.long))
    rows = tokens.cpu().tolist()
    return [r[:n] for r, n in zip(rows, end.tolist())], (~has_eos).tolist()
