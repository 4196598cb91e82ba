"""Flags a TRL user types: their TRL meaning, or one line saying what runs here instead."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import pytest

import fusedalign
from fusedalign.cli import main
from fusedalign.cli.training import peft_config_from
from fusedalign.configs import ModelArguments
from fusedalign.models import load_model

TRAINING = ["dpo", "kto", "sft", "grpo", "rloo", "distillation"]
GENERATING = ("grpo", "rloo", "distillation")


@pytest.mark.parametrize("command", TRAINING)
@pytest.mark.parametrize("flags", [["--use_vllm"], ["--use_vllm", "true"], ["--use_vllm=True"],
                                   ["--vllm_mode", "colocate"]])
def test_vllm_flags_are_one_line_naming_what_generates(command, flags, tmp_path, capsys):
    assert main([command, *flags, "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not use vLLM" in err and "--use_cpu" not in err, err
    assert ("--generation_backend" in err) == (command in GENERATING), err
    assert not (tmp_path / "run").exists()


def test_use_vllm_false_is_trls_default_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    assert main(["dpo", "--use_vllm", "false", "--max_steps", "1", "--eval_strategy", "no",
                 "--output_dir", str(out)]) == 0
    assert (out / "model.safetensors").is_file()


def test_vllm_config_key_is_refused_too(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("use_vllm: true\n")
    assert main(["grpo", "--config", str(config), "--output_dir", str(tmp_path / "run")]) == 2
    assert "--config key use_vllm: fusedalign does not use vLLM" in capsys.readouterr().err


def _lora_layers(targets):
    model = load_model("builtin:tiny-qwen2")
    args = ModelArguments(use_peft=True, lora_target_modules=targets)
    from peft import get_peft_model

    peft_model = get_peft_model(model, peft_config_from(args))
    return {name.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for name, _ in peft_model.named_parameters()
            if ".lora_A." in name}


def test_lora_target_modules_all_linear_is_pefts():
    every_linear = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert _lora_layers(["all-linear"]) == every_linear == _lora_layers(None)  # lm_head excluded, as PEFT does
    assert _lora_layers(["q_proj", "lm_head"]) == {"q_proj", "lm_head"}


def test_all_linear_with_other_names_is_one_line(tmp_path, capsys):
    assert main(["sft", "--use_peft", "--lora_target_modules", "all-linear", "lm_head", "--max_steps", "1",
                 "--output_dir", str(tmp_path / "run")]) == 2
    assert "all-linear already names every linear layer" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--lora_r", "0"], "--lora_r must be >= 1 (the adapter's rank); got 0."),
    (["--lora_dropout", "1.5"], "--lora_dropout must be in [0, 1); got 1.5."),
    (["--lora_alpha", "0"], "--lora_alpha 0 scales the adapter's output, and so its gradients, to zero: the run "
                            "would train nothing; give the usual 2 x --lora_r, for instance."),
])
def test_lora_values_that_train_nothing_or_cannot_build_are_one_line(tmp_path, capsys, flags, message):
    """PEFT's own message for a rank of 0 names its field `r`, not the flag; dropout 1.5 failed when the
    adapter was built; alpha 0 trained nothing, silently. Nothing is written."""
    out = tmp_path / "run"
    assert main(["sft", "--use_peft", *flags, "--max_steps", "1", "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"fusedalign sft: error: {message}"
    assert not out.exists()


def test_version_names_ours_and_what_decides_a_run(capsys):
    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"fusedalign {fusedalign.__version__} (") and f"transformers {version('transformers')}" in line
    done = subprocess.run([sys.executable, "-m", "fusedalign", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == line


def test_a_builtin_base_is_recorded_by_name_and_merge_leaves_it_alone(tmp_path, capsys):
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["sft", "--use_peft", "--max_steps", "2", "--eval_strategy", "no", "--output_dir", str(adapter)]) == 0
    recorded = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == "builtin:tiny-qwen2"
    capsys.readouterr()
    assert main(["merge", str(adapter), str(merged)]) == 0
    err = capsys.readouterr().err
    assert "merged into a copy of its base model builtin:tiny-qwen2 (which is unchanged)" in err
    assert (merged / "model.safetensors").is_file()


def test_an_error_during_a_progress_bar_starts_a_line_of_its_own(monkeypatch, capsys):
    from tqdm.auto import tqdm

    from fusedalign import cli
    from fusedalign.errors import CLIError

    def fails_mid_bar(argv):
        bar = tqdm(total=10, file=sys.stderr)
        bar.update(3)
        raise CLIError("row 3: bad")

    monkeypatch.setitem(cli.COMMANDS, "dpo", fails_mid_bar)
    assert main(["dpo"]) == 2
    err = capsys.readouterr().err
    assert "\nfusedalign dpo: error: row 3: bad" in err and err.rstrip().endswith("row 3: bad"), repr(err)


def test_an_enum_valued_flag_is_named_as_typed(tmp_path, capsys):
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"prompt": "p", "chosen": " a.", "rejected": " b."}) + "\n")
    assert main(["dpo", "--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", str(data),
                 "--eval_strategy", "steps", "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--eval_strategy steps: " in err and "IntervalStrategy" not in err, err


@pytest.mark.parametrize("command", ["dpo", "kto"])
def test_pad_to_multiple_of_auto_is_trls_default_and_pads_nothing(command, tmp_path, capsys):
    """TRL's `auto` pads only on Neuron: None here, on the command line and in --config YAML."""
    from fusedalign.cli.help import dataclass_types
    from fusedalign.cli.parsing import parse
    from fusedalign.configs import DPOConfig, KTOConfig

    def value(*flags):
        args = parse(command, dataclass_types(command), [*flags, "--output_dir", str(tmp_path / "o")], announce=False)
        return args[1].pad_to_multiple_of

    config = {"dpo": DPOConfig, "kto": KTOConfig}[command]
    assert [f.default for f in config.__dataclass_fields__.values() if f.name == "pad_to_multiple_of"] == ["auto"]
    assert value() is None and value("--pad_to_multiple_of", "auto") is None
    assert value("--pad_to_multiple_of", "None") is None and value("--pad_to_multiple_of", "8") == 8
    yaml = tmp_path / "run.yaml"
    yaml.write_text("pad_to_multiple_of: auto\n")
    assert value("--config", str(yaml)) is None
    yaml.write_text("pad_to_multiple_of: 16\n")
    assert value("--config", str(yaml)) == 16
    assert main([command, "--pad_to_multiple_of", "eight", "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pad_to_multiple_of must be a positive number of tokens, auto or None" in err


def test_completion_only_loss_true_on_language_modeling_data_is_one_line(tmp_path, capsys):
    """The SFT demo's data is language modeling: TRL's default (None) learns every token; True has nothing to mask."""
    assert main(["sft", "--completion_only_loss", "true", "--max_steps", "1", "--output_dir", str(tmp_path / "run")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the demo's banner
    assert last.startswith("fusedalign sft: error: dataset builtin:zen: completion_only_loss=True needs "
                           "prompt-completion data"), last


@pytest.mark.parametrize("flags,ok", [([], True), (["--eval_packing", "false"], True),
                                      (["--packing", "--eval_packing", "true"], True),
                                      (["--packing", "--eval_packing", "false"], False),
                                      (["--eval_packing", "true"], False)])
def test_eval_packing_is_accepted_where_it_asks_for_what_runs(flags, ok, tmp_path, capsys):
    """The eval split is packed exactly when the training split is: TRL's default (None) or --packing's value."""
    from fusedalign.cli.help import dataclass_types
    from fusedalign.cli.parsing import parse

    argv = [*flags, "--output_dir", str(tmp_path / "run")]
    if ok:
        assert parse("sft", dataclass_types("sft"), argv, announce=False)[1].eval_packing in (None, "--packing" in flags)
        return
    assert main(["sft", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the eval split is packed exactly when the training split is" in err, err


@pytest.mark.parametrize("command,flags,flag", [
    ("dpo", ["--loss_type", "exo_pair", "--label_smoothing", "0.6"], "label_smoothing"),
    ("dpo", ["--loss_type", "robust", "--label_smoothing", "0.5"], "robust"),
    ("grpo", ["--epsilon", "-0.1"], "epsilon"),
    ("grpo", ["--delta", "1.0"], "delta"),
    ("grpo", ["--max_completion_length", "None"], "max_completion_length"),
])
def test_validations_stricter_than_trls_are_one_line(command, flags, flag, tmp_path, capsys):
    """The README's row of values TRL 1.16 runs and fusedalign refuses (SFT's completion_only_loss: above)."""
    assert main([command, *flags, "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"fusedalign {command}: error: ") and flag in err, err


@pytest.mark.parametrize("command,flags,ok", [
    ("rloo", ["--loss_type", "dapo", "--entropy_coef", "0"], True),  # GRPO's defaults: accepted, nothing changes
    ("rloo", ["--loss_type", "grpo"], False),
    ("distillation", ["--loss_type", "dapo", "--num_generations", "1"], True),  # distillation's own values
    ("distillation", ["--num_generations", "8"], False),  # GRPO's default, not what distillation runs
])
def test_grpo_flags_of_rloo_and_distillation_pass_only_at_the_value_that_runs(command, flags, ok, tmp_path, capsys):
    from fusedalign.cli.help import dataclass_types
    from fusedalign.cli.parsing import parse

    argv = [*flags, "--output_dir", str(tmp_path / "run")]
    if ok:
        plain = parse(command, dataclass_types(command), argv[-2:], announce=False)
        assert parse(command, dataclass_types(command), argv, announce=False) == plain
        return
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--{flags[0][2:]} is an option of GRPO" in err, err
