"""SFT's `dataset_text_field` (TRL's): the text read from another column trains exactly as the same
text in `text`; a `text` column beside it is not read; a missing column is one line naming the flag."""

from __future__ import annotations

import json

import pytest
import torch

from fusedalign.cli import main
from fusedalign.data import DataError
from fusedalign.data.text_field import with_text_field
from tests.unit.test_sft_trainer import _assert_same_run, _data, _train


def _moved(column: str):
    """The builtin language-modeling rows with their text in `column` and decoy text in `text`."""
    data = _data(rows=16)
    return data.rename_column("text", column).add_column("text", ["Never read this."] * len(data))


def test_text_read_from_another_column_trains_as_the_same_text_in_text(tmp_path):
    want = _train(tmp_path / "a", data=_data(rows=16))
    got = _train(tmp_path / "b", data=_moved("body"), dataset_text_field="body")
    _assert_same_run(want, got, rtol=0)
    decoy = _train(tmp_path / "c", data=_moved("body"))  # the default reads the decoy column
    assert decoy[0] != want[0]


def test_a_missing_column_names_the_flag_and_the_columns():
    with pytest.raises(DataError, match=r"--dataset_text_field body: the dataset has no column 'body' \(its columns: text\)"):
        with_text_field(_data(rows=2), "body")


def test_conversational_data_has_no_text_column_to_read():
    data = _data("conversational_language_modeling", rows=2)
    assert with_text_field(data, "body") is data


def test_the_command_line_reads_the_named_column_and_refuses_a_missing_one(tmp_path, capsys):
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"body": t}) + "\n" for t in _data(rows=8)["text"]))
    flags = ["sft", "--dataset_name", str(path), "--eval_strategy", "no", "--max_steps", "2",
             "--per_device_train_batch_size", "4"]
    assert main([*flags, "--dataset_text_field", "body", "--output_dir", str(tmp_path / "ok")]) == 0
    assert (tmp_path / "ok" / "model.safetensors").exists()
    capsys.readouterr()
    assert main([*flags, "--output_dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "notes.jsonl" in lines[0] and "text" in lines[0], lines[0]
    assert main([*flags, "--dataset_text_field", "content", "--output_dir", str(tmp_path / "bad2")]) == 2
    line = [line for line in capsys.readouterr().err.splitlines() if "error:" in line][0]
    assert "--dataset_text_field content" in line and "body" in line, line
