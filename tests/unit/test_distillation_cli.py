"""`fusedalign distillation`: the embedded demo, and bad input refused in one line (exit 2, nothing written)."""

from __future__ import annotations

import json
import shutil

import pytest

from fusedalign.cli import main
from fusedalign.models import MODELS_DIR, load_tokenizer

STUDENT = ["--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", "builtin:zen", "--max_steps", "1",
           "--per_device_train_batch_size", "2", "--max_completion_length", "4"]


def _records(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_distillation_demo_distils_the_zen_teacher(tmp_path, capsys):
    """No flags: builtin:tiny-zen-teacher into builtin:tiny-qwen2; the divergence of the last 10 steps
    is under a fifth of the first 10's, the student's entropy falls by half, and the curves are drawn."""
    out = tmp_path / "distillation"
    assert main(["distillation", "--output_dir", str(out)]) == 0
    records = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 101))
    losses, entropies = [r["loss"] for r in records], [r["entropy"] for r in records]
    assert sum(losses[-10:]) < sum(losses[:10]) / 5, losses
    assert sum(entropies[-10:]) < sum(entropies[:10]) / 2, entropies
    assert {"completions/mean_length", "completions/clipped_ratio", "num_tokens"} <= records[0].keys()
    assert (out / "training_curves.png").is_file() and (out / "model.safetensors").is_file()
    err = capsys.readouterr().err
    assert "training builtin:tiny-qwen2 on builtin:zen/standard_prompt_only" in err and "tiny-zen-teacher" in err


def _refused(argv, capsys, *expected):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(e in err for e in expected), err
    return err


def test_refuses_a_missing_teacher(tmp_path, capsys):
    out = tmp_path / "r"
    _refused(["distillation", *STUDENT, "--dataset_config", "standard_prompt_only", "--output_dir", str(out)],
             capsys, "distillation needs a teacher: --teacher_model_name_or_path")
    assert not out.exists()


def test_refuses_a_teacher_path_that_does_not_exist(tmp_path, capsys):
    _refused(["distillation", *STUDENT, "--dataset_config", "standard_prompt_only", "--teacher_model_name_or_path",
              str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "r")], capsys, "nowhere", "does not exist")


def test_refuses_a_teacher_with_another_tokenizer(tmp_path, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(MODELS_DIR / "tiny-zen-teacher", teacher)
    tokenizer = load_tokenizer("builtin:tokenizer")
    tokenizer.add_tokens(["<|tool|>"])
    tokenizer.save_pretrained(str(teacher))
    _refused(["distillation", *STUDENT, "--dataset_config", "standard_prompt_only", "--teacher_model_name_or_path",
              str(teacher), "--output_dir", str(tmp_path / "r")], capsys,
             "uses another tokenizer than the student", "must share one tokenizer")


def test_refuses_a_dataset_without_prompts(tmp_path, capsys):
    _refused(["distillation", *STUDENT, "--dataset_config", "standard_language_modeling",
              "--teacher_model_name_or_path", "builtin:tiny-zen-teacher", "--output_dir", str(tmp_path / "r")],
             capsys, "builtin:zen (train split): missing column(s) ['prompt']")


def test_refuses_a_grpo_flag_and_a_beta_out_of_range(tmp_path, capsys):
    _refused(["distillation", "--num_generations", "4", "--output_dir", str(tmp_path / "r")], capsys,
             "--num_generations is an option of GRPO; distillation has none")
    _refused(["distillation", "--beta", "2", "--output_dir", str(tmp_path / "r")], capsys, "beta must be in [0, 1]")
    _refused(["distillation", "--padding_free", "true", "--share_prompt", "true", "--output_dir",
              str(tmp_path / "r")], capsys, "--share_prompt: distillation samples one completion per prompt")


def test_trains_on_packed_rows_from_the_command_line(tmp_path):
    out = tmp_path / "packed"
    assert main(["distillation", *STUDENT, "--dataset_config", "standard_prompt_only", "--teacher_model_name_or_path",
                 "builtin:tiny-zen-teacher", "--padding_free", "true", "--max_tokens_per_batch", "1024",
                 "--max_prompt_length", "64", "--output_dir", str(out)]) == 0
    records = [r for r in _records(out) if "loss" in r]
    assert len(records) == 1 and records[0]["loss"] > 0
