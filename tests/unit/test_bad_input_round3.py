"""Bad input refused in one line (exit 2, no traceback, before the models load where no model is needed),
and what a run without usable rewards or without rewards at all tells its user:

- a causal LM given as a reward model (no trained score head), a reward model of other labels;
- `--report_to` an integration whose package is missing, an unknown one; FlashAttention that cannot load;
  a `teacher_model_init_kwargs` key the teacher does not take, or a dtype torch does not know;
- the dict flags (`--generation_kwargs`, `--teacher_model_init_kwargs`) as JSON on the command line;
- zero or negative batch sizes, `max_steps`, `save_steps`;
- reward functions returning None or NaN: a warning naming the step and the functions;
- distillation's completion log: no rewards and no advantage column.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from fusedalign.cli import main, parse
from fusedalign.cli import training as cli_training
from fusedalign.configs import GRPOConfig, ModelArguments
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model
from fusedalign.rewards import load_reward_model, unscored_warning
from fusedalign.trainers.grpo import GRPOTrainer
from fusedalign.trainers.grpo_completions import CompletionLog, format_table

STUDENT = ["--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", "builtin:zen", "--dataset_config",
           "standard_prompt_only", "--max_steps", "1", "--max_completion_length", "4",
           "--per_device_train_batch_size", "4"]
RLOO = ["rloo", *STUDENT, "--num_generations", "2"]
DISTILL = ["distillation", *STUDENT, "--teacher_model_name_or_path", "builtin:tiny-zen-teacher"]


def _refused(argv, capsys, *expected):
    """One line on stderr holding every expected text, exit 2, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and all(e in last for e in expected), err
    return err


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if the command gets as far as building the trainer (loading the models)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the models were loaded before the check")

    monkeypatch.setattr(cli_training, "build_trainer", refuse)


# ---------------------------------------------------------------- reward models

@pytest.mark.parametrize("flag", ["--reward_model_name_or_path", "--reward_funcs"])
def test_a_causal_lm_as_reward_model_is_refused(flag, tmp_path, capsys):
    """Loaded as a sequence classifier, a causal LM gets a random score head: refused, naming the
    path, the checkpoint's architecture and the missing weights; transformers' load table is not shown."""
    out = tmp_path / "r"
    err = _refused([*RLOO, flag, "builtin:tiny-llama", "--output_dir", str(out)], capsys,
                   f"{flag} builtin:tiny-llama is a LlamaForCausalLM checkpoint with no trained score head",
                   "score.weight missing", "expected a sequence-classification reward model (num_labels=1)")
    assert "LOAD REPORT" not in err and not out.exists()


def test_a_reward_model_of_other_labels_is_refused(tmp_path):
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    from fusedalign.models import load_tokenizer, resolve_model_path
    from fusedalign.rewards import RewardError

    base = resolve_model_path("builtin:tiny-qwen2")
    Qwen2ForSequenceClassification(AutoConfig.from_pretrained(base, num_labels=2)).save_pretrained(tmp_path)
    load_tokenizer(base).save_pretrained(tmp_path)
    with pytest.raises(RewardError, match=r"score.weight has shape \[2, 64\] in the checkpoint, not the \[1, 64\]"):
        load_reward_model(str(tmp_path), flag="--reward_funcs")


def test_a_sequence_classifier_still_loads_and_its_report_of_unexpected_keys_is_kept(tmp_path, caplog):
    """A one-label classifier with an extra weight loads; transformers' report of that key still reaches the user."""
    from safetensors.torch import load_file, save_file

    from tests.reward_model import save_tiny_reward_model

    path = save_tiny_reward_model(tmp_path / "rm")
    weights = load_file(path / "model.safetensors")
    save_file({**weights, "extra.weight": torch.zeros(2)}, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="transformers.modeling_utils"):
        rm = load_reward_model(str(path))
    assert rm.reward_name == "rm"
    assert "LOAD REPORT" in caplog.text and "extra.weight" in caplog.text


# ---------------------------------------------------------------- integrations and attention

@pytest.mark.parametrize("name, check, package", [("wandb", "is_wandb_available", "wandb"),
                                                  ("tensorboard", "is_tensorboard_available", "tensorboard")])
