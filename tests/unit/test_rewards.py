"""Reward functions: the callable API and its errors, built-in rewards, loading by name, reward models."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from fusedalign.rewards import (
    RewardError,
    RewardFunctions,
    SequenceClassifierReward,
    char_class_reward,
    format_completions,
    length_reward,
    load_reward_function,
    load_reward_functions,
    load_reward_model,
    regex_reward,
    reward_columns,
    zen_words,
)
from fusedalign.rewards.builtin import ZEN_TEXT, zen_vocabulary

PROMPTS = ["Beautiful is", "Flat is", "Sparse"]
COMPLETIONS = [" better than ugly.", " xyzzy plugh, nested", ""]
IDS = [[1, 2, 3], [4, 5], []]


# ------------------------------------------------------------------ built-in rewards


def test_zen_words_counts_words_of_the_embedded_text():
    vocab = {"".join(ch for ch in w.lower() if ch.isalnum()) for w in ZEN_TEXT.read_text().split()} - {""}
    assert zen_vocabulary() == vocab and "dutch" in vocab and "arent" in vocab
    got = zen_words(["Beautiful is better than ugly.", "xyzzy plugh, nested", "", "  --  ", "Now, NEVER!!"])
    assert got == [1.0, pytest.approx(1 / 3), 0.0, 0.0, 1.0]
    # Conversational completions: the assistant message's content.
    assert zen_words(format_completions(["Errors should never pass silently zzz"], True)) == [pytest.approx(5 / 6)]


def test_char_class_regex_and_length():
    vowels = char_class_reward("aeiou")
    assert vowels(["aA b", "", "xyz", [{"role": "assistant", "content": "oi"}]]) == [2 / 3, 0.0, 0.0, 1.0]
    assert char_class_reward("A", ignore_case=False)(["aA"]) == [0.5]
    period = regex_reward(r"\.$")
    assert period(["Done.", "Not done", " Done.  "]) == [1.0, 0.0, 1.0]
    assert regex_reward(r"[a-z]+", full=True)(["abc", "abc1"]) == [1.0, 0.0]
    assert length_reward(4)(["a b c d", "a b"]) == [0.0, -0.5]
    assert length_reward(2, unit="chars")(["abcd"]) == [-1.0]
    assert length_reward(2, unit="tokens")(["x", "y"], completion_ids=[[1, 2], [1, 2, 3, 4]]) == [0.0, -1.0]
    with pytest.raises(ValueError, match="unit"):
        length_reward(3, unit="lines")


# ------------------------------------------------------------------ the call


def _len_reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(c)) for c in completion_ids]


def test_rewards_tensor_weights_none_and_columns():
    seen = {}

    def with_column(prompts, completions, completion_ids, solution, trainer_state=None):
        seen["state"], seen["solution"] = trainer_state, solution
        return [1.0 if s == c.strip() else None for s, c in zip(solution, completions)]

    def kw_only(completions, **kwargs):  # TRL-style: everything else arrives in kwargs
        seen["kwargs"] = sorted(kwargs)
        return [0.5, 1, True]

    rf = RewardFunctions([_len_reward, with_column, kw_only], weights=[1.0, 2.0, 0.5])
    assert rf.names == ["_len_reward", "with_column", "kw_only"]
    torch.testing.assert_close(rf.weights, torch.tensor([1.0, 2.0, 0.5]))
    columns = {"solution": ["better than ugly.", "no", "x"]}
    out = rf(PROMPTS, COMPLETIONS, IDS, columns, trainer_state="STATE")
    assert out.shape == (3, 3) and out.dtype == torch.float32
    assert out[:, 0].tolist() == [3.0, 2.0, 0.0]
    assert out[0, 1] == 1.0 and math.isnan(out[1, 1]) and math.isnan(out[2, 1])
    assert out[:, 2].tolist() == [0.5, 1.0, 1.0]
    assert seen["state"] == "STATE" and seen["solution"] == columns["solution"]
    assert seen["kwargs"] == ["completion_ids", "prompts", "solution", "trainer_state"]


def test_duplicate_names_get_suffixes():
    assert RewardFunctions([zen_words, zen_words, char_class_reward("a")]).names == ["zen_words", "zen_words_2", "char_class"]


def test_reward_columns_skip_prompt_and_refuse_clashes():
    rows = [{"prompt": "p", "prompt_ids": [1], "solution": "s", "level": 2}]
    assert reward_columns(rows) == {"solution": ["s"], "level": [2]}
    with pytest.raises(RewardError, match=r"dataset column 'completions' clashes"):
        reward_columns([{"prompt": "p", "completions": "c"}])
    with pytest.raises(RewardError, match=r"dataset column 'prompts' clashes"):
        RewardFunctions([zen_words]).check_call(["prompts"])


def test_a_function_that_raises_names_itself_and_the_row():
    def picky(completions, **kwargs):
        return [1.0 / len(c) for c in completions]  # the empty completion divides by zero

    rf = RewardFunctions([zen_words, picky])
    with pytest.raises(RewardError, match=r"reward function 'picky' raised ZeroDivisionError: .* \(on dataset row 12, generation 1\)"):
        rf(PROMPTS, COMPLETIONS, IDS, row_ids=["dataset row 10, generation 0", "dataset row 11, generation 0",
                                              "dataset row 12, generation 1"])


@pytest.mark.parametrize("returned,match", [
    ([1.0, 2.0], r"'bad' returned 2 values for 3 completions; expected one float or None per completion"),
    ([1.0, "high", 2.0], r"'bad' returned 'high' \(str\) for row 1; expected a float, an int or None"),
    (0.5, r"'bad' returned float; expected a list of 3 floats or None"),
])
def test_wrong_outputs_are_named(returned, match):
    def bad(completions, **kwargs):
        return returned

    with pytest.raises(RewardError, match=match):
        RewardFunctions([bad])(PROMPTS, COMPLETIONS, IDS)


def test_signature_checks_before_training():
    def narrow(prompts, completions):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"'narrow' cannot take the call .* no parameter 'completion_ids' and no \*\*kwargs"):
        RewardFunctions([narrow]).check_call([])

    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"'needs_answer' requires 'answer', which is neither .* \(columns: \['solution'\]\)"):
        RewardFunctions([needs_answer]).check_call(["solution"])
    RewardFunctions([needs_answer]).check_call(["answer"])
    with pytest.raises(RewardError, match="reward_weights has 1 values for 2 reward functions"):
        RewardFunctions([zen_words, needs_answer], weights=[1.0])
    with pytest.raises(RewardError, match="no reward function"):
        RewardFunctions([])


# ------------------------------------------------------------------ loading by name


def test_loading_short_names_and_dotted_paths(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def shout(completions, **kwargs):
            return [float(c.isupper()) for c in completions]
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    funcs = load_reward_functions(["zen_words", "vowels", "ends_with_period", "length", "my_rewards.shout"])
    rf = RewardFunctions(funcs)
    assert rf.names == ["zen_words", "vowels", "ends_with_period", "length", "shout"]
    assert rf(["p"], ["ABC."], [[1]])[0, 4] == 1.0
    with pytest.raises(RewardError, match=r"cannot import module 'nowhere'"):
        load_reward_function("nowhere.func")
    with pytest.raises(RewardError, match=r"module 'my_rewards' has no callable 'missing'"):
        load_reward_function("my_rewards.missing")
    with pytest.raises(RewardError, match=r"--reward_funcs 'zen': expected one of zen_words"):
        load_reward_function("zen")


def _trls_think_format_reward(completions, **kwargs):
    """TRL 1.16's trl/rewards/format_rewards.py, as written there."""
    import re

    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.DOTALL | re.MULTILINE) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


