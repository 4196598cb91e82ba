"""Data layer: builtin datasets, format detection and errors, tokenisation, collators, packing."""

from __future__ import annotations

import copy
import logging
import json

import pytest
import torch
from datasets import Dataset

from fusedalign.data import (
    DataError,
    DataFormat,
    DPOCollator,
    KTOCollator,
    SFTCollator,
    detect_format,
    extract_prompt,
    list_builtin_datasets,
    load_dataset_any,
    pack_dataset,
    pack_sequences,
    position_labels,
    prepare_dpo_dataset,
    prepare_kto_dataset,
    prepare_sft_dataset,
    tokenize_dpo_row,
    tokenize_kto_row,
    tokenize_prompt_row,
    tokenize_sft_row,
    truncate_pair,
    unpair_preference_dataset,
    validate_dataset,
)
from fusedalign.data.kto import KLPairCollator
from fusedalign.models import load_model, load_tokenizer

ZEN_CONFIGS = [
    f"{style}_{kind}"
    for style in ("standard", "conversational")
    for kind in ("language_modeling", "prompt_only", "prompt_completion", "preference",
                 "implicit_prompt_preference", "unpaired_preference")
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tokenizer")


@pytest.fixture(scope="module")
def no_template_tok(tok):
    t = copy.deepcopy(tok)
    t.chat_template = None
    return t


def ids(tok, text, special=False):
    return tok(text, add_special_tokens=special)["input_ids"]


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


# ------------------------------------------------------------------------------ builtin


def test_builtin_lists_every_config():
    assert sorted(list_builtin_datasets()["zen"]) == sorted(ZEN_CONFIGS)


@pytest.mark.parametrize("config", ZEN_CONFIGS)
def test_builtin_zen_config(config):
    train = load_dataset_any("builtin:zen", config)
    test = load_dataset_any("builtin:zen", config, split="test")
    assert detect_format(train).name == config and detect_format(test).name == config
    assert len(train) >= 40 and len(test) >= 5
    validate_dataset(train)
    if "preference" in config and "unpaired" not in config:
        assert 100 <= len(train) <= 300


def test_builtin_unpaired_is_balanced():
    labels = load_dataset_any("builtin:zen", "standard_unpaired_preference")["label"]
    assert sum(labels) * 2 == len(labels)


def test_builtin_errors():
    with pytest.raises(DataError, match="standard_preference"):
        load_dataset_any("builtin:zen", "standard_preferences")
    with pytest.raises(DataError, match="needs a config"):
        load_dataset_any("builtin:zen")
    with pytest.raises(DataError, match="builtin:zen"):
        load_dataset_any("builtin:poems", "standard_preference")
    with pytest.raises(DataError, match="'validation'.*test"):
        load_dataset_any("builtin:zen", "standard_preference", split="validation")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_local_files_and_directories(tmp_path, suffix):
    rows = [{"prompt": "Flat is", "chosen": " better than nested.", "rejected": " worse."}] * 3
    path = tmp_path / f"data{suffix}"
    if suffix == ".parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = load_dataset_any(str(path))
    assert ds.to_list() == rows
    directory = tmp_path / "dir"
    directory.mkdir()
    (directory / f"train{suffix}").write_bytes(path.read_bytes())
    assert load_dataset_any(str(directory)).to_list() == rows


def test_missing_local_path():
    with pytest.raises(DataError, match="no/such/file.jsonl"):
        load_dataset_any("./no/such/file.jsonl")


@pytest.mark.parametrize("name,content,expected", [
    ("empty.jsonl", "", r"empty\.jsonl is empty: expected JSON Lines"),
    ("blank.jsonl", "\n \n", r"blank\.jsonl holds no rows \(only whitespace\)"),
    ("bad.jsonl", '{"prompt": "a"}\n\n{"prompt": "b",}\n', r"bad\.jsonl, line 3, column 16: not valid JSON \(.*\); "
                                                           r"expected one JSON object per line"),
    ("list.jsonl", '{"prompt": "a"}\n[1, 2]\n', r"list\.jsonl, line 2: a JSON list; expected an object"),
    ("array.json", '[{"prompt": "a"},\n {"prompt": }]', r"array\.json, line 2, column 13: not valid JSON"),
])
def test_unreadable_local_files_name_file_and_line(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=expected):
        load_dataset_any(str(path))


def test_errors_of_a_local_file_name_its_line(tmp_path):
    from fusedalign.data.builtin import located_error

    path = tmp_path / "prefs.jsonl"
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2 + [{"prompt": "a", "chosen": "", "rejected": "c"}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:]))
    with pytest.raises(DataError) as info:
        validate_dataset(load_dataset_any(str(path)), "dpo")
    assert info.value.row == 2
    where = str(located_error(info.value, str(path), "train"))
    assert where == f"{path}, line 4: row 2 (from 0), column 'chosen': empty chosen; expected a non-empty string"
    assert str(located_error(info.value, "org/data", "test")).startswith("dataset org/data (test split): row 2 (from 0)")


