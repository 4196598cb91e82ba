"""The checks a run's input gets in one process before any weights load (`fusedalign.cli.precheck`):
under `fusedalign launch` before any process starts, under a training command before the student
loads. Each mistake is one line naming the flag, exit 2."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from fusedalign.cli import main
from fusedalign.models import MODELS_DIR, load_tokenizer

CPU_DDP = "configs/accelerate/cpu/ddp.yaml"
PROMPTS = ["--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", "builtin:zen",
           "--dataset_config", "standard_prompt_only"]


@pytest.fixture
def started(monkeypatch):
    """The `accelerate launch` commands `fusedalign launch` started (none, when the pre-check refuses)."""
    commands = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: commands.append(a) or pytest.fail("launched"))
    return commands


@pytest.fixture
def no_weights(monkeypatch):
    """Fails a test in which any model's weights are loaded."""
    import fusedalign.models

    monkeypatch.setattr(fusedalign.models, "load_model", lambda *a, **k: pytest.fail("weights loaded"))


def _one_line(capsys, *expected: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and all(e in err for e in expected), err
    return err


def _other_tokenizer_teacher(tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(MODELS_DIR / "tiny-zen-teacher", teacher)
    tokenizer = load_tokenizer("builtin:tokenizer")
    tokenizer.add_tokens(["<|tool|>"])
    tokenizer.save_pretrained(str(teacher))
    return teacher


@pytest.mark.parametrize("command,flags,expected", [
    ("distillation", [*PROMPTS, "--teacher_model_name_or_path", "{tmp}/noteacher"],
     ["--teacher_model_name_or_path: model path", "noteacher' does not exist"]),
    ("distillation", PROMPTS, ["distillation needs a teacher: --teacher_model_name_or_path"]),
    ("dpo", ["--ref_model_name_or_path", "{tmp}/noref"], ["--ref_model_name_or_path: model path", "noref"]),
    ("rloo", ["--reward_funcs", "nosuch.fn"], ["--reward_funcs 'nosuch.fn': cannot import module 'nosuch'"]),
    ("grpo", ["--reward_funcs", "zen_words", "fusedalign.nosuch_reward"],
     ["--reward_funcs 'fusedalign.nosuch_reward': module 'fusedalign' has no callable 'nosuch_reward'"]),
    ("grpo", ["--reward_funcs", "{tmp}/no/rm"], ["--reward_funcs: model path", "/no/rm' does not exist"]),
    ("grpo", ["--reward_model_name_or_path", "{tmp}/norm"], ["--reward_model_name_or_path: model path", "norm"]),
])
def test_launch_refuses_a_bad_model_or_reward_before_any_process_starts(command, flags, expected, tmp_path,
                                                                         started, capsys):
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    out = tmp_path / "run"
    assert main(["launch", "--config_file", CPU_DDP, command, *flags, "--output_dir", str(out)]) == 2
    _one_line(capsys, f"fusedalign launch: error: {expected[0]}", *expected[1:])
    assert started == [] and not out.exists()


def test_launch_refuses_a_teacher_with_another_tokenizer(tmp_path, started, capsys):
    """Compared from the tokenizers and config.json alone: no weights loaded, no process started."""
    teacher = _other_tokenizer_teacher(tmp_path)
    assert main(["launch", "--config_file", CPU_DDP, "distillation", *PROMPTS, "--teacher_model_name_or_path",
                 str(teacher), "--output_dir", str(tmp_path / "run")]) == 2
    _one_line(capsys, "uses another tokenizer than the student", "must share one tokenizer")
    assert started == []


def test_launch_refuses_a_gpu_config_without_a_gpu_and_names_the_fusedalign_launch_line(monkeypatch, tmp_path,
                                                                                         started, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["launch", "--config_file", "configs/accelerate/ddp.yaml", "--num_processes", "2",
                 "--mixed_precision=bf16", "rloo", "--max_steps", "2", "--output_dir", str(tmp_path / "run")]) == 2
    err = _one_line(capsys, "configs/accelerate/ddp.yaml is a GPU config", "this machine has no CUDA GPU",
                    "use configs/accelerate/cpu/ddp.yaml: fusedalign launch --config_file "
                    "configs/accelerate/cpu/ddp.yaml --num_processes 2 rloo ...")
    assert "accelerate launch" not in err and "bf16 rloo" not in err and started == []


def test_launch_refuses_a_gpu_config_of_its_own_and_a_missing_config(monkeypatch, tmp_path, started, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mine = tmp_path / "mine.yaml"
    mine.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: bf16\n")
    assert main(["launch", "--config_file", str(mine), "sft", "--output_dir", str(tmp_path / "run")]) == 2
    _one_line(capsys, "is a GPU config (use_cpu: false)", "use a config with use_cpu: true")
    assert main(["launch", "--config_file", str(tmp_path / "none.yaml"), "sft"]) == 2
    _one_line(capsys, "--config_file", "none.yaml: no such file.")
    assert started == []


def test_a_gpu_config_passes_on_a_machine_with_a_gpu(monkeypatch):
    from fusedalign.cli.precheck import check_launch_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_launch_config(["--config_file", "configs/accelerate/ddp.yaml"], "dpo")
    check_launch_config(["--config_file", "configs/accelerate/ddp.yaml"], "dpo", cuda_available=True)
    check_launch_config([], "dpo", cuda_available=False)  # accelerate's default config: its own to check


@pytest.mark.parametrize("command,flags,expected", [
    ("distillation", [*PROMPTS, "--teacher_model_name_or_path", "{tmp}/noteacher"], "noteacher' does not exist"),
    ("rloo", [*PROMPTS, "--reward_funcs", "nosuch.fn"], "cannot import module 'nosuch'"),
    ("dpo", [*PROMPTS[:-1], "standard_preference", "--ref_model_name_or_path", "{tmp}/noref"],
     "noref' does not exist"),
])
def test_the_training_command_checks_them_before_the_student_loads(command, flags, expected, tmp_path, no_weights,
                                                                   capsys):
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    assert main([command, *flags, "--max_steps", "1", "--output_dir", str(tmp_path / "run")]) == 2
    _one_line(capsys, f"fusedalign {command}: error:", expected)


def test_the_training_command_checks_the_teachers_tokenizer_before_the_student_loads(tmp_path, no_weights, capsys):
    teacher = _other_tokenizer_teacher(tmp_path)
    assert main(["distillation", *PROMPTS, "--teacher_model_name_or_path", str(teacher), "--max_steps", "1",
                 "--output_dir", str(tmp_path / "run")]) == 2
    _one_line(capsys, "uses another tokenizer than the student")
