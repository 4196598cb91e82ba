"""Checkpoint offload (`--gradient_checkpointing_kwargs '{"offload": true}'`) is refused, in one line
before any model loads, where it cannot work: without an accelerator (pinning host memory needs
one; torch raised inside the first backward) and with a transformers that has no offload (the key
reached each layer's forward, where it was ignored)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fusedalign.configs import GRPOConfig
from fusedalign.configs import common

OFFLOAD = {"use_reentrant": False, "offload": True}
NO_ACCELERATOR = ("--gradient_checkpointing_kwargs offload: offload keeps what the checkpointed layers save in "
                  "pinned host memory, which needs a GPU (or another accelerator) and none is present; here the "
                  "activations are in host memory already: leave offload out.")


def _accelerator(monkeypatch, present: bool) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: present)


def test_offload_without_an_accelerator_is_refused(monkeypatch, tmp_path):
    _accelerator(monkeypatch, False)
    with pytest.raises(ValueError) as err:
        GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=True, gradient_checkpointing_kwargs=OFFLOAD)
    assert str(err.value) == NO_ACCELERATOR


def test_offload_as_json_is_read_as_the_command_line_gives_it(monkeypatch, tmp_path):
    _accelerator(monkeypatch, False)
    with pytest.raises(ValueError, match="offload keeps what the checkpointed layers save"):
        GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=True,
                   gradient_checkpointing_kwargs='{"use_reentrant": false, "offload": true}')


def test_offload_with_an_accelerator_and_offload_off_or_unused_are_accepted(monkeypatch, tmp_path):
    _accelerator(monkeypatch, True)
    args = GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=True, gradient_checkpointing_kwargs=OFFLOAD)
    assert args.gradient_checkpointing_kwargs["offload"] is True
    _accelerator(monkeypatch, False)
    GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=True,
               gradient_checkpointing_kwargs={"use_reentrant": False, "offload": False})
    GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing_kwargs=OFFLOAD)  # no checkpointing: nothing to offload


def test_a_transformers_without_offload_is_refused_by_its_version(monkeypatch, tmp_path):
    import transformers

    _accelerator(monkeypatch, True)
    monkeypatch.setattr(common, "transformers_offloads_checkpoints", lambda: False)
    with pytest.raises(ValueError) as err:
        GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=True, gradient_checkpointing_kwargs=OFFLOAD)
    assert str(err.value) == (
        f"--gradient_checkpointing_kwargs offload: this transformers ({transformers.__version__}) has no checkpoint "
        "offload, so the checkpointed activations would stay on the device; upgrade transformers, or leave offload "
        "out.")


def test_the_installed_transformers_offloads():
    """The switch the Trainer calls takes `offload` (transformers 5.17 and later, read in their code)."""
    assert common.transformers_offloads_checkpoints()


@pytest.mark.skipif(torch.accelerator.is_available(), reason="offload is accepted where an accelerator is present")
def test_the_command_line_refuses_it_in_one_line_and_writes_nothing(tmp_path):
    """A subprocess, as a user runs it: exit 2, one line on stderr (transformers' FutureWarnings on
    the flag's TRL name silenced too), no output directory."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "fusedalign", "grpo", "--gradient_checkpointing", "true",
                           "--gradient_checkpointing_kwargs", '{"use_reentrant": false, "offload": true}',
                           "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS=""))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"fusedalign grpo: error: {NO_ACCELERATOR}"], done.stderr
    assert not out.exists()