@pytest.mark.parametrize("row, match", [
    ({"prompt": [{"role": "usr", "content": "a"}], "chosen": assistant("b"), "rejected": assistant("c")},
     r"row 0 \(from 0\), column 'prompt', message 0 \(from 0\): role 'usr'; expected one of \['assistant'"),
    ({"prompt": user("a"), "chosen": user("b"), "rejected": assistant("c")},
     r"column 'chosen', message 0 \(from 0\): role 'user'; expected 'assistant'"),
    ({"prompt": user("a"), "chosen": assistant("b"), "rejected": [{"role": "asistant", "content": "c"}]},
     r"column 'rejected', message 0 \(from 0\): role 'asistant'"),
    ({"prompt": user("a"), "chosen": assistant("b") + user("more"), "rejected": assistant("c")},
     r"column 'chosen', message 1 \(from 0\): role 'user'"),
])
def test_roles_are_checked_in_prompt_and_completions(tok, row, match):
    with pytest.raises(DataError, match=match):
        tokenize_dpo_row(row, tok, index=0)


def test_roles_of_implicit_and_tool_conversations_are_accepted(tok):
    implicit = {"chosen": user("a") + assistant("b"), "rejected": user("a") + assistant("c")}
    assert tokenize_dpo_row(implicit, tok, index=0)["chosen_ids"]
    tool = [{"role": "assistant", "content": "calling"}, {"role": "tool", "content": "42"}]
    validate_dataset([{"prompt": [{"role": "system", "content": "s"}] + user("a"), "completion": tool}], "sft")


def test_rows_the_truncation_cuts_raise_no_tokenizer_length_warning(tok, caplog):
    import logging

    short = copy.deepcopy(tok)
    short.model_max_length = 8
    rows = Dataset.from_list([{"prompt": "Beautiful is better than ugly. " * 4, "chosen": " Yes.", "rejected": " No."}])
    with caplog.at_level(logging.WARNING):
        prepare_dpo_dataset(rows, short, max_length=8)
    assert "Token indices sequence length" not in caplog.text and "longer than the model's limit" not in caplog.text
    with caplog.at_level(logging.WARNING):
        prepare_dpo_dataset(rows, short, max_length=None)  # rows that stay too long: said once, by us
    assert "Token indices sequence length" not in caplog.text
    assert "1 of 1 rows are longer than the model's limit (model_max_length=8 tokens" in caplog.text


# ------------------------------------------------------------------------------ formats


@pytest.mark.parametrize("row, kind, conv", [
    ({"text": "a"}, "language_modeling", False),
    ({"messages": user("a")}, "language_modeling", True),
    ({"prompt": user("a")}, "prompt_only", True),
    ({"prompt": "a", "completion": "b"}, "prompt_completion", False),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "id": 3}, "preference", False),
    ({"chosen": user("a"), "rejected": user("b")}, "implicit_preference", True),
    ({"prompt": "a", "completion": "b", "label": True}, "unpaired_preference", False),
])
def test_detect_format(row, kind, conv):
    assert detect_format(row) == DataFormat(kind, conv)


