"""TrainingArguments' flags a run finds wrong only after its models loaded, or never: refused in one
line naming the flag when the config is made (a training command: before any model loads)."""

from __future__ import annotations

import importlib.util

import pytest
from transformers import Trainer

from fusedalign.cli import main
from fusedalign.configs import SFTConfig


@pytest.mark.parametrize("flag, value, message", [
    ("lr_scheduler_kwargs", "notjson",
     """lr_scheduler_kwargs must be a JSON object, e.g. '{"min_lr": 1e-6}'; got 'notjson' (Expecting value)"""),
    ("lr_scheduler_kwargs", "{bad",
     """lr_scheduler_kwargs must be a JSON object, e.g. '{"min_lr": 1e-6}'; got '{bad' (Expecting property name """
     "enclosed in double quotes)"),
    ("gradient_checkpointing_kwargs", "[1]",
     """gradient_checkpointing_kwargs must be a JSON object, e.g. '{"use_reentrant": false}'; got '[1]'"""),
    ("deepspeed", "{bad",
     "deepspeed must be a JSON object or a file's path; got '{bad' (Expecting property name enclosed in double "
     "quotes)"),
])
def test_a_dict_flag_that_is_not_a_json_object_is_named(tmp_path, flag, value, message):
    with pytest.raises(ValueError) as err:
        SFTConfig(output_dir=str(tmp_path), **{flag: value})
    assert str(err.value) == message


def test_json_dict_flags_keep_transformers_own_parsing(tmp_path):
    """The string is left to transformers, which also turns "false" inside it into False."""
    args = SFTConfig(output_dir=str(tmp_path), gradient_checkpointing=True,
                     gradient_checkpointing_kwargs='{"use_reentrant": "false"}',
                     lr_scheduler_kwargs='{"min_lr": 1e-6}')
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.lr_scheduler_kwargs == {"min_lr": 1e-6}


def test_an_optimizer_whose_package_is_missing_is_named(monkeypatch, tmp_path):
    def lookup(args, model=None):
        raise ImportError("You need to install `somepackage` in order to use it")

    monkeypatch.setattr(Trainer, "get_optimizer_cls_and_kwargs", staticmethod(lookup))
    with pytest.raises(ValueError) as err:
        SFTConfig(output_dir=str(tmp_path), optim="adamw_bnb_8bit")
    assert str(err.value) == "--optim adamw_bnb_8bit: You need to install `somepackage` in order to use it"


def test_what_the_optimizer_lookup_needs_the_model_for_is_left_to_the_trainer(monkeypatch, tmp_path):
    def lookup(args, model=None):
        raise ValueError("this optimizer needs the model")

    monkeypatch.setattr(Trainer, "get_optimizer_cls_and_kwargs", staticmethod(lookup))
    SFTConfig(output_dir=str(tmp_path), optim="adamw_torch")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed here")
def test_the_command_line_refuses_bitsandbytes_optimizers_without_it_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["sft", "--optim", "adamw_bnb_8bit", "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fusedalign sft: error: --optim adamw_bnb_8bit: You need to install `bitsandbytes`"), err
    assert not any("Traceback" in line for line in err) and not out.exists()
