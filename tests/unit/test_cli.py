"""The command line: the demo job, flags, --config, help, output directories, resume, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusedalign.cli import main, parse
from fusedalign.cli.arguments import RunArguments
from fusedalign.configs import DPOConfig, ModelArguments, ScriptArguments

ROOT = Path(__file__).resolve().parents[2]
DPO_TYPES = (ScriptArguments, DPOConfig, ModelArguments, RunArguments)
SHORT = ["--max_steps", "2", "--eval_strategy", "no"]


def _records(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _steps(out_dir):
    return [r["step"] for r in _records(out_dir) if "loss" in r]


def _prefs(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PREFS = [{"prompt": f"p{i}", "chosen": " good.", "rejected": " bad."} for i in range(8)]


def _env(tmp_path, **extra):
    return {**os.environ, "FUSEDALIGN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", **extra}


# ---------------------------------------------------------------------------- the demo


def test_dpo_demo_learns_and_writes_everything(tmp_path, capsys):
    out = tmp_path / "dpo"
    assert main(["dpo", "--output_dir", str(out)]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl", "training_curves.png"):
        assert (out / name).is_file(), name
    records = _records(out)
    train = [r for r in records if "rewards/accuracies" in r]
    evals = [r for r in records if "eval_rewards/accuracies" in r]
    assert len(evals) == 3  # one evaluation per epoch
    # The preference signal is learned: held-out accuracy ends high and margins grow.
    assert evals[-1]["eval_rewards/accuracies"] >= 0.8
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"] > 0
    assert train[-1]["rewards/margins"] > train[0]["rewards/margins"]
    assert "no --model_name_or_path: training builtin:tiny-qwen2 on builtin:zen/standard_preference" in capsys.readouterr().err


@pytest.mark.slow
def test_grpo_demo_learns_the_builtin_reward_and_writes_everything(tmp_path, capsys):
    """`fusedalign grpo` with no flags: zen_words on the embedded prompts, 30 generations each
    trained on twice (60 steps) with a KL penalty; the mean reward of the last 5 generations is at
    least twice that of the first 5; the KL and the clip ratios are real (non-zero), and the
    curves have panels for reward, KL, entropy, completion length and clip ratios."""
    from fusedalign.plot import panel_titles

    out = tmp_path / "grpo"
    assert main(["grpo", "--output_dir", str(out)]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json", "metrics.jsonl", "training_curves.png"):
        assert (out / name).is_file(), name
    records = [r for r in _records(out) if "loss" in r]  # the per-step records, not the final summary
    assert [r["step"] for r in records] == list(range(1, 61))
    rewards = [r["reward"] for r in records if "reward" in r]  # logged on the steps that generate
    assert len(rewards) == 30
    assert sum(rewards[-5:]) / 5 >= 2 * sum(rewards[:5]) / 5, rewards
    # beta > 0: a reference model, the KL to it grows from 0 as the policy moves.
    kls = [r["kl"] for r in records]
    assert kls[0] == 0 and kls[-1] > 0.01 and all(k >= 0 for k in kls), kls
    # num_iterations=2: the second update of each generation is off-policy, and some tokens are clipped.
    clipped = [r["clip_ratio/region_mean"] for r in records]
    assert max(clipped[1::2]) > 0 and not any(clipped[0::2]), clipped
    titles = panel_titles(str(out))
    for title in ("reward", "kl", "entropy", "completions/mean_length", "clip_ratio"):
        assert title in titles, titles
    assert "training builtin:tiny-qwen2 on builtin:zen/standard_prompt_only" in capsys.readouterr().err


@pytest.mark.slow
def test_rloo_demo_learns_the_builtin_reward(tmp_path, capsys):
    """`fusedalign rloo` with no flags: GRPO's demo run with RLOO's advantage, KL and loss; the mean
    reward of the last 5 generations is at least twice that of the first 5; the KL in the reward
    starts at 0 and moves; the off-policy second update of each generation clips some sequences."""
    out = tmp_path / "rloo"
    assert main(["rloo", "--output_dir", str(out)]) == 0
    records = [r for r in _records(out) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 61))
    rewards = [r["reward"] for r in records if "reward" in r]
    assert len(rewards) == 30 and sum(rewards[-5:]) / 5 >= 2 * sum(rewards[:5]) / 5, rewards
    kls = [r["kl"] for r in records if "kl" in r]
    assert kls[0] == 0 and any(k != 0 for k in kls), kls
    clipped = [r["clip_ratio/region_mean"] for r in records]
    assert max(clipped[1::2]) > 0 and not any(clipped[0::2]), clipped
    assert "training builtin:tiny-qwen2 on builtin:zen/standard_prompt_only" in capsys.readouterr().err


def test_rloo_refuses_a_grpo_loss_flag_in_one_line(tmp_path, capsys):
    assert main(["rloo", "--loss_type", "grpo", "--output_dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--loss_type is an option of GRPO's loss; RLOO has none" in err and "Traceback" not in err


def test_config_file_sets_defaults_and_flags_override(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 2\nbeta: 0.3\nloss_type: [sigmoid, sft]\nloss_weights: [1.0, 0.5]\nsave_strategy: 'no'\n")
    out = tmp_path / "cfg"
    assert main(["dpo", "--config", str(config), "--output_dir", str(out), "--beta", "0.2", "--eval_strategy", "no"]) == 0
    args = __import__("torch").load(out / "training_args.bin", weights_only=False)
    assert args.beta == 0.2 and args.max_steps == 2 and args.loss_type == ["sigmoid", "sft"]


def test_a_bad_value_from_the_config_file_is_named_as_its_key(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 2\nbeta: abc\n")
    assert main(["dpo", "--config", str(config), "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "fusedalign dpo: error: --config key beta: invalid float value: 'abc'.", err
    # The same value on the command line is the flag's.
    assert main(["dpo", "--beta", "abc", "--output_dir", str(tmp_path / "o")]) == 2
    assert "error: argument --beta: invalid float value: 'abc'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_use_liger_kernel_is_an_alias_of_fused_head(tmp_path):
    _, args, _, _ = parse("dpo", DPO_TYPES, ["--output_dir", str(tmp_path), "--fused_head", "false", "--use_liger_kernel"])
    assert args.fused_head is True and args.use_liger_kernel is False


# ------------------------------------------------------------- demo defaults (issue 19, item 3)


def test_demo_defaults_fill_in_only_what_is_not_given(tmp_path, capsys):
    data = _prefs(tmp_path / "mine.jsonl", PREFS)
    script, args, model, _ = parse("dpo", DPO_TYPES, ["--dataset_name", str(data), "--output_dir", str(tmp_path / "o")])
    assert model.model_name_or_path == "builtin:tiny-qwen2"  # the one thing left out
    assert (script.dataset_name, script.dataset_config) == (str(data), None)
    # A user's file has no test split: no evaluation; and each step of a short run logs its loss.
    assert args.eval_strategy == "no" and args.logging_steps == 1
    err = capsys.readouterr().err
    assert f"training builtin:tiny-qwen2 on {data}" in err and "builtin:zen" not in err


def test_save_steps_alone_means_saving(tmp_path):
    _, args, _, _ = parse("dpo", DPO_TYPES, ["--save_steps", "2", "--output_dir", str(tmp_path)])
    assert args.save_strategy == "steps" and args.save_steps == 2
    _, demo, _, _ = parse("dpo", DPO_TYPES, ["--output_dir", str(tmp_path)])
    assert demo.save_strategy == "no"


def test_a_users_flag_always_wins(tmp_path):
    flags = ["--learning_rate", "0.01", "--num_train_epochs", "1", "--eval_strategy", "no", "--beta", "0.5",
             "--dataset_config", "conversational_preference", "--output_dir", str(tmp_path)]
    script, args, _, _ = parse("dpo", DPO_TYPES, flags)
    assert (args.learning_rate, args.num_train_epochs, args.eval_strategy, args.beta) == (0.01, 1, "no", 0.5)
    assert (script.dataset_name, script.dataset_config) == ("builtin:zen", "conversational_preference")


def test_short_demo_run_logs_its_training_loss(tmp_path):
    out = tmp_path / "short"
    assert main(["dpo", "--max_steps", "3", "--eval_strategy", "no", "--output_dir", str(out)]) == 0
    assert _steps(out) == [1, 2, 3]


def test_evaluation_on_a_single_file_is_refused(tmp_path, capsys):
    data = _prefs(tmp_path / "mine.jsonl", PREFS)
    assert main(["dpo", "--dataset_name", str(data), "--eval_strategy", "epoch", "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "single file" in err and "--eval_strategy no" in err


def test_model_name_keeps_trls_learning_rate(tmp_path):
    _, args, _, _ = parse("dpo", DPO_TYPES, ["--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name",
                                             "builtin:zen", "--output_dir", str(tmp_path)])
    assert args.learning_rate == 1e-6 and args.eval_strategy == "no"


# ------------------------------------------------------------------ help (items 1, 9, 15)


TRAINING = ["dpo", "kto", "sft", "grpo", "rloo", "distillation"]


def test_the_tests_cover_every_command():
    from fusedalign.cli import COMMANDS

    assert set(COMMANDS) == {*TRAINING, *TOOLS}


@pytest.mark.parametrize("command", TRAINING)
def test_every_command_help_works(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FUSEDALIGN_CACHE", str(tmp_path))
    assert main([command, "--help"]) == 0
    short = capsys.readouterr().out
    assert main([command, "--help-all"]) == 0
    full = capsys.readouterr().out
    assert f"fusedalign {command} flags" in short and "--help-all" in short
    # The command's own flags come first, then the common TrainingArguments ones; the rest behind --help-all.
    flags = short[short.index(f"fusedalign {command} flags"):]  # after the description (it lists the demo's values)
    assert flags.index("--fused_head") < flags.index("--num_train_epochs")
    assert "--adam_beta1" not in short and "--adam_beta1" in full
    assert "[fusedalign] no --model_name_or_path" not in short  # no demo banner for --help (the description may name the flag)
    if command == "sft":
        assert "{% generation %}" in short  # the help string that made argparse crash


TOOLS = {"plot": "OUTPUT_DIR", "merge": "ADAPTER_DIR OUTPUT_DIR", "consolidate": "CHECKPOINT_DIR", "verify": "TRAINER",
         "launch": "[accelerate launch options]"}


@pytest.mark.parametrize("command", sorted(TOOLS))
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_every_tool_help_prints_its_usage(command, flag, capsys):
    assert main([command, flag]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"usage: fusedalign {command} {TOOLS[command]}") and not captured.err


@pytest.mark.parametrize("command", TRAINING)
def test_parser_help_strings_survive_argparse_formatting(command):
    from fusedalign.cli.help import dataclass_types
    from fusedalign.cli.parsing import build_parser

    text = build_parser(command, dataclass_types(command)).format_help()  # argparse's own rendering, every flag
    assert "--output_dir" in text and ("{% generation %}" in text) == (command == "sft")


def test_cached_help_imports_no_torch(tmp_path):
    env = _env(tmp_path)
    subprocess.run([sys.executable, "-m", "fusedalign", "dpo", "--help"], env=env, check=True, capture_output=True)
    probe = "import sys; from fusedalign.cli import main; main(['dpo', '--help']); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.strip().endswith("False") and "fusedalign dpo flags" in proc.stdout


def test_help_cache_follows_the_sources_content_not_their_mtimes(tmp_path, monkeypatch):
    import types

    from fusedalign.cli import help as cli_help

    package = tmp_path / "package"
    package.mkdir()
    source = package / "config.py"
    source.write_text("beta = 0.1\n")
    module = types.ModuleType("shapes_the_parser")
    module.__file__ = str(source)
    monkeypatch.setitem(sys.modules, "shapes_the_parser", module)
    monkeypatch.setattr(cli_help, "PACKAGE", package)
    monkeypatch.setenv("FUSEDALIGN_CACHE", str(tmp_path / "cache"))
    renders = []
    monkeypatch.setattr(cli_help, "render_help", lambda command, full: renders.append(command) or f"help {len(renders)}")

    assert cli_help.help_text("dpo") == "help 1"
    assert cli_help.help_text("dpo") == "help 1"
    os.utime(source, (1, 1))  # a checkout or a pull: new mtimes, same content
    source.write_text(source.read_text())
    assert cli_help.help_text("dpo") == "help 1" and len(renders) == 1
    source.write_text("beta = 0.2\n")
    assert cli_help.help_text("dpo") == "help 2"
    assert cli_help.help_text("dpo") == "help 2"
    real_version = cli_help.importlib.metadata.version
    monkeypatch.setattr(cli_help.importlib.metadata, "version",
                        lambda dist: "99.0" if dist == "transformers" else real_version(dist))
    assert cli_help.help_text("dpo") == "help 3"  # TrainingArguments' flags depend on the transformers version
    assert cli_help.help_text("kto") == "help 4" and renders == ["dpo", "dpo", "dpo", "kto"]


def test_loss_type_help_and_error_name_the_same_values(tmp_path, monkeypatch, capsys):
    from fusedalign.losses import DPO_LOSSES

    monkeypatch.setenv("FUSEDALIGN_CACHE", str(tmp_path))
    assert main(["dpo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    listed = text.split("One or more of: ", 1)[1].split(".", 1)[0].replace(" ", "").split(",")
    assert main(["dpo", "--loss_type", "nope", "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    valid = json.loads(err.split("valid: ", 1)[1].split("]", 1)[0].replace("'", '"') + "]")
    assert set(listed) == set(valid) == set(DPO_LOSSES)


@pytest.mark.parametrize("command", TRAINING)
def test_unknown_flag_suggests_the_closest(command, tmp_path, capsys):
    assert main([command, "--lora_rr", "4", "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"unknown flag --lora_rr for `fusedalign {command}`" in err
    assert "did you mean --lora_r" in err and "--lora-r" not in err
    assert main([command, "--bta", "1", "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert ("did you mean --beta" in err) if command != "sft" else f"`fusedalign sft --help-all` lists every flag" in err


def test_unknown_command_suggests_the_closest(capsys):
    assert main(["frobnicate"]) == 2 and main(["dpp"]) == 2
    assert "did you mean 'dpo'" in capsys.readouterr().err


def test_a_bad_value_is_one_line_without_usage(tmp_path, capsys):
    assert main(["dpo", "--beta", "abc", "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "usage:" not in err and "--beta" in err and "'abc'" in err


def test_help_and_unknown_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "fusedalign <command>" in out and "configs/accelerate/cpu/zero3.yaml" in out
    assert main(["frobnicate"]) == 2


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--beta", "0"], "beta must be > 0"),
        (["--loss_type", "nope"], "Unknown DPO loss_type ['nope']"),
        (["--dataset_config", "standard_nothing"], "standard_preference"),
        (["--dataset_config", "standard_unpaired_preference"], "completion"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, flags, expected):
    assert main(["dpo", "--output_dir", str(tmp_path / "new"), *flags]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and expected in err and "Traceback" not in err, err


@pytest.mark.parametrize("model,expected", [("builtin:tiny-nothing", "tiny-qwen2"), ("/no/such/model", "/no/such/model")])
def test_bad_model_keeps_the_old_run_in_place(tmp_path, capsys, model, expected):
    out = tmp_path / "keep"
    out.mkdir()
    (out / "precious.txt").write_text("do not delete")
    flags = ["--model_name_or_path", model, "--dataset_name", "builtin:zen", "--dataset_config", "standard_preference"]
    assert main(["dpo", "--output_dir", str(out), "--overwrite_output_dir", *flags]) == 2
    assert expected in capsys.readouterr().err
    assert (out / "precious.txt").read_text() == "do not delete"  # moved aside only once training starts


def test_bad_rows_in_a_local_file_name_the_file_line_row_and_column(tmp_path, capsys):
    data = _prefs(tmp_path / "prefs.jsonl", [PREFS[0], {"prompt": "d", "chosen": "", "rejected": "f"}])
    code = main(["dpo", "--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", str(data),
                 "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and f"{data}, line 2: row 1 (from 0), column 'chosen': empty chosen" in err, err


@pytest.mark.parametrize(
    "content,expected",
    [
        ("", "is empty"),
        ("\n\n", "holds no rows"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b" "rejected": "c"}\n',
         "line 2, column 31: not valid JSON (Expecting ',' delimiter)"),
    ],
)
def test_unreadable_files_are_one_line_naming_the_line(tmp_path, capsys, content, expected):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    assert main(["dpo", "--dataset_name", str(data), "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and expected in errors[0] and str(data) in errors[0] and "Traceback" not in err, err


def test_bad_roles_are_named_in_prompt_and_chosen(tmp_path, capsys):
    def row(prompt_role, chosen_role):
        return {"prompt": [{"role": prompt_role, "content": "Beautiful is"}],
                "chosen": [{"role": chosen_role, "content": "better."}],
                "rejected": [{"role": "assistant", "content": "worse."}]}

    for rows, expected in (([row("user", "assistant"), row("usr", "assistant")], "line 2: row 1 (from 0), column 'prompt', message 0 (from 0): role 'usr'"),
                           ([row("user", "user")], "line 1: row 0 (from 0), column 'chosen', message 0 (from 0): role 'user'; expected 'assistant'")):
        data = _prefs(tmp_path / "conv.jsonl", rows)
        assert main(["dpo", "--dataset_name", str(data), "--output_dir", str(tmp_path / "o")]) == 2
        assert expected in capsys.readouterr().err


# ------------------------------------------------------------ output directories (item 2)


def test_a_non_empty_output_dir_is_refused_and_left_alone(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["dpo", *SHORT, "--save_steps", "1", "--output_dir", str(out)]) == 0
    before = sorted(os.listdir(out))
    capsys.readouterr()
    assert main(["dpo", *SHORT, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run with 2 checkpoint(s)" in err
    assert "--resume_from_checkpoint last" in err and "--overwrite_output_dir" in err
    assert sorted(os.listdir(out)) == before


def test_overwrite_moves_the_old_run_aside(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["dpo", *SHORT, "--output_dir", str(out)]) == 0
    old = (out / "metrics.jsonl").read_text()
    assert main(["dpo", *SHORT, "--max_steps", "1", "--output_dir", str(out), "--overwrite_output_dir"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.previous-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == old
    assert (aside[0] / "model.safetensors").is_file()
    assert _steps(out) == [1]  # the new run's log alone
    assert f"moved to {aside[0]}" in capsys.readouterr().err


def test_resume_continues_the_log_without_duplicates(tmp_path):
    out = tmp_path / "run"
    assert main(["dpo", "--max_steps", "3", "--save_steps", "2", "--eval_strategy", "no", "--output_dir", str(out)]) == 0
    assert _steps(out) == [1, 2, 3] and (out / "checkpoint-2").is_dir() and (out / "checkpoint-3").is_dir()
    # From the step-2 checkpoint: step 3 is trained and logged again, once.
    assert main(["dpo", "--max_steps", "4", "--save_steps", "2", "--eval_strategy", "no", "--output_dir", str(out),
                 "--resume_from_checkpoint", str(out / "checkpoint-2")]) == 0
    assert _steps(out) == [1, 2, 3, 4]
    assert main(["dpo", "--max_steps", "5", "--save_steps", "2", "--eval_strategy", "no", "--output_dir", str(out),
                 "--resume_from_checkpoint", "last"]) == 0
    assert _steps(out) == [1, 2, 3, 4, 5]
    assert all((out / f"checkpoint-{n}" / "trainer_state.json").is_file() for n in (2, 4, 5))
    # checkpoint-3 of the first run was moved aside by the resume from checkpoint-2; resuming from the last one moves nothing.
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.previous-")]
    assert len(aside) == 1 and sorted(os.listdir(aside[0] / "checkpoint-3")) == sorted(os.listdir(out / "checkpoint-5"))
    assert not (out / "checkpoint-3").exists()


def test_resuming_from_an_earlier_checkpoint_moves_what_lies_past_it_aside(tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--max_steps", "4", "--save_steps", "2", "--eval_strategy", "no", "--output_dir", str(out)]
    assert main(["sft", *flags]) == 0
    first = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "model.safetensors", "training_args.bin")}
    checkpoint_4 = (out / "checkpoint-4" / "model.safetensors").read_bytes()
    checkpoint_2 = {p.name: p.read_bytes() for p in (out / "checkpoint-2").iterdir()}
    capsys.readouterr()
    assert main(["sft", *flags, "--resume_from_checkpoint", str(out / "checkpoint-2")]) == 0
    err = capsys.readouterr().err
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.previous-")]
    # Nothing the first run wrote is lost: its later checkpoint, final files and whole log are aside.
    assert (aside / "checkpoint-4" / "model.safetensors").read_bytes() == checkpoint_4
    assert {name: (aside / name).read_bytes() for name in first} == first
    assert not (aside / "checkpoint-2").exists()
    assert {p.name: p.read_bytes() for p in (out / "checkpoint-2").iterdir()} == checkpoint_2
    # The resumed run is one run: its own steps 3 and 4, each logged once, and its own checkpoint-4.
    assert _steps(out) == [1, 2, 3, 4] and (out / "checkpoint-4" / "trainer_state.json").is_file()
    (line,) = [line for line in err.splitlines() if "moved" in line]
    assert line.startswith(f"[fusedalign] resuming from step 2: what {out} held past it was moved to {aside} "
                           "(nothing deleted): checkpoint-4, ")
    assert "metrics.jsonl records" in line and "other files of the run" in line


def test_resuming_moves_aside_only_what_lies_past_the_checkpoint(tmp_path):
    from fusedalign.cli.output_dir import move_past_checkpoint

    out = tmp_path / "run"
    for name, step in (("checkpoint-2", 2), ("best", 2)):
        (out / name).mkdir(parents=True)
        (out / name / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (out / "metrics.previous-1.jsonl").write_text("{}\n")
    log = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2)) + '{"step": 2, "eval_loss": 1.0}\n'
    (out / "metrics.jsonl").write_text(log)
    assert move_past_checkpoint(str(out), str(out / "checkpoint-2")) is None  # the latest state: nothing abandoned
    assert not list(tmp_path.glob("run.previous-*"))
    # Interrupted after step 3, before its checkpoint: record 3 is kept aside, with the whole log.
    (out / "metrics.jsonl").write_text(log + '{"step": 3, "loss": 0.5}\n{"step": 3, "lo')
    report = move_past_checkpoint(str(out), str(out / "best"))
    (aside,) = tmp_path.glob("run.previous-*")
    assert "(nothing deleted): 1 metrics.jsonl record;" in report and os.listdir(aside) == ["metrics.jsonl"]
    assert (aside / "metrics.jsonl").read_text().startswith(log + '{"step": 3')
    assert (out / "metrics.jsonl").read_text() == log
    assert sorted(os.listdir(out)) == ["best", "checkpoint-2", "metrics.jsonl", "metrics.previous-1.jsonl"]


def test_resume_last_without_a_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["dpo", *SHORT, "--resume_from_checkpoint", "last", "--output_dir", str(tmp_path / "none")]) == 2
    assert "holds no complete checkpoint-N" in capsys.readouterr().err


def test_metrics_log_of_an_earlier_run_is_moved_aside_by_the_trainer(tmp_path):
    from types import SimpleNamespace

    from fusedalign.trainers.callbacks import MetricsJSONLCallback

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    state = SimpleNamespace(is_world_process_zero=True, global_step=0, epoch=0.0)
    args = SimpleNamespace(output_dir=str(tmp_path))
    callback = MetricsJSONLCallback()
    callback.on_train_begin(args, state, None)
    callback.on_log(args, SimpleNamespace(**{**vars(state), "global_step": 1}), None, logs={"loss": 0.5})
    assert (tmp_path / "metrics.previous-1.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0.5]


# -------------------------------------------------------------------- SIGINT (item 10)


def test_sigint_reports_the_last_checkpoint_and_keeps_every_one(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fusedalign", "dpo", "--max_steps", "400", "--save_steps", "2",
           "--eval_strategy", "no", "--output_dir", str(out)]
    proc = subprocess.Popen(cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (out / "checkpoint-4" / "trainer_state.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = max((p for p in out.glob("checkpoint-*")), key=lambda p: int(p.name.split("-")[1]))
    assert f"the last one is {last}" in err
    resume = next(line for line in err.splitlines() if "resume with:" in line)
    assert resume.split("resume with: ", 1)[1] == (f"fusedalign dpo --max_steps 400 --save_steps 2 --eval_strategy no "
                                                   f"--output_dir {out} --resume_from_checkpoint last")
    for checkpoint in out.glob("checkpoint-*"):
        assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "model.safetensors").is_file()


# ------------------------------------------------------------------- other commands


def test_plot_command_and_module_entry_point(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": i, "loss": 1.0 / i, "rewards/accuracies": 0.5 + i / 20}) for i in range(1, 6))
    )
    proc = subprocess.run([sys.executable, "-m", "fusedalign", "plot", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    png = out / "training_curves.png"
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(tmp_path / "missing")]) == 2


def test_consolidate_refuses_what_it_cannot_use(tmp_path, capsys):
    assert main(["consolidate"]) == 2
    assert main(["consolidate", str(tmp_path / "missing")]) == 2
    (tmp_path / "whole").mkdir()
    (tmp_path / "whole" / "model.safetensors").write_bytes(b"")
    assert main(["consolidate", str(tmp_path / "whole")]) == 2
    assert "already holds a whole model" in capsys.readouterr().err