def test_missing_columns_named():
    with pytest.raises(DataError, match=r"missing column\(s\) \['chosen', 'rejected'\].*DPO.*prompt_completion"):
        detect_format({"prompt": "a", "completion": "b"}, "dpo")
    with pytest.raises(DataError, match="unpair_preference_dataset"):
        detect_format({"prompt": "a", "chosen": "b", "rejected": "c"}, "kto")


def test_unexpected_columns_named():
    with pytest.raises(DataError, match=r"unexpected column\(s\) \['label'\].*prompt_completion"):
        detect_format(["prompt", "completion", "label"], "sft")
    with pytest.raises(DataError, match="'text' and 'messages'"):
        detect_format(["text", "messages"])


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "  ", "chosen": "b", "rejected": "c"}],
     r"row 1 \(from 0\), column 'prompt': empty prompt"),
    ([{"prompt": "a", "chosen": "", "rejected": "c"}], r"row 0 \(from 0\), column 'chosen': empty chosen"),
    ([{"prompt": user("a"), "chosen": assistant("b"), "rejected": assistant("c")},
      {"prompt": user("a"), "chosen": [{"role": "assistant"}], "rejected": assistant("c")}],
     r"row 1 \(from 0\), column 'chosen', message 0 \(from 0\): expected a mapping with string 'role' and 'content'"),
    ([{"prompt": user("a"), "chosen": assistant("b"), "rejected": "c"}],
     r"row 0 \(from 0\), column 'rejected': expected a non-empty list of \{'role', 'content'\} messages"),
    ([{"prompt": "a", "chosen": user("b"), "rejected": "c"}],
     r"row 0 \(from 0\), column 'chosen': expected a string"),
])
def test_row_errors_name_row_and_column(rows, match):
    with pytest.raises(DataError, match=match):
        validate_dataset(rows, "dpo")


def test_kto_label_must_be_boolean(tok):
    rows = [{"prompt": "a", "completion": "b", "label": True}, {"prompt": "a", "completion": "b", "label": 1}]
    with pytest.raises(DataError, match=r"row 1 \(from 0\), column 'label': expected a boolean.*\(int\)"):
        validate_dataset(rows, "kto")
    ints = Dataset.from_list([{**rows[0], "label": 1}, rows[1]])  # e.g. 0/1 labels from a JSON file
    with pytest.raises(DataError, match=r"row 0 \(from 0\), column 'label': expected a boolean"):
        prepare_kto_dataset(ints, tok)


def test_conversational_needs_chat_template(no_template_tok):
    ds = load_dataset_any("builtin:zen", "conversational_preference")
    with pytest.raises(DataError, match="column 'prompt'.*no chat template"):
        prepare_dpo_dataset(ds, no_template_tok)
    # Standard data does not need one.
    prepare_dpo_dataset(load_dataset_any("builtin:zen", "standard_preference").select(range(4)), no_template_tok)


