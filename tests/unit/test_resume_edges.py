"""Resuming at the edges: a run already complete, a checkpoint holding the weights alone, a
generation batch of another shape, the completions log of an interrupted run, and a checkpoint
taken from another directory. Each refusal is one line (exit 2) that changes nothing on disk."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from fusedalign.cli import main
from fusedalign.cli.output_dir import check_resume, resolve_resume
from fusedalign.errors import CLIError

SFT = ["--eval_strategy", "no"]  # the demo's constant learning rate: a longer run is the shorter one continued
GRPO = ["--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
        "--logging_steps", "1", "--reward_funcs", "tests.unit.test_resume_edges.interrupting_reward"]
STOP = {"at": None}  # the step whose generation sends this process SIGINT (a Ctrl-C mid-run)


def interrupting_reward(completions, trainer_state=None, **kwargs):
    """A reward of the completions' length; interrupts the run while generating for step STOP["at"]."""
    if STOP["at"] is not None and trainer_state.global_step + 1 == STOP["at"]:
        os.kill(os.getpid(), signal.SIGINT)
    return [len(c) / 8.0 for c in completions]


def _tree(root) -> dict[str, bytes]:
    """Every file under `root` with its bytes (what a command must leave alone)."""
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files}


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train_records(out) -> dict[int, dict]:
    records = [r for r in _records(out / "metrics.jsonl") if "loss" in r]
    assert len({r["step"] for r in records}) == len(records)  # no step logged twice
    return {r["step"]: r for r in records}


def _only_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ a run already complete


def test_a_complete_run_resumed_with_its_flags_changes_nothing(tmp_path, capsys):
    """A requeued job that adds `--resume_from_checkpoint last` to a finished run: one line, exit 0, and
    the Trainer is not asked to take a step past max_steps (it would write checkpoint-4 and a new model)."""
    out = tmp_path / "run"
    flags = [*SFT, "--max_steps", "3", "--save_steps", "3", "--output_dir", str(out)]
    assert main(["sft", *flags]) == 0
    before = _tree(tmp_path)
    for resume, extra in (("last", []), (str(out / "checkpoint-3"), []), ("last", ["--max_steps", "2"])):
        capsys.readouterr()
        assert main(["sft", *flags, *extra, "--resume_from_checkpoint", resume]) == 0
        err = capsys.readouterr().err
        (line,) = [line for line in err.splitlines() if "already complete" in line]
        assert f"the run is already complete at step 3 (max_steps 3); its model is in {out}." in line
        assert _tree(tmp_path) == before  # byte for byte: no checkpoint-4, no new model, metrics.jsonl unchanged


def test_fusedalign_launch_starts_no_process_for_a_complete_run(tmp_path, capsys, monkeypatch):
    """Under `fusedalign launch` the pre-check finds the run complete: one line, exit 0, nothing started."""
    import subprocess

    out = tmp_path / "run"
    flags = [*SFT, "--max_steps", "2", "--save_steps", "2", "--output_dir", str(out)]
    assert main(["sft", *flags]) == 0
    before = _tree(tmp_path)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    capsys.readouterr()
    assert main(["launch", "--config_file", "configs/accelerate/cpu/ddp.yaml", "sft", *flags,
                 "--resume_from_checkpoint", "last"]) == 0
    assert "the run is already complete at step 2" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_a_complete_run_given_more_steps_trains_on_as_the_longer_run(tmp_path, capsys):
    """A larger --max_steps extends a finished run: steps 4 and 5 are those of a 5-step run (constant
    learning rate), each logged once, and it ends on that run's weights."""
    longer, run = tmp_path / "longer", tmp_path / "run"
    assert main(["sft", *SFT, "--max_steps", "5", "--save_steps", "3", "--output_dir", str(longer)]) == 0
    assert main(["sft", *SFT, "--max_steps", "3", "--save_steps", "3", "--output_dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["sft", *SFT, "--max_steps", "5", "--save_steps", "3", "--output_dir", str(run),
                 "--resume_from_checkpoint", "last"]) == 0
    assert "already complete" not in capsys.readouterr().err
    want, got = _train_records(longer), _train_records(run)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in got:
        assert {k: got[step][k] for k in ("loss", "grad_norm", "epoch")} == \
               {k: want[step][k] for k in ("loss", "grad_norm", "epoch")}, step
    assert (run / "checkpoint-5" / "trainer_state.json").is_file()
    want_weights, got_weights = load_file(longer / "model.safetensors"), load_file(run / "model.safetensors")
    assert all(torch.equal(got_weights[k], v) for k, v in want_weights.items())


