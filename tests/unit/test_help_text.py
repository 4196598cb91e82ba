"""Each training command's --help speaks of that command: the demo values it fills in, and no GRPO or DPO
wording where the flag means something else (or nothing) for RLOO and distillation."""

from __future__ import annotations

import pytest

from fusedalign.cli import main
from fusedalign.cli.demo import DEMO_DEFAULTS


@pytest.mark.parametrize("command", ["sft", "dpo", "kto", "grpo", "rloo", "distillation"])
def test_help_lists_the_demos_values(command, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"--dataset_config {DEMO_DEFAULTS[command]['dataset_config']}" in text
    assert f"--learning_rate {DEMO_DEFAULTS[command]['learning_rate']}" in text
    assert "see `fusedalign --help`" not in text


@pytest.mark.parametrize("command,absent", [
    ("rloo", ["Unused by GRPO", "bnpo", "top_entropy_quantile keeps"]),
    ("distillation", ["Unused by GRPO", "completions and rewards", "bnpo"]),
])
def test_rloo_and_distillation_help_carry_no_other_trainers_wording(command, absent, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert not [words for words in absent if words in text], text


def test_a_format_error_names_the_trainer_as_written():
    from fusedalign.data.formats import DataError, validate_dataset

    with pytest.raises(DataError, match=r"\): distillation expects"):
        validate_dataset([{"text": "a"}], "distillation")
    with pytest.raises(DataError, match=r"\): DPO expects"):
        validate_dataset([{"text": "a"}], "dpo")
