"""Prompt-only data for GRPO: tokenisation, kept columns, and errors that name the column or row."""

from __future__ import annotations

import pytest
from datasets import Dataset

from fusedalign.data import DataError, load_dataset_any
from fusedalign.data.prompts import prepare_prompt_dataset
from fusedalign.models import load_tokenizer
from fusedalign.rewards import reward_columns


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen2")


def test_standard_prompts_keep_their_columns_and_last_tokens(tok):
    data = Dataset.from_dict({"prompt": ["Beautiful is better than", "Flat"], "solution": ["ugly", "nested"]})
    out, stats = prepare_prompt_dataset(data, tok, max_prompt_length=3)
    full = tok("Beautiful is better than")["input_ids"]
    assert out[0]["prompt_ids"] == full[-3:] and len(full) > 3
    assert out[1]["prompt_ids"] == tok("Flat")["input_ids"]
    assert out["row_index"] == [0, 1] and out["solution"] == ["ugly", "nested"]
    assert (stats.num_rows, stats.num_truncated, stats.format.conversational) == (2, 1, False)
    assert reward_columns([out[0]]) == {"solution": ["ugly"]}  # prompt, prompt_ids, row_index are not passed


def test_conversational_prompts_get_the_generation_prompt(tok):
    data = load_dataset_any("builtin:zen", "conversational_prompt_only").select(range(3))
    out, stats = prepare_prompt_dataset(data, tok)
    want = tok.apply_chat_template(data[0]["prompt"], tokenize=True, add_generation_prompt=True, return_dict=True)
    assert out[0]["prompt_ids"] == list(want["input_ids"]) and stats.format.conversational


def test_text_and_label_columns_go_to_the_rewards_as_in_trl(tok):
    """TRL passes every column but prompt and completion to GRPO's reward functions: 'label' and
    'text' are not another trainer's format beside a prompt, so they are columns like any other."""
    data = Dataset.from_dict({"prompt": ["a", "b"], "label": [True, False], "text": ["x", "y"]})
    out, stats = prepare_prompt_dataset(data, tok)
    assert stats.format.kind == "prompt_only"
    assert reward_columns([out[1]]) == {"label": [False], "text": ["y"]}
    out, stats = prepare_prompt_dataset(data.add_column("completion", ["c", "d"]).remove_columns("label"), tok)
    assert stats.format.kind == "prompt_completion" and reward_columns([out[0]]) == {"text": ["x"]}


def test_a_completion_column_is_accepted(tok):
    out, stats = prepare_prompt_dataset(load_dataset_any("builtin:zen", "standard_prompt_completion"), tok)
    assert stats.format.kind == "prompt_completion" and "completion" in out.column_names
    assert "completion" not in reward_columns([out[0]])  # as TRL


@pytest.mark.parametrize("columns,match", [
    ({"text": ["a"]}, r"missing column 'prompt' \(all rows\): GRPO expects prompts"),
    ({"prompt": ["a"], "completions": ["b"]}, r"column 'completions' clashes with an argument of the reward functions"),
    ({"prompt": ["a"], "prompt_ids": [[1]]}, r"column 'prompt_ids' clashes"),
    ({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]}, r"unexpected column.*fit format preference"),
    ({"prompt": ["a"], "completion": ["b"], "label": [True]}, r"unexpected column.*fit format unpaired_preference"),
    ({"prompt": ["a", None]}, r"row 1"),
])
def test_bad_data_is_refused_naming_the_column_or_row(tok, columns, match):
    with pytest.raises(DataError, match=match):
        prepare_prompt_dataset(Dataset.from_dict(columns), tok)
    with pytest.raises(DataError, match="empty"):
        prepare_prompt_dataset(Dataset.from_dict({"prompt": []}), tok)
