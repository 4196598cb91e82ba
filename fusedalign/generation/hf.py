"""HFGenerate: transformers' `generate`, the default generator (TRL's path without vLLM).

Prompts are left-padded; sampling uses TRL 1.16's flags and defaults (temperature 1.0,
top_p 1.0, top_k 0 = off, min_p None, repetition_penalty 1.0, max_new_tokens =
max_completion_length); each completion is cut after its first EOS. Like TRL, generate's
auto-compile is disabled by default; `compile_decoding=True` turns on a static cache with
compiled decoding (on a GPU: ~3x the tokens/s of the dynamic cache at 0.5B, 64-256 rows).
Compiled decoding captures parameter storage, so it is only valid while the weights it saw
stay where they are (not under ZeRO-3 or FSDP2, which re-materialise them every step).

With a `KeyedSampler` the sampler draws each token (greedy decoding over its scores), so a
row's completion does not depend on the batch, the rank or the padding.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .base import GenerationOutput, RowKey, cut_after_eos, left_pad
from .keyed import KeyedSampler


class HFGenerate:
    """Generation with `model.generate`.

    Args:
        max_new_tokens: max_completion_length.
        eos_token_id: one id or several (any ends a completion).
        pad_token_id: the left-padding id.
        do_sample: False for greedy decoding (evaluation, tests).
        sampler: a KeyedSampler, which then draws every token (do_sample is ignored).
        cache_implementation: passed to GenerationConfig ("static", ...), as TRL's flag.
        compile_decoding: a static cache with generate's compiled decoding (GPU).
        generation_kwargs: more GenerationConfig fields; they win over the above.
    """

    def __init__(self, *, max_new_tokens: int, eos_token_id: int | Sequence[int], pad_token_id: int,
                 bos_token_id: int | None = None, do_sample: bool = True, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float | None = None, repetition_penalty: float = 1.0,
                 sampler: KeyedSampler | None = None, cache_implementation: str | None = None,
                 compile_decoding: bool = False, generation_kwargs: dict | None = None):
        self.eos_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad_token_id = pad_token_id
        self.sampler = sampler
        sample = do_sample and sampler is None
        fields: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
            eos_token_id=self.eos_token_ids, repetition_penalty=repetition_penalty,
            cache_implementation="static" if compile_decoding else cache_implementation,
            disable_compile=not compile_decoding,
        )
        if sample:
            fields.update(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        else:  # greedy: leave the sampling flags unset (transformers warns about them otherwise)
            fields.update(temperature=None, top_p=None, top_k=None)
        fields.update(generation_kwargs or {})
        self.config_fields = fields

    @classmethod
    def from_args(cls, args: Any, tokenizer: Any, sampler: KeyedSampler | None = None) -> "HFGenerate":
        """From a GRPOConfig's sampling flags and the policy's tokenizer."""
        return cls(
            max_new_tokens=args.max_completion_length, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            sampler=sampler, cache_implementation=getattr(args, "cache_implementation", None),
            compile_decoding=getattr(args, "compile_generation", False),
            generation_kwargs=getattr(args, "generation_kwargs", None),
        )

    def generation_config(self):
        from transformers import GenerationConfig

        return GenerationConfig(**self.config_fields)

    def generate(self, model: Any, prompt_ids: Sequence[Sequence[int]], row_keys: Sequence[RowKey], *,
                 step: int = 0) -> GenerationOutput:
        """Completions of the prompts; `model` is the whole-weights model `generation_weights` yields."""
        from transformers import LogitsProcessorList

        if len(row_keys) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(row_keys)} row keys")
        input_ids, attention_mask = left_pad(prompt_ids, self.pad_token_id)
        device = next(model.parameters()).device
        processors = LogitsProcessorList()
        if self.sampler is not None:
            self.sampler.bind(row_keys, input_ids.shape[1], step)
            processors.append(self.sampler)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 generation_config=self.generation_config(), logits_processor=processors)
        completions, truncated = cut_after_eos(out[:, input_ids.shape[1]:], self.eos_token_ids)
        logprobs = None
        if self.sampler is not None and self.sampler.logprobs:
            steps = torch.stack(self.sampler.logprobs, dim=1).cpu().tolist()  # [B, L]
            logprobs = [row[: len(c)] for row, c in zip(steps, completions)]
        return GenerationOutput(completions, truncated, logprobs)