def test_a_checkpoint_past_the_flags_end_is_refused(tmp_path, capsys):
    """checkpoint-2 of a 3-step run, resumed with --max_steps 1: nothing to train, and not a finished run."""
    out = tmp_path / "run"
    assert main(["sft", *SFT, "--max_steps", "3", "--save_steps", "1", "--output_dir", str(out)]) == 0
    before = _tree(tmp_path)
    capsys.readouterr()
    assert main(["sft", *SFT, "--max_steps", "1", "--output_dir", str(out),
                 "--resume_from_checkpoint", str(out / "checkpoint-2")]) == 2
    line = _only_line(capsys.readouterr().err)
    assert (f"--max_steps 1: --resume_from_checkpoint {out / 'checkpoint-2'} is already at step 2 (its run was set "
            "to 3 steps), so there is nothing to train; give a --max_steps above 2") in line
    assert _tree(tmp_path) == before


def _fake_checkpoint(path, *, files=("rng_state.pth",), **state):
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps(state))
    for name in files:
        (path / name).write_bytes(b"")
    return str(path)


def _args(checkpoint, max_steps=-1, num_train_epochs=3.0):
    return SimpleNamespace(resume_from_checkpoint=checkpoint, max_steps=max_steps, num_train_epochs=num_train_epochs)


def test_an_epoch_run_is_complete_until_more_epochs_are_asked(tmp_path):
    """Without --max_steps the run's end is its epoch count (the state's `epoch` reaches it exactly)."""
    done = _fake_checkpoint(tmp_path / "run" / "checkpoint-18", global_step=18, max_steps=18, epoch=3.0,
                            num_train_epochs=3)
    assert "already complete at step 18 (max_steps 18)" in check_resume(done, _args(done))
    assert check_resume(done, _args(done, num_train_epochs=4.0)) is None  # extended: trains on
    assert check_resume(done, _args(done, max_steps=20)) is None
    assert "already complete" in check_resume(done, _args(done, max_steps=18))
    # Its final model was never saved beside it: the checkpoint holds the weights.
    assert check_resume(done, _args(done)).split("its model is in ")[1].startswith(f"{done}.")
    halfway = _fake_checkpoint(tmp_path / "run" / "checkpoint-9", global_step=9, max_steps=18, epoch=1.5,
                               num_train_epochs=3)
    assert check_resume(halfway, _args(halfway)) is None
    with pytest.raises(CLIError, match=r"^--num_train_epochs 1.0: .* already at step 9 .* above 1.5 to train on"):
        check_resume(halfway, _args(halfway, num_train_epochs=1.0))


# ---------------------------------------------------------- the weights alone (save_only_model)


def test_a_save_only_model_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    """It lacks the optimizer, scheduler, RNG and generation states, so a resume would be another run."""
    out = tmp_path / "run"
    flags = [*SFT, "--max_steps", "2", "--save_steps", "1", "--save_only_model", "true", "--output_dir", str(out)]
    assert main(["sft", *flags]) == 0
    checkpoint = out / "checkpoint-1"
    assert not any(name.startswith(("rng_state", "optimizer")) for name in os.listdir(checkpoint))
    before = _tree(tmp_path)
    capsys.readouterr()
    assert main(["sft", *flags, "--resume_from_checkpoint", str(checkpoint)]) == 2
    line = _only_line(capsys.readouterr().err)
    assert f"--resume_from_checkpoint {checkpoint}: this checkpoint holds the weights alone" in line
    assert "--save_only_model true" in line and line.endswith(f"--model_name_or_path {checkpoint}.")
    assert _tree(tmp_path) == before
    # Refused where the flag is resolved, which `fusedalign launch` does in one process before any starts.
    with pytest.raises(CLIError, match="holds the weights alone"):
        resolve_resume(str(checkpoint), str(out))
    # The finished run's last checkpoint, requeued: complete, nothing to refuse.
    assert main(["sft", *flags, "--resume_from_checkpoint", "last"]) == 0
    assert "already complete at step 2" in capsys.readouterr().err
    # ... but training on from it is refused.
    assert main(["sft", *flags, "--max_steps", "4", "--resume_from_checkpoint", "last"]) == 2
    line = _only_line(capsys.readouterr().err)
    assert f"--resume_from_checkpoint last ({out / 'checkpoint-2'}): this checkpoint holds the weights alone" in line
    assert _tree(tmp_path) == before


