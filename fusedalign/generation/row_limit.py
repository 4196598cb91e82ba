"""At most `max_rows` completions decoded at once: a generation batch in consecutive parts.

Why. Decoding holds every live row's KV cache for the whole completion: at 12 KiB a token
(Qwen2.5-0.5B's shape, bf16) a group of 8 completions of L tokens holds 96 KiB per token of L,
about what training one checkpointed completion of the same length holds (each layer's input,
42 KiB a token, and one layer's recomputed activations). So at long completions the
rollout sets the peak however lean training is, and no training micro-batch can lower it.
Decoding the batch two rows at a time holds a quarter of that, at the price of more decoding
steps (a step at batch 2 costs about what one at batch 8 does: decoding reads the weights
once a step whatever the batch). vLLM bounds the same thing with `max_num_seqs`.

Exactness. Each part is an ordinary call of the wrapped generator, and its rows are the
rows they were, in order: greedy tokens and keyed draws depend on the row alone, so they are
the tokens of one call over the whole batch; unkeyed draws follow the same distribution.
"""

from __future__ import annotations

from typing import Any, Sequence

from .base import GenerationOutput, Generator, RowKey


class RowLimited:
    """A generator (`base.Generator`) that calls `generator` on at most `max_rows` rows at a time.

    Attributes of the wrapped generator (StaticDecode's `last_call`, say) read through; they
    describe its last call, the batch's last part. Setting one sets it on `generator`: a flag
    changed on the wrapper (`check_every`, say) reaches every part's call.
    """

    def __init__(self, generator: Generator, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.generator = generator
        self.max_rows = max_rows

    def __getattr__(self, name: str) -> Any:
        if name == "generator":  # not yet set (during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.generator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("generator", "max_rows", "generate"):  # the wrapper's own (a benchmark may time `generate`)
            object.__setattr__(self, name, value)
        else:
            setattr(self.generator, name, value)

    def generate(self, model: Any, prompt_ids: Sequence[Sequence[int]], row_keys: Sequence[RowKey], *,
                 step: int = 0) -> GenerationOutput:
        """Completions of the prompts, in their order, from calls of at most `max_rows` rows."""
        if len(row_keys) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(row_keys)} row keys")
        n = self.max_rows
        parts = [self.generator.generate(model, prompt_ids[i:i + n], row_keys[i:i + n], step=step)
                 for i in range(0, len(prompt_ids), n)]
        if len(parts) == 1:
            return parts[0]
        logprobs = None
        if all(p.logprobs is not None for p in parts):
            logprobs = [row for p in parts for row in p.logprobs]
        return GenerationOutput([c for p in parts for c in p.completion_ids],
                                [t for p in parts for t in p.truncated], logprobs)
