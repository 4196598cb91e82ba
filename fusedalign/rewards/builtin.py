"""Built-in verifiable rewards: pure functions of the completion text, scored in [0, 1] or below 0.

`zen_words` is the one the embedded tiny model visibly learns in minutes on a CPU: the share
of a completion's words that are words of the Zen of Python (`fusedalign/resources/zen.txt`).
The others are factories (`char_class_reward("aeiou")`, `regex_reward(r"\\.$")`,
`length_reward(16)`); `think_format_reward` is TRL's. `BUILTIN_REWARDS` names them for `--reward_funcs`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable, Sequence

ZEN_TEXT = Path(__file__).resolve().parents[1] / "resources" / "zen.txt"


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the contents of its messages (conversational)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)


def normalise_word(word: str) -> str:
    """Lower case, every character that is not a letter or a digit removed ("Don't," -> "dont")."""
    return "".join(ch for ch in word.lower() if ch.isalnum())


@functools.lru_cache(maxsize=1)
def zen_vocabulary() -> frozenset[str]:
    """The normalised words of the embedded Zen of Python."""
    return frozenset(w for w in map(normalise_word, ZEN_TEXT.read_text().split()) if w)


def zen_words(completions: Sequence, **kwargs: Any) -> list[float]:
    """Share of a completion's whitespace-separated words (normalised, empty ones dropped) in the Zen text; 0 without words."""
    vocab = zen_vocabulary()
    out = []
    for c in completions:
        words = [w for w in map(normalise_word, completion_text(c).split()) if w]
        out.append(sum(w in vocab for w in words) / len(words) if words else 0.0)
    return out


def char_class_reward(chars: str = "aeiou", *, ignore_case: bool = True, name: str | None = None) -> Callable:
    """A reward: the share of a completion's non-whitespace characters that are in `chars` (0 when empty)."""
    allowed = set(chars.lower() if ignore_case else chars)

    def char_class(completions: Sequence, **kwargs: Any) -> list[float]:
        out = []
        for c in completions:
            text = "".join(completion_text(c).split())
            text = text.lower() if ignore_case else text
            out.append(sum(ch in allowed for ch in text) / len(text) if text else 0.0)
        return out

    char_class.reward_name = name or "char_class"
    return char_class


def regex_reward(pattern: str, *, full: bool = False, name: str | None = None) -> Callable:
    """A reward: 1.0 where the completion matches `pattern` (`re.search`; `re.fullmatch` with full), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    match = compiled.fullmatch if full else compiled.search

    def regex(completions: Sequence, **kwargs: Any) -> list[float]:
        return [1.0 if match(completion_text(c).strip()) else 0.0 for c in completions]

    regex.reward_name = name or "regex"
    return regex


def length_reward(target: int, *, unit: str = "words", name: str | None = None) -> Callable:
    """A reward: -|n - target| / target, n the completion's length in `unit` ("words", "chars" or "tokens")."""
    if target <= 0 or unit not in ("words", "chars", "tokens"):
        raise ValueError(f"length_reward needs target > 0 and unit words/chars/tokens; got {target}, {unit!r}")

    def length(completions: Sequence, completion_ids: Sequence | None = None, **kwargs: Any) -> list[float]:
        if unit == "tokens":
            sizes = [len(ids) for ids in completion_ids]
        elif unit == "chars":
            sizes = [len(completion_text(c)) for c in completions]
        else:
            sizes = [len(completion_text(c).split()) for c in completions]
        return [-abs(n - target) / target for n in sizes]

    length.reward_name = name or "length"
    return length


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: Sequence, **kwargs: Any) -> list[float]:
    """TRL's `think_format_reward` (trl/rewards/format_rewards.py): 1.0 where the completion starts with one
    `<think>...</think>` block (no second `<think>`), else 0.0.

    TRL reads a conversational completion's first message; a standard (string) completion is read
    as it is (TRL's function takes conversational completions only).
    """
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if _THINK.match(text) else 0.0 for text in texts]


# Short names for --reward_funcs (each a ready reward function).
BUILTIN_REWARDS: dict[str, Callable[[], Callable]] = {
    "zen_words": lambda: zen_words,
    "vowels": lambda: char_class_reward("aeiou", name="vowels"),
    "ends_with_period": lambda: regex_reward(r"\.$", name="ends_with_period"),
    "length": lambda: length_reward(16, unit="words"),
    "think_format_reward": lambda: think_format_reward,  # the name TRL's `trl grpo` script gives it
}