def test_prepare_rejects_bad_rows_before_training(tok):
    ds = Dataset.from_list([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": ""}])
    with pytest.raises(DataError, match=r"row 1 \(from 0\), column 'completion': empty completion"):
        prepare_sft_dataset(ds, tok)
    with pytest.raises(DataError, match="empty"):
        prepare_sft_dataset(ds.select([]), tok)


# ---------------------------------------------------------------------------- tokenising


def test_dpo_standard(tok):
    row = {"prompt": "Beautiful is better than", "chosen": " ugly.", "rejected": " pretty."}
    out = tokenize_dpo_row(row, tok)
    assert out["prompt_ids"] == ids(tok, row["prompt"], special=True)
    assert out["chosen_ids"] == ids(tok, " ugly.") + [tok.eos_token_id]
    assert out["rejected_ids"] == ids(tok, " pretty.") + [tok.eos_token_id]
    assert out["truncated"] is False


def test_dpo_conversational_splits_on_template_prefix(tok):
    row = {"prompt": user("Now is"), "chosen": assistant("better than never."),
           "rejected": assistant("worse than never.")}
    out = tokenize_dpo_row(row, tok)
    prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
    full = tok.apply_chat_template(row["prompt"] + row["chosen"])["input_ids"]
    assert out["prompt_ids"] == prompt
    assert out["prompt_ids"] + out["chosen_ids"] == full
    assert tok.decode(out["rejected_ids"]) == "worse than never.<|im_end|>\n"


def test_dpo_template_without_prefix_property_is_an_error(tok):
    bad = copy.deepcopy(tok)
    bad.chat_template = (
        "{% for m in messages %}<|im_start|>{{ 'bot' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    row = {"prompt": user("Now is"), "chosen": assistant("better."), "rejected": assistant("worse.")}
    with pytest.raises(DataError, match=r"row 7 \(from 0\), column 'chosen'.*prefix"):
        tokenize_dpo_row(row, bad, index=7)


def test_implicit_prompt_extraction():
    row = {"chosen": "Beautiful is better than ugly.", "rejected": "Beautiful is better than uglier."}
    assert extract_prompt(row) == {"prompt": "Beautiful is better than", "chosen": " ugly.",
                                   "rejected": " uglier."}
    conv = {"chosen": user("Now is") + assistant("better."), "rejected": user("Now is") + assistant("worse.")}
    assert extract_prompt(conv) == {"prompt": user("Now is"), "chosen": assistant("better."),
                                    "rejected": assistant("worse.")}
    with pytest.raises(DataError, match=r"row 3 \(from 0\).*no common prefix"):
        extract_prompt({"chosen": "Yes.", "rejected": "No."}, 3)
    with pytest.raises(DataError, match=r"row 4 \(from 0\), columns 'chosen'/'rejected': identical"):
        extract_prompt({"chosen": "Same text.", "rejected": "Same text."}, 4)
    with pytest.raises(DataError, match=r"row 5 \(from 0\), column 'chosen': empty"):
        extract_prompt({"chosen": user("a"), "rejected": user("a") + assistant("b")}, 5)


def test_implicit_tokenises_like_explicit(tok):
    explicit = {"prompt": "Flat is better than", "chosen": " nested.", "rejected": " dense."}
    implicit = {"chosen": "Flat is better than nested.", "rejected": "Flat is better than dense."}
    assert tokenize_dpo_row(implicit, tok) == tokenize_dpo_row(explicit, tok)
    conv_explicit = {"prompt": user("Flat is"), "chosen": assistant("better."), "rejected": assistant("worse.")}
    conv_implicit = {"chosen": user("Flat is") + assistant("better."), "rejected": user("Flat is") + assistant("worse.")}
    assert tokenize_dpo_row(conv_implicit, tok) == tokenize_dpo_row(conv_explicit, tok)


def test_truncate_pair():
    prompt, chosen, rejected = list(range(10)), [20, 21, 22, 23], [30, 31]
    p, (c, r), cut = truncate_pair(prompt, [chosen, rejected], max_prompt_length=6)
    assert (p, c, r, cut) == (list(range(4, 10)), chosen, rejected, True)
    p, (c, r), cut = truncate_pair(prompt, [chosen, rejected], max_length=8, truncation_mode="keep_end")
    assert (p, c, r, cut) == ([6, 7, 8, 9], chosen, rejected, True)
    p, (c, r), cut = truncate_pair(prompt, [chosen, rejected], max_length=12, truncation_mode="keep_start")
    assert (p, c, r, cut) == (prompt, [20, 21], [30, 31], True)
    p, (c, r), cut = truncate_pair(prompt, [chosen, rejected], max_completion_length=3, max_length=20)
    assert (c, cut) == ([20, 21, 22], True)
    assert truncate_pair(prompt, [chosen], max_length=14)[2] is False
    with pytest.raises(ValueError, match="truncation_mode"):
        truncate_pair(prompt, [chosen], truncation_mode="middle")


def test_dpo_truncation_count(tok):
    ds = load_dataset_any("builtin:zen", "standard_preference")
    full, stats = prepare_dpo_dataset(ds, tok)
    assert stats.num_truncated == 0 and stats.num_rows == len(ds)
    assert set(full.column_names) == {"prompt_ids", "chosen_ids", "rejected_ids"}
    limit = 12
    expected = sum(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) > limit for r in full)
    short, stats = prepare_dpo_dataset(ds, tok, max_length=limit)
    assert 0 < stats.num_truncated == expected < len(ds)
    assert all(len(r["prompt_ids"]) + len(r["chosen_ids"]) <= limit for r in short)


@pytest.mark.parametrize("kind, rows", [
    ("dpo", [{"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8, 9]},
             {"prompt_ids": [5, 6], "chosen_ids": [], "rejected_ids": [9]},  # one answer left: it still trains
             {"prompt_ids": [5, 6, 7], "chosen_ids": [7], "rejected_ids": [9]}]),
    ("kto", [{"prompt_ids": [5, 6], "completion_ids": [7], "label": True},
             {"prompt_ids": [5], "completion_ids": [8], "label": False},
             {"prompt_ids": [5, 6, 7], "completion_ids": [8], "label": False}]),
])
def test_rows_truncation_leaves_without_a_completion_token_are_said_and_a_split_of_only_them_refused(
        tok, caplog, kind, rows):
    """max_length 3, keep_start: the last row, whose prompt fills it, keeps no completion token (DPO: neither
    answer; KTO: the completion) and trains nothing: counted in a warning. A split of only such rows is
    refused, naming it and the limits to check."""
    from fusedalign.data.splits import prepare_split

    data = Dataset.from_list(rows)
    with caplog.at_level(logging.WARNING, logger="fusedalign.data.splits"):
        out = prepare_split(kind, data, tok, "train", max_length=3, max_prompt_length=None,
                            truncation_mode="keep_start")
    assert len(out) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert "train split: 1 of 3 rows have no token to learn from (kept; they add nothing to the loss)." in messages
    with pytest.raises(DataError) as err:
        prepare_split(kind, Dataset.from_list(rows[2:] * 2), tok, "eval", max_length=3, max_prompt_length=None,
                      truncation_mode="keep_start")
    assert str(err.value) == ("eval split: none of its 2 rows has a token to learn from after tokenisation and "
                              "truncation (the completion is empty or was cut off); check max_length, "
                              "max_prompt_length and truncation_mode.")


def test_kto_rows_and_unpairing(tok):
    row = {"prompt": "Now is", "completion": " better than never.", "label": False}
    out = tokenize_kto_row(row, tok)
    assert out["label"] is False
    assert out["completion_ids"] == ids(tok, row["completion"]) + [tok.eos_token_id]
    paired = Dataset.from_list([
        {"chosen": "Flat is better than nested.", "rejected": "Flat is better than dense."},
        {"chosen": "Now is better than never.", "rejected": "Now is worse than never."},
    ])
    unpaired = unpair_preference_dataset(paired)
    assert detect_format(unpaired) == DataFormat("unpaired_preference", False)
    assert unpaired.to_list() == [
        {"prompt": "Flat is better than", "completion": " nested.", "label": True},
        {"prompt": "Flat is better than", "completion": " dense.", "label": False},
        {"prompt": "Now is", "completion": " better than never.", "label": True},
        {"prompt": "Now is", "completion": " worse than never.", "label": False},
    ]
    conv = unpair_preference_dataset(load_dataset_any("builtin:zen", "conversational_preference").select(range(3)))
    assert detect_format(conv).name == "conversational_unpaired_preference" and len(conv) == 6
    prepared, stats = prepare_kto_dataset(conv, tok)
    assert prepared["label"] == [True, False] * 3


def test_prompt_only(tok):
    out = tokenize_prompt_row({"prompt": user("Now is")}, tok)
    assert tok.decode(out["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert tokenize_prompt_row({"prompt": "Now is better"}, tok, max_prompt_length=1)["prompt_ids"] == \
        ids(tok, "Now is better", special=True)[-1:]
    assert detect_format({"prompt": "a"}, "prompt_only") == DataFormat("prompt_only", False)
    assert detect_format({"prompt": "a"}, "grpo") == DataFormat("prompt_only", False)  # GRPO reads prompts
    with pytest.raises(ValueError, match="unknown format kind"):
        detect_format({"prompt": "a"}, "ppo")


def test_sft_language_modeling(tok):
    out = tokenize_sft_row({"text": "Readability counts."}, tok)
    assert out["input_ids"] == ids(tok, "Readability counts.", special=True) + [tok.eos_token_id]
    assert out["completion_mask"] == [1] * len(out["input_ids"])


def test_sft_prompt_completion_masks(tok):
    row = {"prompt": "Readability", "completion": " counts."}
    n_prompt = len(ids(tok, "Readability", special=True))
    only = tokenize_sft_row(row, tok)
    assert only["completion_mask"] == [0] * n_prompt + [1] * (len(only["input_ids"]) - n_prompt)
    everything = tokenize_sft_row(row, tok, completion_only_loss=False)
    assert everything["input_ids"] == only["input_ids"] and all(everything["completion_mask"])
    conv = tokenize_sft_row({"prompt": user("Readability"), "completion": assistant("counts.")}, tok)
    scored = tok.decode([t for t, m in zip(conv["input_ids"], conv["completion_mask"]) if m])
    assert scored == "counts.<|im_end|>\n"


def test_sft_completion_only_loss_follows_trls_rule(tok):
    """TRL 1.16: None (the default) learns the completion of prompt-completion data and every token of
    language-modeling data; False every token; True is for prompt-completion data only."""
    from fusedalign.configs import SFTConfig
    from fusedalign.data.splits import prepare_split

    assert SFTConfig(use_cpu=True).completion_only_loss is None
    pc, lm = {"prompt": "Readability", "completion": " counts."}, {"text": "Readability counts."}
    n_prompt = len(ids(tok, "Readability", special=True))
    for value in (None, True):
        mask = tokenize_sft_row(pc, tok, completion_only_loss=value)["completion_mask"]
        assert mask == [0] * n_prompt + [1] * (len(mask) - n_prompt)
    for value in (None, False):
        assert all(tokenize_sft_row(lm, tok, completion_only_loss=value)["completion_mask"])
    with pytest.raises(DataError, match="completion_only_loss=True needs prompt-completion data"):
        tokenize_sft_row(lm, tok, completion_only_loss=True)
    with pytest.raises(DataError, match=r"^completion_only_loss=True .* standard_language_modeling; leave it unset"):
        prepare_sft_dataset(Dataset.from_list([lm, lm]), tok, completion_only_loss=True)
    # Tokenised rows: their completion_mask, unless completion_only_loss is False.
    rows = Dataset.from_list([{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}])
    for value, want in ((None, [0, 1, 1]), (True, [0, 1, 1]), (False, [1, 1, 1])):
        out = prepare_split("sft", rows, tok, "train", completion_only_loss=value)
        assert out[0]["completion_mask"] == want


def test_sft_assistant_only_loss(tok, no_template_tok):
    messages = user("Now is") + assistant("better than never.") + user("Although") + assistant("never.")
    out = tokenize_sft_row({"messages": messages}, tok, assistant_only_loss=True)
    scored = tok.decode([t for t, m in zip(out["input_ids"], out["completion_mask"]) if m])
    assert scored == "better than never.<|im_end|>never.<|im_end|>"
    assert all(tokenize_sft_row({"messages": messages}, tok)["completion_mask"])
    with pytest.raises(DataError, match="needs conversational data"):
        tokenize_sft_row({"text": "abc"}, tok, assistant_only_loss=True)
    no_markers = copy.deepcopy(tok)
    no_markers.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    ds = Dataset.from_list([{"messages": messages}])
    with pytest.raises(DataError, match="generation"):
        prepare_sft_dataset(ds, no_markers, assistant_only_loss=True)
    with pytest.raises(DataError, match="no chat template"):
        prepare_sft_dataset(ds, no_template_tok)
    with pytest.raises(DataError, match=r"row 0 \(from 0\), column 'messages': no assistant tokens"):
        prepare_sft_dataset(Dataset.from_list([{"messages": user("hi")}]), tok, assistant_only_loss=True)


def test_sft_truncation_count(tok):
    ds = load_dataset_any("builtin:zen", "standard_language_modeling")
    full, _ = prepare_sft_dataset(ds, tok)
    lengths = [len(x) for x in full["input_ids"]]
    out, stats = prepare_sft_dataset(ds, tok, max_length=20)
    assert stats.num_truncated == sum(n > 20 for n in lengths) > 0
    assert stats.num_rows == len(ds)  # truncated, never dropped
    assert max(len(x) for x in out["input_ids"]) == 20
    assert out[0]["input_ids"] == full[0]["input_ids"][:20]


# ----------------------------------------------------------------------------- collators


def test_dpo_collator_layout_and_labels():
    rows = [
        {"prompt_ids": [1, 2], "chosen_ids": [3, 4, 5], "rejected_ids": [6], "ref_chosen_logps": -1.5},
        {"prompt_ids": [7], "chosen_ids": [8], "rejected_ids": [9, 10, 11, 12], "ref_chosen_logps": -2.0},
    ]
    batch = DPOCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [
        [1, 2, 3, 4, 5], [7, 8, 0, 0, 0],     # chosen rows first
        [1, 2, 6, 0, 0], [7, 9, 10, 11, 12],  # then rejected
    ]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1] * 5]
    assert batch["completion_mask"].tolist() == [
        [0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert batch["ref_chosen_logps"].tolist() == [-1.5, -2.0]
    labels = position_labels(batch["input_ids"], batch["completion_mask"])
    assert labels.tolist() == [
        [-100, 3, 4, 5, -100], [8, -100, -100, -100, -100],
        [-100, 6, -100, -100, -100], [9, 10, 11, 12, -100]]
    assert DPOCollator(0, pad_to_multiple_of=8)(rows)["input_ids"].shape == (4, 8)


def test_position_labels_alignment_random():
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 50, (3, 9), generator=g)
    mask = torch.randint(0, 2, (3, 9), generator=g)
    labels = position_labels(input_ids, mask, ignore_index=-1)
    for b in range(3):
        for t in range(9):
            expected = input_ids[b, t + 1].item() if t + 1 < 9 and mask[b, t + 1] else -1
            assert labels[b, t].item() == expected


def test_kto_collators_rows_and_fixed_kl_partners():
    rows = [{"prompt_ids": [10 + i], "completion_ids": [20 + i] * (i + 1), "label": i % 2 == 0} for i in range(3)]
    batch = KTOCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [[10, 20, 0, 0], [11, 21, 21, 0], [12, 22, 22, 22]]
    assert batch["label"].dtype == torch.bool and batch["label"].tolist() == [True, False, True]
    assert "kl_input_ids" not in batch  # KL partners are fixed per row when the data is prepared
    # Row i's KL pair: prompt i with the completion of its fixed partner, whatever the batch.
    partners = [2, 0, 1]
    with_kl = [{**r, "kl_completion_ids": rows[p]["completion_ids"]} for r, p in zip(rows, partners)]
    batch = KLPairCollator(pad_token_id=0, row_keys=True)(with_kl)
    assert batch["kl_input_ids"].tolist() == [[10, 22, 22, 22], [11, 20, 0, 0], [12, 21, 21, 0]]
    assert batch["kl_completion_mask"].tolist() == [[0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]]
    assert batch["kl_attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
    alone = KLPairCollator(pad_token_id=0, row_keys=True)(with_kl[1:2])
    assert alone["kl_input_ids"].tolist() == [[11, 20]] and alone["row_key"].tolist() == batch["row_key"][1:2].tolist()
    assert len(set(batch["row_key"].tolist())) == 3


def test_sft_collator_padded_and_padding_free():
    rows = [{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}, {"input_ids": [4, 5], "completion_mask": [1, 1]}]
    padded = SFTCollator(pad_token_id=0)(rows)
    assert padded["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert padded["completion_mask"].tolist() == [[0, 1, 1], [1, 1, 0]]
    flat = SFTCollator(pad_token_id=0, padding_free=True)(rows)
    assert "attention_mask" not in flat
    assert flat["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    labels = position_labels(flat["input_ids"], flat["completion_mask"], position_ids=flat["position_ids"])
    assert labels.tolist() == [[2, 3, -100, 5, -100]]  # never 3 -> 4 across the boundary
    with pytest.raises(DataError, match="padding_free=True"):
        SFTCollator(pad_token_id=0)(pack_sequences(rows, 8))


# ------------------------------------------------------------------------------- packing


def test_pack_sequences_best_fit_decreasing():
    lengths = [5, 4, 3, 3, 2, 1]
    rows = [{"input_ids": [i + 1] * n, "completion_mask": [1] * n} for i, n in enumerate(lengths)]
    packed = pack_sequences(rows, max_length=8)
    assert [p["seq_lengths"] for p in packed] == [[5, 3], [4, 3, 1], [2]]
    assert all(len(p["input_ids"]) <= 8 for p in packed)
    assert sorted(t for p in packed for t in p["input_ids"]) == sorted(t for r in rows for t in r["input_ids"])
    assert packed[1]["position_ids"] == [0, 1, 2, 3, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="row 0: sequence of 5 tokens"):
        pack_sequences(rows, max_length=4)


def test_pack_dataset(tok):
    ds, _ = prepare_sft_dataset(load_dataset_any("builtin:zen", "standard_language_modeling"), tok)
    packed = pack_dataset(ds, 64)
    assert len(packed) < len(ds)
    assert sum(len(x) for x in packed["input_ids"]) == sum(len(x) for x in ds["input_ids"])
    assert max(len(x) for x in packed["input_ids"]) <= 64


def test_packed_batch_scores_like_separate_sequences(tok):
    """Padding-free rows + position_ids: no token attends or is labelled across a boundary."""
    model = load_model("builtin:tiny-qwen2").eval()
    ds, _ = prepare_sft_dataset(load_dataset_any("builtin:zen", "standard_prompt_completion").select(range(5)), tok)
    rows = ds.to_list()
    flat = SFTCollator(tok.pad_token_id, padding_free=True)(pack_sequences(rows, 64))

    def token_logps(batch, position_ids=None):
        labels = position_labels(batch["input_ids"], batch["completion_mask"], position_ids=position_ids)
        kwargs = {"position_ids": position_ids} if position_ids is not None else {"attention_mask": batch["attention_mask"]}
        logits = model(input_ids=batch["input_ids"], use_cache=False, **kwargs).logits
        lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return lp[labels != -100]

    with torch.no_grad():
        packed = token_logps(flat, flat["position_ids"])
        alone = torch.cat([token_logps(SFTCollator(tok.pad_token_id)([r])) for r in
                           [rows[i] for i in sorted(range(5), key=lambda i: (-len(rows[i]["input_ids"]), i))]])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
