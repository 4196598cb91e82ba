"""The command line: the demo job, flags, --config, errors that name what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fusedalign.cli import main


def _records(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


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
    assert "embedded demo" in capsys.readouterr().err


def test_config_file_sets_defaults_and_flags_override(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 2\nbeta: 0.3\nloss_type: [sigmoid, sft]\nloss_weights: [1.0, 0.5]\nsave_strategy: 'no'\n")
    out = tmp_path / "cfg"
    assert main(["dpo", "--config", str(config), "--output_dir", str(out), "--beta", "0.2", "--eval_strategy", "no"]) == 0
    args = __import__("torch").load(out / "training_args.bin", weights_only=False)
    assert args.beta == 0.2 and args.max_steps == 2 and args.loss_type == ["sigmoid", "sft"]


def test_use_liger_kernel_is_an_alias_of_fused_head(tmp_path):
    out = tmp_path / "liger"
    assert main(["dpo", "--output_dir", str(out), "--max_steps", "1", "--fused_head", "false",
                 "--use_liger_kernel", "--eval_strategy", "no"]) == 0
    args = __import__("torch").load(out / "training_args.bin", weights_only=False)
    assert args.fused_head is True and args.use_liger_kernel is False


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--beta", "0"], "beta must be > 0"),
        (["--loss_type", "nope"], "Unknown DPO loss_type ['nope']"),
        (["--model_name_or_path", "builtin:tiny-nothing", "--dataset_name", "builtin:zen",
          "--dataset_config", "standard_preference"], "tiny-qwen2"),
        (["--model_name_or_path", "/no/such/model", "--dataset_name", "builtin:zen",
          "--dataset_config", "standard_preference"], "/no/such/model"),
        (["--dataset_config", "standard_nothing"], "standard_preference"),
        (["--dataset_config", "standard_unpaired_preference"], "completion"),
    ],
)
def test_bad_input_is_a_clear_error_and_keeps_the_output_dir(tmp_path, capsys, flags, expected):
    out = tmp_path / "keep"
    out.mkdir()
    (out / "precious.txt").write_text("do not delete")
    assert main(["dpo", "--output_dir", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and expected in err, err
    assert (out / "precious.txt").read_text() == "do not delete"


def test_bad_rows_in_a_local_file_name_the_row_and_column(tmp_path, capsys):
    data = tmp_path / "prefs.jsonl"
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "d", "chosen": "", "rejected": "f"}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    code = main(["dpo", "--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", str(data),
                 "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "row 1" in err and "chosen" in err, err


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


def test_help_and_unknown_command(capsys):
    assert main([]) == 0 and "fusedalign <command>" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