THINK_TEXTS = ["<think>\nThis is my reasoning.\n</think>\nThis is my answer.",  # TRL's docstring examples
               "<think>\nThis is my reasoning.\nThis is my answer.",
               "<think></think>", "<think>a</think>b</think>", "<think>a<think>b</think>", " <think>a</think>",
               "x\n<think>a</think>", "<think>a\n\nb</think>\n\nc", "", "</think><think>a</think>"]


def test_think_format_reward_is_trls():
    conversational = [[{"role": "assistant", "content": t}] for t in THINK_TEXTS]
    want = _trls_think_format_reward(conversational)
    assert want[:2] == [1.0, 0.0] and 0.0 < sum(want) < len(want)
    think = load_reward_function("think_format_reward")
    assert think(conversational) == want and think(THINK_TEXTS) == want  # strings read as they are
    assert RewardFunctions([think]).names == ["think_format_reward"]  # TRL's metric name


@pytest.mark.parametrize("name,how", [("accuracy_reward", "trl.rewards.accuracy_reward"),
                                      ("reasoning_accuracy_reward", "trl.rewards.reasoning_accuracy_reward"),
                                      ("get_soft_overlong_punishment", "max_completion_len=1280, soft_punish_cache=256")])
def test_the_other_names_of_trls_script_say_how_to_load_them(name, how):
    with pytest.raises(RewardError, match=rf"^--reward_funcs '{name}': a reward built into TRL's `trl grpo` script, "
                                          "not into fusedalign; give it as a dotted path") as err:
        load_reward_function(name)
    assert how in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------ reward models


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny random Qwen2ForSequenceClassification (num_labels=1) built from the tiny config, saved locally."""
    from tests.reward_model import save_tiny_reward_model

    return save_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm")


def _score_alone(rm: SequenceClassifierReward, text: str) -> float:
    ids = rm.tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return float(rm.model(**ids).logits[0, 0])


def test_reward_model_scores_prompt_plus_completion(reward_model_dir):
    rm = load_reward_function(str(reward_model_dir))
    assert isinstance(rm, SequenceClassifierReward) and rm.reward_name == "tiny-rm"
    prompts, completions = ["Beautiful is", "Flat"], [" better than ugly and long.", " is"]
    got = RewardFunctions([rm])(prompts, completions, [[1], [2]])[:, 0]
    # Batched with right padding = each text scored alone (the classifier reads the last real token).
    want = [_score_alone(rm, p + c) for p, c in zip(prompts, completions)]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert got[0] != got[1]


def test_reward_model_applies_the_chat_template_to_conversations(reward_model_dir):
    rm = load_reward_model(str(reward_model_dir))
    prompts = [[{"role": "user", "content": "Beautiful is"}]]
    completions = format_completions([" better than ugly."], True)
    text = rm.tokenizer.apply_chat_template(prompts[0] + completions[0], tokenize=False)
    assert rm.texts(prompts, completions) == [text] and "<|im_start|>assistant" in text
    got = rm(prompts, completions)
    assert got == pytest.approx([_score_alone(rm, text)], rel=1e-5)


def test_reward_model_must_have_one_label():
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    from fusedalign.models import load_tokenizer, resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path("builtin:tiny-qwen2"), num_labels=2)
    with pytest.raises(ValueError, match="num_labels=1"):
        SequenceClassifierReward(Qwen2ForSequenceClassification(config), load_tokenizer("builtin:tiny-qwen2"))
