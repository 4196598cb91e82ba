"""TRL 1.16's defaults for the model's dtype, mixed precision and the fields every config inherits,
and the README rows where ours differ on purpose: float32 weights under `--bf16` (mixed precision,
as TRL's `--dtype float32`), bf16 on where CUDA supports it for every trainer, `model_init_kwargs`,
`remove_unused_columns` accepted either way, `label_smoothing_factor` refused (never silently
ignored), and the model flags of TRL's `ModelConfig` (revision, rsLoRA, DoRA, task type)."""

from __future__ import annotations

import json

import pytest
import torch

from fusedalign.cli import main, parse
from fusedalign.cli.arguments import RunArguments
from fusedalign.cli.training import check_adapter_on_head, load_model_from, peft_config_from
from fusedalign.configs import DPOConfig, GRPOConfig, KTOConfig, ModelArguments, ScriptArguments, SFTConfig
from fusedalign.errors import CLIError
from fusedalign.models import load_model

CONFIGS = [SFTConfig, DPOConfig, KTOConfig, GRPOConfig]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """builtin:tiny-qwen2 saved in bfloat16, as most hub checkpoints are."""
    path = tmp_path_factory.mktemp("bf16") / "model"
    load_model("builtin:tiny-qwen2", dtype=torch.bfloat16).save_pretrained(path)
    from fusedalign.models import load_tokenizer

    load_tokenizer("builtin:tiny-qwen2").save_pretrained(path)
    return str(path)


def test_the_cli_loads_float32_weights_as_trl_does(tmp_path, bf16_checkpoint):
    """TRL's `--dtype` default is float32: with --bf16, mixed precision over float32 weights, never a
    pure-bf16 optimizer step because the checkpoint happened to be saved in bf16."""
    flags = ["--model_name_or_path", bf16_checkpoint, "--output_dir", str(tmp_path)]
    _, args, model_args, _ = parse("dpo", (ScriptArguments, DPOConfig, ModelArguments, RunArguments), flags)
    assert model_args.dtype == "float32"
    assert next(load_model_from(model_args, args).parameters()).dtype == torch.float32
    _, args, model_args, _ = parse("dpo", (ScriptArguments, DPOConfig, ModelArguments, RunArguments),
                                   [*flags, "--dtype", "auto"])
    assert next(load_model_from(model_args, args).parameters()).dtype == torch.bfloat16  # the checkpoint's own


