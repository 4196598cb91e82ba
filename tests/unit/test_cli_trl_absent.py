"""TRL 1.16 config fields fusedalign does not have: dropped when their value asks for what runs
here anyway, otherwise one line that says why and what runs instead (not an "unknown flag"
whose nearest-name hint points elsewhere)."""

from __future__ import annotations

import pytest

from fusedalign.cli import main
from fusedalign.cli.help import dataclass_types
from fusedalign.cli.parsing import build_parser, parse
from fusedalign.cli.trl_absent import ABSENT, FIELDS, drop_absent
from fusedalign.errors import CLIError

CASES = [(command, field) for command in FIELDS for field in sorted(FIELDS[command])]
# A value of each field that asks for something fusedalign does not do.
OTHER = {"true": "false", "false": "true", "none": "7", "auto": "8", "[]": "mix.yaml", "nf4": "fp4",
         "text": "content", "nll": "dft", "bfd": "wrapped"}


def _known(command: str) -> set[str]:
    return {action.dest for action in build_parser(command, dataclass_types(command))._actions}


def _other(field: str) -> str:
    same = ABSENT[field].same[0]
    return OTHER[same] if same in OTHER else str(float(same) * 2 + 1)


def test_every_field_is_in_the_table():
    assert set().union(*FIELDS.values()) == set(ABSENT)


