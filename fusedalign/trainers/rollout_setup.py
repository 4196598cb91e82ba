"""What a rollout is built from when a trainer is not given it: the generator and the reward callables.

Shared by GRPO, RLOO and distillation (which takes the generator alone).
"""

from __future__ import annotations

from typing import Any, Callable

from fusedalign.configs import GRPOConfig
from fusedalign.generation import HFGenerate, KeyedSampler, Replay, RowLimited, StaticDecode
from fusedalign.rewards import load_reward_function, load_reward_functions


def reward_callables(reward_funcs: Any, args: GRPOConfig) -> list[Callable]:
    """The reward functions given (callables or names), or by default those the args name."""
    if reward_funcs is None:
        return load_reward_functions(args.reward_funcs, args.reward_model_name_or_path)
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    return [load_reward_function(f) if isinstance(f, str) else f for f in funcs]


def default_generator(args: GRPOConfig, tokenizer: Any) -> Any:
    """The generator the args ask for: a replay of recorded completions, else StaticDecode or
    transformers' generate (`resolved_generation_backend`), keyed when `keyed_sampling`, on at most
    `generation_max_rows` rows at a time when that is set."""
    if args.replay_completions is not None:
        return Replay.load(args.replay_completions)
    sampler = None
    if args.keyed_sampling:
        sampler = KeyedSampler(args.seed, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               min_p=args.min_p)
    if args.resolved_generation_backend == "static":
        generator = StaticDecode.from_args(args, tokenizer, sampler)
    else:
        generator = HFGenerate.from_args(args, tokenizer, sampler)
    return RowLimited(generator, args.generation_max_rows) if args.generation_max_rows else generator
