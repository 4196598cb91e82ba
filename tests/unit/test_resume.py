"""Counters the trainers own continue from a checkpoint: num_tokens (in the Trainer state) and
components registered with `checkpointed` (bco_pair's running mean is tested with the DPO
numerics). A resumed run logs what the uninterrupted run logged."""

from __future__ import annotations

import pytest

from fusedalign.configs import SFTConfig
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model
from fusedalign.trainers.sft import SFTTrainer


def _run(out, resume=None, **overrides):
    args = SFTConfig(output_dir=str(out), max_steps=3, learning_rate=1e-3, per_device_train_batch_size=4,
                     logging_steps=1, save_strategy="steps", save_steps=1, train_sampling_strategy="sequential",
                     seed=0, disable_tqdm=True, report_to="none", **overrides)
    trainer = SFTTrainer(load_model("builtin:tiny-qwen2"), args=args,
                         train_dataset=load_dataset_any("builtin:zen", "standard_language_modeling").select(range(16)))
    trainer.train(resume_from_checkpoint=resume)
    return {e["step"]: e for e in trainer.state.log_history if "loss" in e}


@pytest.mark.parametrize("padding_free", [False, True])
def test_sft_num_tokens_continues_from_the_checkpoint(tmp_path, padding_free):
    straight = _run(tmp_path / "a", padding_free=padding_free)
    _run(tmp_path / "b", padding_free=padding_free)
    resumed = _run(tmp_path / "b", resume=str(tmp_path / "b" / "checkpoint-1"), padding_free=padding_free)
    assert sorted(resumed) == [1, 2, 3]  # step 1 from the checkpoint's state, 2 and 3 trained again
    assert straight[1]["num_tokens"] < straight[2]["num_tokens"] < straight[3]["num_tokens"]
    for step in (2, 3):
        assert resumed[step]["num_tokens"] == straight[step]["num_tokens"]
        assert resumed[step]["loss"] == pytest.approx(straight[step]["loss"], rel=1e-5)
