"""Reward functions from names, as `--reward_funcs` gives them (TRL's script, plus built-in short names).

A name is, in this order: a built-in short name (`zen_words`, `vowels`, ..., and TRL's
`think_format_reward`); a dotted import path `package.module.function` (the current directory
is importable, as in TRL's script); or a reward model (a local directory, `builtin:<model>` or
a hub id), loaded as a one-label sequence classifier. The other names of TRL's script
(`accuracy_reward`, ...) are refused with the dotted path that loads them.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Sequence

from .api import RewardError
from .builtin import BUILTIN_REWARDS
from .model import load_reward_model


# The names TRL's `trl grpo` script knows (trl/scripts/grpo.py) that are not built in here: how to give each.
TRL_SCRIPT_REWARDS = {
    "accuracy_reward": "trl.rewards.accuracy_reward",
    "reasoning_accuracy_reward": "trl.rewards.reasoning_accuracy_reward",
    "get_soft_overlong_punishment": "a module of yours holding `overlong = trl.rewards.get_soft_overlong_punishment("
                                    "max_completion_len=1280, soft_punish_cache=256)` (what TRL's script calls), "
                                    "given as my_module.overlong",
}


def load_reward_function(name: str, **model_kwargs: Any) -> Callable:
    """One reward function from its name (see the module docstring)."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]()
    if name in TRL_SCRIPT_REWARDS:
        raise RewardError(f"--reward_funcs {name!r}: a reward built into TRL's `trl grpo` script, not into "
                          f"fusedalign; give it as a dotted path to an importable function: {TRL_SCRIPT_REWARDS[name]} "
                          "(with trl installed)")
    if os.path.isdir(os.path.expanduser(name)) or name.startswith("builtin:"):
        return load_reward_model(name, flag="--reward_funcs", **model_kwargs)
    if "." in name and "/" not in name:
        module_path, attr = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_path)
        except ImportError as error:
            raise RewardError(f"--reward_funcs {name!r}: cannot import module {module_path!r} ({error})") from None
        func = getattr(module, attr, None)
        if not callable(func):
            raise RewardError(f"--reward_funcs {name!r}: module {module_path!r} has no callable {attr!r}")
        return func
    if "/" in name:
        return load_reward_model(name, flag="--reward_funcs", **model_kwargs)
    raise RewardError(f"--reward_funcs {name!r}: expected one of {', '.join(BUILTIN_REWARDS)}, a dotted path "
                      "'package.module.function', or a reward model directory / hub id")


def load_reward_functions(names: Sequence[str] | None = None, reward_model_name_or_path: str | None = None,
                          **model_kwargs: Any) -> list[Callable]:
    """The reward functions of a run: the reward model first (as TRL's script), then each name."""
    funcs: list[Callable] = []
    if reward_model_name_or_path:
        funcs.append(load_reward_model(reward_model_name_or_path, flag="--reward_model_name_or_path", **model_kwargs))
    funcs += [load_reward_function(n, **model_kwargs) for n in names or ()]
    return funcs