def test_report_to_a_missing_package_is_one_line_before_any_model(name, check, package, monkeypatch, tmp_path,
                                                                  capsys, no_model_load):
    from transformers.integrations import integration_utils

    monkeypatch.setattr(integration_utils, check, lambda: False)
    _refused([*RLOO, "--reward_funcs", "zen_words", "--report_to", name, "--output_dir", str(tmp_path / "r")],
             capsys, f"--report_to {name}: the {package} package is not installed",
             f"pip install {package}, or --report_to none")


def test_report_to_an_unknown_integration_is_one_line(tmp_path, capsys, no_model_load):
    _refused(["dpo", "--report_to", "wandbb", "--output_dir", str(tmp_path / "r")], capsys,
             "--report_to wandbb: expected none, all or one of", "wandb")


def test_report_to_none_and_all_are_accepted(tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none").report_to == []
    GRPOConfig(output_dir=str(tmp_path), report_to="all")  # only what is installed


@pytest.mark.parametrize("cuda, kernels, expected", [
    (False, False, "FlashAttention runs on a CUDA device and none is visible here"),
    (True, False, "the flash-attn package is (not installed|too old for transformers) \\(pip install -U flash-attn\\), "
                  "or use sdpa"),
])
def test_flash_attention_that_cannot_load_is_refused_at_parse(cuda, kernels, expected, monkeypatch):
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_flash_attn_2_available", lambda: False)
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda: kernels)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(ValueError, match="--attn_implementation flash_attention_2: " + expected):
        ModelArguments(attn_implementation="flash_attention_2")


def test_flash_attention_is_left_to_transformers_where_it_can_load(monkeypatch):
    """A CUDA device and the kernels library: transformers loads a hub build of the kernel instead."""
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_flash_attn_2_available", lambda: False)
    monkeypatch.setattr(import_utils, "is_kernels_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ModelArguments(attn_implementation="flash_attention_2").attn_implementation == "flash_attention_2"
    assert ModelArguments(attn_implementation="sdpa").attn_implementation == "sdpa"


def test_flash_attention_on_the_command_line_is_one_line_before_any_model(monkeypatch, tmp_path, capsys,
                                                                          no_model_load):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused([*DISTILL, "--padding_free", "true", "--attn_implementation", "flash_attention_2", "--output_dir",
              str(tmp_path / "r")], capsys, "--attn_implementation flash_attention_2: FlashAttention runs on a CUDA")


def test_teacher_init_kwargs_the_teacher_does_not_take_are_one_line(tmp_path, capsys):
    """From --config YAML (the report's case) and as JSON on the command line."""
    config = tmp_path / "run.yaml"
    config.write_text("teacher_model_init_kwargs:\n  not_a_kwarg: 3\n")
    out = tmp_path / "r"
    for extra in (["--config", str(config)], ["--teacher_model_init_kwargs", '{"not_a_kwarg": 3}']):
        _refused([*DISTILL, *extra, "--output_dir", str(out)], capsys,
                 "teacher_model_init_kwargs: 'not_a_kwarg' is not an argument of from_pretrained or of the model of")
    assert not out.exists()


def test_teacher_init_kwargs_with_an_unknown_dtype_are_one_line_before_any_model(tmp_path, capsys, no_model_load):
    _refused([*DISTILL, "--teacher_model_init_kwargs", '{"dtype": "float33"}', "--output_dir", str(tmp_path / "r")],
             capsys, "teacher_model_init_kwargs dtype 'float33': expected auto or a torch dtype name")


# ---------------------------------------------------------------- dict flags as JSON

def test_dict_flags_take_json_on_the_command_line(tmp_path):
    from fusedalign.cli.help import dataclass_types

    argv = ["--output_dir", str(tmp_path), "--generation_kwargs", '{"do_sample": false, "num_beams": 1}']
    args = parse("grpo", dataclass_types("grpo"), argv)[1]
    assert args.generation_kwargs == {"do_sample": False, "num_beams": 1}
    args = parse("distillation", dataclass_types("distillation"),
                 ["--output_dir", str(tmp_path), "--teacher_model_init_kwargs", '{"dtype": "float32"}'])[1]
    assert args.teacher_model_init_kwargs == {"dtype": "float32"}
    # A dict (YAML, Python) is kept as it is.
    assert GRPOConfig(output_dir=str(tmp_path), generation_kwargs={"do_sample": False}).generation_kwargs == {
        "do_sample": False}


@pytest.mark.parametrize("flag, value, expected", [
    ("--generation_kwargs", "{do_sample: false}",
     "generation_kwargs must be a JSON object, e.g. '{\"do_sample\": false}'"),
    ("--generation_kwargs", "[1, 2]", "generation_kwargs must be a JSON object"),
    ("--teacher_model_init_kwargs", "{'dtype': 'float32'}", "teacher_model_init_kwargs must be a JSON object"),
])
def test_bad_json_in_a_dict_flag_is_one_line(flag, value, expected, tmp_path, capsys, no_model_load):
    command = DISTILL if flag == "--teacher_model_init_kwargs" else [*RLOO, "--reward_funcs", "zen_words"]
    _refused([*command, flag, value, "--output_dir", str(tmp_path / "r")], capsys, expected, repr(value))


# ---------------------------------------------------------------- sizes

@pytest.mark.parametrize("command", ["rloo", "distillation", "dpo"])
@pytest.mark.parametrize("flag, value, expected", [
    ("--per_device_train_batch_size", "0", "--per_device_train_batch_size must be >= 1; got 0."),
    ("--per_device_train_batch_size", "-4", "--per_device_train_batch_size must be >= 1; got -4."),
    ("--gradient_accumulation_steps", "0", "--gradient_accumulation_steps must be >= 1; got 0."),
    ("--per_device_eval_batch_size", "0", "--per_device_eval_batch_size must be >= 1; got 0."),
    ("--max_steps", "0", "--max_steps must be > 0, or -1 to train --num_train_epochs epochs; got 0."),
    ("--max_steps", "-5", "--max_steps must be > 0, or -1 to train --num_train_epochs epochs; got -5."),
    ("--save_steps", "0", "--save_steps must be > 0 when saving by steps"),
    ("--save_steps", "-3", "--save_steps must be > 0 when saving by steps"),
])
def test_zero_or_negative_sizes_are_refused_before_any_model(command, flag, value, expected, tmp_path, capsys,
                                                            no_model_load):
    err = _refused([command, flag, value, "--output_dir", str(tmp_path / "r")], capsys, expected)
    assert "distinct prompts" not in err and "steps_per_generation" not in err


def test_the_sizes_transformers_means_something_by_are_kept(tmp_path):
    """max_steps -1 trains epochs; save_steps below 1 is a share of the training steps; with another
    save_strategy, save_steps is not read."""
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=-1, save_strategy="steps", save_steps=0.25)
    assert args.max_steps == -1 and args.save_steps == 0.25
    assert GRPOConfig(output_dir=str(tmp_path), save_strategy="no", save_steps=0).save_steps == 0