def test_the_rng_state_of_every_layout_marks_a_whole_checkpoint(tmp_path):
    """One process writes rng_state.pth; several (DDP, ZeRO, FSDP2) rng_state_<rank>.pth beside their own
    model and optimizer layout; a save_only_model checkpoint has neither."""
    single = _fake_checkpoint(tmp_path / "a" / "checkpoint-1", global_step=1, max_steps=4)
    ranks = _fake_checkpoint(tmp_path / "b" / "checkpoint-1", global_step=1, max_steps=4,
                             files=("rng_state_0.pth", "rng_state_1.pth", "latest", "fusedalign_rank0.pt"))
    (tmp_path / "b" / "checkpoint-1" / "global_step1").mkdir()  # ZeRO's optimizer shards
    for checkpoint in (single, ranks):
        assert resolve_resume(checkpoint, str(tmp_path)) == checkpoint
    weights = _fake_checkpoint(tmp_path / "c" / "checkpoint-1", global_step=1, max_steps=4,
                               files=("model.safetensors", "config.json", "fusedalign_rank0.pt"))
    with pytest.raises(CLIError, match=r"^--resume_from_checkpoint last \(.*checkpoint-1\): this checkpoint holds"):
        resolve_resume("last", str(tmp_path / "c"))
    with pytest.raises(CLIError, match="holds the weights alone"):
        resolve_resume(weights, str(tmp_path))


# ------------------------------------------------------------- GRPO: completions and batch shape


def test_completions_log_of_an_interrupted_run_resumed_equals_the_uninterrupted_one(tmp_path, capsys):
    """Ctrl-C during step 9 (checkpoint-5 lies inside a window: num_iterations 2 generates at steps 1, 3,
    5, 7, 9): completions.jsonl keeps the rows up to step 5, the rows of step 7 go aside with the
    metrics records of steps 6 to 8, and the resumed run appends exactly the uninterrupted run's rows."""
    flags = [*GRPO, "--log_completions", "--num_completions_to_print", "0", "--max_steps", "10",
             "--save_steps", "5"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert main(["grpo", *flags, "--output_dir", str(straight)]) == 0
    STOP["at"] = 9
    try:
        assert main(["grpo", *flags, "--output_dir", str(run)]) == 130
    finally:
        STOP["at"] = None
    before = _records(run / "completions.jsonl")
    assert sorted({r["step"] for r in before}) == [1, 3, 5, 7] and not (run / "checkpoint-10").exists()
    capsys.readouterr()
    assert main(["grpo", *flags, "--output_dir", str(run), "--resume_from_checkpoint", "last"]) == 0
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "moved to" in line]
    assert "3 metrics.jsonl records, 8 completions.jsonl records" in line
    assert "the whole earlier metrics.jsonl and completions.jsonl are there too" in line
    assert _records(run / "completions.jsonl") == _records(straight / "completions.jsonl")
    (aside,) = tmp_path.glob("run.previous-*")
    assert _records(aside / "completions.jsonl") == before


def test_a_generation_batch_of_another_shape_is_refused(tmp_path, capsys):
    """The window saved in checkpoint-1 holds groups of 4 completions, and the epoch counts its batches."""
    out = tmp_path / "run"
    flags = [*GRPO, "--max_steps", "2", "--save_steps", "1", "--output_dir", str(out)]
    assert main(["grpo", *flags]) == 0
    before = _tree(tmp_path)
    checkpoint = out / "checkpoint-1"
    for flag, value, saved in (("num_generations", "2", 4), ("gradient_accumulation_steps", "2", 1),
                               ("num_iterations", "1", 2)):
        capsys.readouterr()
        assert main(["grpo", *flags, f"--{flag}", value, "--resume_from_checkpoint", str(checkpoint)]) == 2
        line = _only_line(capsys.readouterr().err)
        assert (f"--{flag} {value}: --resume_from_checkpoint {checkpoint} was written with {flag} {saved}, "
                f"which shapes its generation batches") in line, line
        assert line.endswith(f"resume with --{flag} {saved}, or start a new run from its weights with "
                             f"--model_name_or_path {checkpoint}.")
    assert _tree(tmp_path) == before


# ------------------------------------------------------------- a checkpoint of another directory


def test_resuming_from_another_directorys_checkpoint_says_where_the_first_steps_are(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["sft", *SFT, "--max_steps", "3", "--save_steps", "2", "--output_dir", str(first)]) == 0
    capsys.readouterr()
    assert main(["sft", *SFT, "--max_steps", "3", "--output_dir", str(second),
                 "--resume_from_checkpoint", str(first / "checkpoint-2")]) == 0
    err = capsys.readouterr().err
    assert (f"[fusedalign] resuming from {first / 'checkpoint-2'}, outside --output_dir: "
            f"{second / 'metrics.jsonl'} starts at step 3; steps 1-2 are logged in {first / 'metrics.jsonl'}.") in err
    assert sorted(_train_records(second)) == [3]
