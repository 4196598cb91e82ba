"""Reward functions from names, as `--reward_funcs` gives them (TRL's script, plus built-in short names).

A name is, in this order: a built-in short name (`zen_words`, `vowels`, ...); a dotted import
path `package.module.function` (the current directory is importable, as in TRL's script);
or a reward model (a local directory, `builtin:<model>` or a hub id), loaded as a one-label
sequence classifier.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Sequence

from .api import RewardError
from .builtin import BUILTIN_REWARDS
from .model import load_reward_model


def load_reward_function(name: str, **model_kwargs: Any) -> Callable:
    """One reward function from its name (see the module docstring)."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]()
    if os.path.isdir(os.path.expanduser(name)) or name.startswith("builtin:"):
        return load_reward_model(name, **model_kwargs)
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
        return load_reward_model(name, **model_kwargs)
    raise RewardError(f"--reward_funcs {name!r}: expected one of {', '.join(BUILTIN_REWARDS)}, a dotted path "
                      "'package.module.function', or a reward model directory / hub id")


def load_reward_functions(names: Sequence[str] | None = None, reward_model_name_or_path: str | None = None,
                          **model_kwargs: Any) -> list[Callable]:
    """The reward functions of a run: the reward model first (as TRL's script), then each name."""
    funcs: list[Callable] = []
    if reward_model_name_or_path:
        funcs.append(load_reward_model(reward_model_name_or_path, **model_kwargs))
    funcs += [load_reward_function(n, **model_kwargs) for n in names or ()]
    return funcs