# ---------------------------------------------------------------- rewards without a value

def test_unscored_warning_names_the_step_the_functions_and_one_completion():
    nan = float("nan")
    names = ["short", "uses_topic"]
    assert unscored_warning(torch.tensor([[1.0, nan], [nan, 0.5]]), names, "step 3") is None
    some = unscored_warning(torch.tensor([[1.0, nan], [nan, nan], [nan, nan], [0.0, 1.0]]), names, "step 3",
                            "dataset row 7 (from 0), generation 1")
    assert some == ("step 3: every reward function (short, uses_topic) returned None or NaN for 2 of 4 completions "
                    "(e.g. dataset row 7 (from 0), generation 1); they get advantage 0 and teach nothing.")
    every = unscored_warning(torch.full((8, 1), nan), ["nan_r"], "step 2")
    assert every.startswith("step 2: no completion of the generation batch has a reward: the reward function "
                            "'nan_r' returned None or NaN for all 8, so every advantage is 0 and nothing is learned")
    assert "\n" not in some + every


@pytest.mark.parametrize("value", [None, float("nan")])
def test_a_reward_with_no_value_warns_at_every_generation(value, tmp_path, caplog):
    """Every completion unscored: the run trains (a batch with nothing to learn is not an error) and
    says so at each generation, naming the step and the function."""
    def all_none(completions, **kwargs):
        return [value] * len(completions)

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, logging_steps=1, save_strategy="no", report_to="none",
                      disable_tqdm=True, seed=0)
    prompts = load_dataset_any("builtin:zen", "standard_prompt_only").select(range(8))
    trainer = GRPOTrainer(load_model("builtin:tiny-qwen2"), reward_funcs=all_none, args=args, train_dataset=prompts)
    with caplog.at_level(logging.WARNING, logger="fusedalign.trainers.grpo_rollout"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "returned None or NaN" in r.getMessage()]
    assert [w.split(":")[0] for w in warned] == ["step 1", "step 2"], warned
    assert all("the reward function 'all_none' returned None or NaN for all 4" in w for w in warned)
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert len(steps) == 2 and all(e["loss"] == 0.0 for e in steps)
    # Logged as TRL logs a statistic over nothing: the key, with None.
    assert all(e["rewards/all_none/mean"] is None and e["rewards/all_none/std"] is None
               and e["reward"] is None and e["reward_std"] is None for e in steps), steps