def test_model_init_kwargs_load_a_model_given_by_name(tmp_path, bf16_checkpoint):
    """As TRL: a model given to a trainer by name loads in float32 unless `model_init_kwargs` names a
    dtype; the CLI adds them on top of its model flags; a JSON string is read as on TRL's command line."""
    from datasets import Dataset

    from fusedalign.trainers.sft import SFTTrainer

    rows = Dataset.from_list([{"text": "Beautiful is better than ugly."}] * 2)
    common = dict(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no")
    plain = SFTTrainer(model=bf16_checkpoint, args=SFTConfig(**common), train_dataset=rows)
    assert next(plain.model.parameters()).dtype == torch.float32
    asked = SFTTrainer(model=bf16_checkpoint, args=SFTConfig(**common, model_init_kwargs='{"dtype": "bfloat16"}'),
                       train_dataset=rows)
    assert asked.args.model_init_kwargs == {"dtype": "bfloat16"}
    assert next(asked.model.parameters()).dtype == torch.bfloat16
    _, args, model_args, _ = parse("sft", (ScriptArguments, SFTConfig, ModelArguments, RunArguments),
                                   ["--model_name_or_path", bf16_checkpoint, "--model_init_kwargs",
                                    json.dumps({"dtype": "bfloat16"}), "--output_dir", str(tmp_path / "o")])
    assert next(load_model_from(model_args, args).parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="model_init_kwargs must be a JSON object"):
        SFTConfig(**common, model_init_kwargs="dtype=bfloat16")


@pytest.mark.parametrize("config", CONFIGS)
def test_bf16_is_on_where_cuda_supports_it_for_every_trainer(config, monkeypatch, tmp_path):
    """TRL's bf16=True where it can run (README: bf16, gradient_checkpointing, logging_steps)."""
    from fusedalign.configs import common

    assert config(output_dir=str(tmp_path)).bf16 is False  # this machine has no CUDA
    monkeypatch.setattr(common, "default_bf16", lambda args: True)  # what a CUDA machine with bf16 decides
    assert config(output_dir=str(tmp_path)).bf16 is True
    assert config(output_dir=str(tmp_path), bf16=False).bf16 is False  # asked for: kept


def test_the_bf16_rule(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from fusedalign.configs import common

    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common.torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert common.default_bf16(SimpleNamespace(fp16=False, use_cpu=False)) is True
    assert common.default_bf16(SimpleNamespace(fp16=True, use_cpu=False)) is False
    assert common.default_bf16(SimpleNamespace(fp16=False, use_cpu=True)) is False
    monkeypatch.setattr(common.torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert common.default_bf16(SimpleNamespace(fp16=False, use_cpu=False)) is False


@pytest.mark.parametrize("config", CONFIGS)
def test_label_smoothing_factor_is_refused_rather_than_ignored(config, tmp_path):
    with pytest.raises(ValueError, match="label_smoothing_factor 0.1: .*would be ignored"):
        config(output_dir=str(tmp_path), label_smoothing_factor=0.1)


def test_label_smoothing_factor_is_one_line_on_the_command_line(tmp_path, capsys):
    assert main(["sft", "--label_smoothing_factor", "0.1", "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "label_smoothing_factor 0.1" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["sft", "dpo", "kto"])
def test_remove_unused_columns_trains_the_same_either_way(command, tmp_path):
    """TRL's default for SFT/DPO/KTO (True) is ours, and either value trains the same: the trainers read
    their own columns (True used to drop every column of the data before the collator saw it)."""
    losses = []
    for value in ("true", "false"):
        out = tmp_path / value
        assert main([command, "--remove_unused_columns", value, "--max_steps", "2", "--eval_strategy", "no",
                     "--output_dir", str(out)]) == 0
        losses.append([json.loads(line).get("loss") for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert losses[0] == losses[1] and any(v is not None for v in losses[0])
    assert SFTConfig(output_dir=str(tmp_path)).remove_unused_columns is True
    assert GRPOConfig(output_dir=str(tmp_path)).remove_unused_columns is False  # TRL's GRPO default


def test_model_revision_reaches_the_model_and_its_tokenizer(monkeypatch, tmp_path):
    from fusedalign import models

    seen = []
    monkeypatch.setattr(models, "load_model", lambda path, **kw: seen.append(("model", kw)))
    monkeypatch.setattr(models, "load_tokenizer", lambda path, **kw: seen.append(("tokenizer", kw)))
    from fusedalign.cli.training import load_tokenizer_from

    args = ModelArguments(model_name_or_path="org/model", model_revision="v1.0")
    load_model_from(args)
    load_tokenizer_from(args)
    assert seen == [("model", {"revision": "v1.0", "dtype": "float32"}), ("tokenizer", {"revision": "v1.0"})]
    assert load_tokenizer_from(ModelArguments(model_name_or_path="org/model")) is None  # main: the trainer's own


def test_rslora_and_dora_reach_peft():
    config = peft_config_from(ModelArguments(use_peft=True, use_rslora=True, use_dora=True, lora_r=4, lora_alpha=8))
    assert config.use_rslora is True and config.use_dora is True and str(config.task_type).endswith("CAUSAL_LM")
    from peft import get_peft_model

    model = get_peft_model(load_model("builtin:tiny-qwen2"),
                           peft_config_from(ModelArguments(use_peft=True, use_rslora=True, lora_r=4, lora_alpha=8,
                                                           lora_target_modules=["q_proj", "lm_head"])))
    assert model.base_model.model.lm_head.scaling["default"] == pytest.approx(8 / 4 ** 0.5)  # alpha / sqrt(r)


def test_dora_on_the_fused_head_is_one_line_before_anything_loads(tmp_path, capsys):
    model_args = ModelArguments(use_peft=True, use_dora=True, lora_target_modules=["q_proj", "lm_head"])
    with pytest.raises(CLIError, match="--use_dora with lm_head"):
        check_adapter_on_head(model_args, SFTConfig(output_dir=str(tmp_path)))
    check_adapter_on_head(model_args, SFTConfig(output_dir=str(tmp_path), fused_head=False))  # unfused: PEFT's DoRA
    check_adapter_on_head(ModelArguments(use_peft=True, use_dora=True), SFTConfig(output_dir=str(tmp_path)))
    assert main(["sft", "--use_peft", "--use_dora", "--lora_target_modules", "q_proj", "lm_head",
                 "--output_dir", str(tmp_path / "run")]) == 2
    assert "--use_dora with lm_head" in capsys.readouterr().err


def test_under_bf16_the_policy_keeps_float32_weights_and_the_reference_loads_in_bf16(tmp_path, bf16_checkpoint):
    """README row: the frozen reference in bf16 (no optimizer step; half the memory), the policy as TRL."""
    from fusedalign.data import load_dataset_any
    from fusedalign.trainers.dpo import DPOTrainer

    rows = load_dataset_any("builtin:zen", "standard_preference", split="train").select(range(2))
    trainer = DPOTrainer(model=bf16_checkpoint, args=DPOConfig(output_dir=str(tmp_path), bf16=True, report_to="none"),
                         train_dataset=rows)
    assert next(trainer.model.parameters()).dtype == torch.float32
    assert next(trainer.reference.model.parameters()).dtype == torch.bfloat16


def test_evaluation_logs_the_training_num_tokens_as_trl(tmp_path):
    out = tmp_path / "run"
    assert main(["dpo", "--max_steps", "2", "--eval_strategy", "steps", "--eval_steps", "1",
                 "--output_dir", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"]: r["num_tokens"] for r in records if "num_tokens" in r}
    evaluated = {r["step"]: r["eval_num_tokens"] for r in records if "eval_num_tokens" in r}
    assert evaluated == trained and len(evaluated) == 2 and trained[1] < trained[2]
