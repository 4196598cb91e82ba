"""GRPO generation: a small generator interface and its implementations.

    generator = HFGenerate.from_args(args, tokenizer)                  # transformers' generate
    generator = StaticDecode.from_args(args, tokenizer)                # static cache, CUDA graph a token
    generator = HFGenerate.from_args(args, tokenizer, KeyedSampler(seed))   # batch-invariant draws
    generator = Replay.load("completions.jsonl")                      # recorded completions
    generator = RowLimited(StaticDecode.from_args(args, tokenizer), 2)  # two rows decoded at a time
    with generation_weights(model_wrapped, accelerator) as model:     # fusedalign.distributed
        out = generator.generate(model, prompt_ids, row_keys, step=step)
    out.completion_ids, out.truncated, out.logprobs
"""

from .base import GenerationError, GenerationOutput, Generator, RowKey, cut_after_eos, left_pad
from .hf import HFGenerate
from .keyed import KeyedSampler, filter_logits, gumbel_noise
from .replay import Recorder, Replay
from .row_limit import RowLimited
from .static import StaticDecode

__all__ = [
    "GenerationError", "GenerationOutput", "Generator", "HFGenerate", "KeyedSampler", "Recorder", "Replay", "RowKey",
    "RowLimited", "StaticDecode", "cut_after_eos", "filter_logits", "gumbel_noise", "left_pad",
]