def test_a_reward_scored_for_some_completions_warns_about_the_others(tmp_path, caplog):
    def first_half(completions, **kwargs):
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    prompts = load_dataset_any("builtin:zen", "standard_prompt_only").select(range(8))
    trainer = GRPOTrainer(load_model("builtin:tiny-qwen2"), reward_funcs=[first_half], args=args,
                          train_dataset=prompts)
    with caplog.at_level(logging.WARNING, logger="fusedalign.trainers.grpo_rollout"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "returned None or NaN" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 1: the reward function 'first_half' returned None or "
                                                     "NaN for 2 of 4 completions (e.g. dataset row"), warned


# ---------------------------------------------------------------- distillation's completion log

class _OneProcess:
    num_processes, is_main_process = 1, True


def test_a_completion_log_without_rewards_has_no_reward_or_advantage(tmp_path, capsys):
    """Distillation's rows (no reward function): no `rewards` or `advantage` key, no such column."""
    log = CompletionLog(True, _OneProcess())
    nothing = torch.full((2,), float("nan"))
    log.add(1, ["a prompt", "another"], ["done", "too"], nothing[:, None][:, :0], [], nothing)
    log.flush(str(tmp_path), None)
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "prompt": "a prompt", "completion": "done"},
                    {"step": 1, "prompt": "another", "completion": "too"}]
    header = capsys.readouterr().out.strip().splitlines()[0]
    assert [c.strip() for c in header.split("|")] == ["step", "prompt", "completion"]
    scored = format_table([{"step": 1, "prompt": "p", "completion": "c", "rewards": {"r": 0.5}, "advantage": 0.25}])
    assert [c.strip() for c in scored.splitlines()[0].split("|")] == ["step", "prompt", "completion", "r", "advantage"]


def test_distillation_log_completions_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "d"
    assert main([*DISTILL, "--per_device_train_batch_size", "2", "--log_completions", "--output_dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(set(r) == {"step", "prompt", "completion"} for r in rows)
    printed = capsys.readouterr().out
    assert "advantage" not in printed and "None" not in printed.split("step | prompt")[1].split("\n\n")[0]


def test_model_init_kwargs_the_policy_does_not_take_are_one_line(tmp_path, capsys):
    """On the command line (added to --dtype and the other model flags) and for a model given by name."""
    out = tmp_path / "r"
    _refused(["sft", "--model_init_kwargs", '{"not_a_kwarg": 3}', "--output_dir", str(out)], capsys,
             "model_init_kwargs: 'not_a_kwarg' is not an argument of from_pretrained or of the model of")
    assert not out.exists()
    from datasets import Dataset

    from fusedalign.configs import SFTConfig
    from fusedalign.trainers.sft import SFTTrainer

    with pytest.raises(ValueError, match="model_init_kwargs: 'not_a_kwarg' is not an argument"):
        SFTTrainer(model="builtin:tiny-qwen2", args=SFTConfig(output_dir=str(out), model_init_kwargs={"not_a_kwarg": 3}),
                   train_dataset=Dataset.from_list([{"text": "a"}]))


@pytest.mark.parametrize("command,flags", [("distillation", "per_device_train_batch_size or gradient_accumulation_steps"),
                                           ("grpo", "per_device_train_batch_size or steps_per_generation")])
def test_a_generation_batch_over_the_dataset_names_the_trainers_own_flags(command, flags, tmp_path, capsys):
    err = _refused([command, "--per_device_train_batch_size", "1024", "--max_steps", "1", "--output_dir",
                    str(tmp_path / "r")], capsys, f"lower {flags}, or add rows")
    assert command != "distillation" or "steps_per_generation" not in err
