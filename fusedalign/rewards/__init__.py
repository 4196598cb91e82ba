"""GRPO rewards: the callable API, built-in verifiable rewards, reward models, loading by name.

    funcs = load_reward_functions(["zen_words", "my_pkg.rewards.brevity"])
    rewards = RewardFunctions(funcs, weights=[1.0, 0.5])
    rewards.check_call(columns=["solution"])                     # before training
    scores = rewards(prompts, completions, completion_ids, {"solution": [...]})   # [N, K], NaN for None
"""

from .api import (RESERVED, RewardError, RewardFunctions, check_columns, format_completions, reward_columns, reward_name,
                  unscored_warning)
from .builtin import BUILTIN_REWARDS, char_class_reward, completion_text, length_reward, regex_reward, zen_words
from .loading import load_reward_function, load_reward_functions
from .model import SequenceClassifierReward, load_reward_model

__all__ = [
    "BUILTIN_REWARDS", "RESERVED", "RewardError", "RewardFunctions", "SequenceClassifierReward", "char_class_reward",
    "check_columns", "completion_text", "format_completions", "length_reward", "load_reward_function",
    "load_reward_functions", "load_reward_model", "regex_reward", "reward_columns", "reward_name", "unscored_warning",
    "zen_words",
]