@pytest.mark.parametrize("command,field", CASES)
def test_another_value_is_one_line_naming_the_flag(command, field, tmp_path, capsys):
    if field in _known(command):
        pytest.skip(f"`fusedalign {command}` has its own --{field}")
    value = _other(field)
    if value in ABSENT[field].same:
        pytest.skip(f"every value of --{field} asks for what runs here")
    assert main([command, f"--{field}", value, "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"fusedalign {command}: error: --{field} {value}: "), err
    assert ABSENT[field].line in err and "unknown flag" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command,field", CASES)
def test_the_value_that_asks_for_what_runs_here_is_dropped(command, field):
    if field in _known(command):
        pytest.skip(f"`fusedalign {command}` has its own --{field}")
    base = ["--output_dir", "/tmp/unused"]
    want = parse(command, dataclass_types(command), base, announce=False)
    for same in ABSENT[field].same:
        assert parse(command, dataclass_types(command), [f"--{field}", same, *base], announce=False) == want
        assert parse(command, dataclass_types(command), [f"--{field}={same}", *base], announce=False) == want


def test_a_field_the_command_has_is_never_taken():
    """DPO has its own pad_to_multiple_of: it reaches DPO's config, not this table."""
    assert "pad_to_multiple_of" in _known("dpo")
    assert drop_absent("dpo", ["--pad_to_multiple_of", "8"], {}, _known("dpo")) == ["--pad_to_multiple_of", "8"]
    with pytest.raises(CLIError, match="--pad_to_multiple_of 8: fusedalign does not pad"):
        drop_absent("sft", ["--pad_to_multiple_of", "8"], {}, _known("sft"))


def test_a_bare_boolean_flag_means_true(capsys, tmp_path):
    assert main(["grpo", "--sync_ref_model", "--output_dir", str(tmp_path / "run")]) == 2
    assert "--sync_ref_model true: syncing the reference model" in capsys.readouterr().err
    assert drop_absent("grpo", ["--ds3_gather_for_generation", "--beta", "0"], {}, set()) == ["--beta", "0"]


def test_config_keys_are_read_the_same_way(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("sync_ref_model: false\nref_model_sync_steps: 512\nbeta: 0.0\n")
    values = {"sync_ref_model": False, "ref_model_sync_steps": 512, "beta": 0.0}
    assert drop_absent("rloo", [], values, _known("rloo")) == [] and values == {"beta": 0.0}
    config.write_text("use_adaptive_entropy: true\n")
    assert main(["grpo", "--config", str(config), "--output_dir", str(tmp_path / "run")]) == 2
    assert "--config key use_adaptive_entropy: True: the adaptive entropy coefficient" in capsys.readouterr().err


# TRL 1.16's fields, per command, that have no flag here (besides the vLLM ones and those of GRPO's table).
SCRIPT_FIELDS = {"dataset_streaming", "ignore_bias_buffers", "datasets", "streaming", "test_split_size",
                 "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
                 "bnb_4bit_quant_storage", "lora_target_parameters"}
CONFIG_FIELDS = {
    "sft": {"loss_type", "packing_strategy", "shuffle_dataset", "eos_token", "pad_token",
            "chat_template_path", "dataset_kwargs", "activation_offloading"},
    "dpo": {"precompute_ref_batch_size", "activation_offloading", "pad_token"},
    "kto": {"precompute_ref_batch_size", "activation_offloading"},
}


@pytest.mark.parametrize("command", sorted(FIELDS))
def test_trl_script_and_config_fields_are_in_the_table(command):
    """ScriptArguments, ModelConfig's quantisation and DatasetMixtureConfig come with every `trl` command."""
    assert SCRIPT_FIELDS | CONFIG_FIELDS.get(command, set()) <= FIELDS[command]
    assert "model_init_kwargs" not in FIELDS[command]  # a field of the configs themselves


@pytest.mark.parametrize("command,flags", [
    ("sft", ["--dataset_text_field", "text", "--loss_type", "chunked_nll", "--packing_strategy", "bfd",
             "--shuffle_dataset", "false", "--eos_token", "None", "--dataset_kwargs", "{}"]),
    ("dpo", ["--activation_offloading", "false", "--precompute_ref_batch_size", "None"]),
    ("kto", ["--activation_offloading", "false", "--load_in_4bit", "false", "--bnb_4bit_quant_type", "nf4"]),
])
def test_a_trl_command_line_at_its_defaults_runs_as_without_them(command, flags):
    base = ["--output_dir", "/tmp/unused"]
    want = parse(command, dataclass_types(command), base, announce=False)
    assert parse(command, dataclass_types(command), [*flags, *base], announce=False) == want


def test_cast_lm_head_to_fp32_false_is_what_the_head_computes(capsys, tmp_path):
    """TRL's default, false: the logits GEMM in the weights' dtype, the softmax in float32 (true: a float32 GEMM)."""
    import torch

    from fusedalign.ops import head_logprobs

    torch.manual_seed(0)
    hidden, weight = (torch.randn(37, 64) * 2).bfloat16(), (torch.randn(1000, 64) * 0.5).bfloat16()
    labels = torch.randint(0, 1000, (37,))
    ours = head_logprobs(hidden, weight, labels, backend="torch", chunk_size=8).logps

    def logps(logits):
        return logits.log_softmax(-1).gather(1, labels[:, None])[:, 0]

    assert (ours - logps((hidden @ weight.t()).float())).abs().max() < 1e-5
    assert (ours - logps(hidden.float() @ weight.float().t())).abs().max() > 1e-3
    assert ABSENT["cast_lm_head_to_fp32"].same == ("false",)
    assert main(["grpo", "--cast_lm_head_to_fp32", "true", "--output_dir", str(tmp_path / "run")]) == 2
    assert "as TRL's default (false) does" in capsys.readouterr().err


def test_dataset_kwargs_without_skipping_the_preparation_is_dropped(tmp_path, capsys):
    values = {"dataset_kwargs": {"skip_prepare_dataset": False}}
    assert drop_absent("sft", ['--dataset_kwargs', '{"skip_prepare_dataset": false}'], values, _known("sft")) == []
    assert values == {}
    config = tmp_path / "run.yaml"
    config.write_text("dataset_kwargs:\n  skip_prepare_dataset: true\n")
    assert main(["sft", "--config", str(config), "--output_dir", str(tmp_path / "run")]) == 2
    assert "give tokenised rows (input_ids, optionally completion_mask)" in capsys.readouterr().err


def test_ld_dpo_and_f_dpo_are_dpo_flags_that_train(tmp_path):
    """LD-DPO's and f-DPO's fields are DPOConfig's own (TRL 1.16's names and defaults), taken by
    `fusedalign dpo` and trained with, not refused here."""
    flags = ["--ld_alpha", "0.5", "--f_divergence_type", "js_divergence", "--f_alpha_divergence_coef", "0.3"]
    assert {"ld_alpha", "f_divergence_type", "f_alpha_divergence_coef"} <= _known("dpo")
    assert not {"ld_alpha", "f_divergence_type", "f_alpha_divergence_coef"} & set(ABSENT)
    _, args, *_ = parse("dpo", dataclass_types("dpo"), [*flags, "--output_dir", str(tmp_path)], announce=False)
    assert (args.ld_alpha, args.f_divergence_type, args.f_alpha_divergence_coef) == (0.5, "js_divergence", 0.3)
    _, default, *_ = parse("dpo", dataclass_types("dpo"), ["--output_dir", str(tmp_path)], announce=False)
    assert (default.ld_alpha, default.f_divergence_type, default.f_alpha_divergence_coef) == (None, "reverse_kl", 0.5)
    out = tmp_path / "run"
    assert main(["dpo", *flags[:4], "--max_steps", "2", "--eval_strategy", "no", "--output_dir", str(out)]) == 0
    assert (out / "model.safetensors").is_file()


def test_wpo_use_weighting_is_a_dpo_flag_that_trains(tmp_path, capsys):
    """WPO's field is DPOConfig's own (TRL 1.16's name and default, False), taken by `fusedalign dpo`
    and trained with, not refused here; with a loss type that sorts the pairs it is refused, exit 2."""
    assert "use_weighting" in _known("dpo") and "use_weighting" not in ABSENT
    _, args, *_ = parse("dpo", dataclass_types("dpo"), ["--use_weighting", "true", "--output_dir", str(tmp_path)],
                        announce=False)
    assert args.use_weighting is True
    _, default, *_ = parse("dpo", dataclass_types("dpo"), ["--output_dir", str(tmp_path)], announce=False)
    assert default.use_weighting is False
    out = tmp_path / "run"
    assert main(["dpo", "--use_weighting", "true", "--max_steps", "2", "--eval_strategy", "no",
                 "--output_dir", str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["dpo", "--use_weighting", "true", "--loss_type", "aot", "--output_dir", str(tmp_path / "aot")]) == 2
    assert "use_weighting=True (WPO)" in capsys.readouterr().err
