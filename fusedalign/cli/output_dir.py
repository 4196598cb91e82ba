"""One run per output directory: refuse to mix runs, resume one, or move an old one aside.

As the transformers example scripts did with `--overwrite_output_dir`: a non-empty
`--output_dir` is refused unless the user asks to resume (`--resume_from_checkpoint
PATH|last|true`) or to start over (`--overwrite_output_dir`). The check runs before
anything slow; starting over moves the old run's files to `OUTPUT_DIR.previous-<time>`
once the new run is built and about to train (so a bad flag or row leaves the old run
where it was), and nothing is ever deleted: checkpoint names never collide with an
older run's.

Resuming from a checkpoint earlier than what the directory holds abandons the rest of
that run: the resumed run would cut the metrics log back to the checkpoint's step and
write its own checkpoint-N and final model over the later ones. What lies past the
checkpoint is therefore moved to an `OUTPUT_DIR.previous-<time>` directory first, at
the same moment and in the same way as an overwritten run. The step-keyed logs
(metrics.jsonl, completions.jsonl) keep their records up to the checkpoint's step.

Before anything moves, `check_resume` refuses what cannot continue the run as it would
have gone (a checkpoint holding the weights alone, a generation batch of another shape,
a step count the checkpoint is already past) and recognises a run that is already
complete: the Trainer would train one more step past its end and replace its model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from typing import Any

from fusedalign.errors import CLIError

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"  # written last in a checkpoint: its presence marks a complete one
METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"  # --log_completions (fusedalign.trainers.grpo_completions.FILE)
STEP_LOGS = (METRICS_FILE, COMPLETIONS_FILE)  # JSON lines with a `step`: cut back to the checkpoint's on resume
_RNG_STATE = re.compile(r"^rng_state(_\d+)?\.pth$")  # the Trainer's, one a rank; absent under save_only_model
# Flags that shape a generating trainer's batch: the saved generation window and the epoch count follow them.
GENERATION_SHAPE = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                    "steps_per_generation", "num_iterations")
_EARLIER_LOG = re.compile(r"^(metrics|completions)\.previous-\d+\.jsonl$")  # an earlier run's log, which no run writes again


def checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoint directories in `output_dir` (those with trainer_state.json), oldest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def last_checkpoint(output_dir: str) -> str | None:
    found = checkpoints(output_dir)
    return found[-1] if found else None


def trainer_state(checkpoint: str) -> dict[str, Any]:
    """A checkpoint's trainer_state.json (`global_step` an int)."""
    try:
        with open(os.path.join(checkpoint, STATE_FILE)) as f:
            state = json.load(f)
        return {**state, "global_step": int(state["global_step"])}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CLIError(f"--resume_from_checkpoint {checkpoint}: unreadable {STATE_FILE} ({err}); "
                       "expected the one the Trainer wrote.") from None


def checkpoint_step(checkpoint: str) -> int:
    """The step a checkpoint was saved at: the `global_step` of its trainer_state.json."""
    return trainer_state(checkpoint)["global_step"]


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """`--resume_from_checkpoint` as a checkpoint directory: a path, or `last`/`true` (the latest one)."""
    if value is None or value.strip().lower() in ("", "false", "no", "none"):
        return None
    if value.strip().lower() in ("last", "latest", "true", "yes"):
        found = last_checkpoint(output_dir)
        if found is None:
            raise CLIError(
                f"--resume_from_checkpoint {value}: {output_dir} holds no complete checkpoint-N directory "
                "(one with trainer_state.json); start a new run instead, or pass a checkpoint directory."
            )
        _refuse_weights_only(value, found, unless_finished=True)
        return found
    if not os.path.isfile(os.path.join(value, STATE_FILE)):
        what = "does not exist" if not os.path.exists(value) else f"has no {STATE_FILE}"
        raise CLIError(f"--resume_from_checkpoint {value}: {what}; expected a checkpoint-N directory, or `last`.")
    _refuse_weights_only(value, value, unless_finished=True)
    return value


def _refuse_weights_only(value: str, checkpoint: str, unless_finished: bool = False) -> None:
    """A `--save_only_model` checkpoint has no optimizer, scheduler, RNG or generation state to resume.

    With `unless_finished`, a checkpoint at its run's end passes: `check_resume` decides whether there is
    anything to train (a finished run's requeued job has nothing to do and exits 0).
    """
    if any(_RNG_STATE.match(name) for name in os.listdir(checkpoint)):
        return
    if unless_finished:
        state = trainer_state(checkpoint)
        if state["global_step"] >= state.get("max_steps", float("inf")):
            return
    raise CLIError(
        f"{_named(value, checkpoint)}: this checkpoint holds the weights alone, as --save_only_model true saves "
        "them: no optimizer, scheduler, RNG or generation state (no rng_state*.pth), so a resumed run would not "
        f"train as the uninterrupted one; start a new run from its weights with --model_name_or_path {checkpoint}."
    )


def _named(value: str, checkpoint: str) -> str:
    """The flag as given, with the checkpoint it names when that is not the value itself (`last`)."""
    return f"--resume_from_checkpoint {value}" + (f" ({checkpoint})" if value != checkpoint else "")


def check_resume(checkpoint: str, args: Any) -> str | None:
    """Whether the run can go on from `checkpoint` as the flags ask; called on every rank before loading.

    Returns:
        The line to print when the run the checkpoint belongs to is complete and the flags ask for no more
        steps (nothing is to be trained, moved or written), else None: resume.

    Raises:
        CLIError: the checkpoint is past the flags' end, holds the weights alone, or was written with
            another shape of generation batch.
    """
    state = trainer_state(checkpoint)
    step, planned = state["global_step"], state.get("max_steps")
    named = _named(args.resume_from_checkpoint, checkpoint)
    if args.max_steps > 0:
        reached, asked = step >= args.max_steps, f"--max_steps {args.max_steps}"
        more = f"a --max_steps above {step}"
    else:
        epoch = float(state.get("epoch") or 0.0)
        reached, asked = epoch >= args.num_train_epochs - 1e-6, f"--num_train_epochs {args.num_train_epochs}"
        more = f"a --num_train_epochs above {epoch:g}"
    if reached:
        if planned is None or step < planned:
            raise CLIError(f"{asked}: {named} is already at step {step} (its run was set to {planned} steps), "
                           f"so there is nothing to train; give {more} to train on from it, or resume from an "
                           "earlier checkpoint.")
        return (f"[fusedalign] {named}: the run is already complete at step {step} (max_steps {planned}); "
                f"its model is in {_final_model_dir(checkpoint)}. Nothing was trained, moved or written; "
                f"give {more} to train on.")
    _refuse_weights_only(args.resume_from_checkpoint, checkpoint)
    _refuse_other_shape(checkpoint, args)
    return None


_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "adapter_model.safetensors")


def _final_model_dir(checkpoint: str) -> str:
    """Where a complete run's model is: its output directory once saved there, else the checkpoint."""
    parent = os.path.dirname(os.path.normpath(checkpoint)) or "."
    return parent if any(os.path.isfile(os.path.join(parent, f)) for f in _MODEL_FILES) else checkpoint


def _refuse_other_shape(checkpoint: str, args: Any) -> None:
    """A generating trainer's checkpoint resumes only with the batch shape it was written with (its
    training_args.bin says which): the window in progress holds completions of that shape, and the
    epoch counter is counted in its batches."""
    if not all(hasattr(args, name) for name in GENERATION_SHAPE):
        return
    saved = _saved_args(checkpoint)
    for name in GENERATION_SHAPE:
        before, now = getattr(saved, name, None), getattr(args, name)
        if before is not None and before != now:
            raise CLIError(
                f"--{name} {now}: {_named(args.resume_from_checkpoint, checkpoint)} was written with {name} "
                f"{before}, which shapes its generation batches (the window in progress and the epoch count); "
                f"resume with --{name} {before}, or start a new run from its weights with --model_name_or_path "
                f"{checkpoint}."
            )


def _saved_args(checkpoint: str) -> Any:
    """The TrainingArguments the Trainer pickled into the checkpoint; None when absent or unreadable."""
    path = os.path.join(checkpoint, "training_args.bin")
    if not os.path.isfile(path):
        return None
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # written by another version: the shapes cannot be compared, the Trainer goes on
        return None


def _describe(output_dir: str) -> str:
    found = checkpoints(output_dir)
    entries = sorted(os.listdir(output_dir))
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    if found:
        return f"a run with {len(found)} checkpoint(s), the last {os.path.basename(found[-1])} ({shown})"
    return f"files of an earlier run ({shown})"


def _aside_path(output_dir: str) -> str:
    """A new sibling of `output_dir`, `OUTPUT_DIR.previous-<date>-<time>`, that does not exist yet."""
    base = os.path.normpath(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = f"{base}.previous-{stamp}", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{base}.previous-{stamp}-{n}"
    return aside


def move_aside(output_dir: str) -> str:
    """Moves the contents of `output_dir` to a new sibling directory and returns its path."""
    base = os.path.normpath(output_dir)
    aside = _aside_path(base)
    try:
        os.rename(base, aside)
        os.makedirs(base)
    except OSError:  # a mount point or the working directory: move its entries instead
        os.makedirs(aside)
        for name in os.listdir(base):
            os.rename(os.path.join(base, name), os.path.join(aside, name))
    return aside


def _holds_files(output_dir: str) -> bool:
    return os.path.isdir(output_dir) and bool(os.listdir(output_dir))


def check_output_dir(output_dir: str, *, resume: str | None, overwrite: bool) -> bool:
    """Applies the one-run-per-directory rule; returns whether an old run must be moved aside.

    Called on every rank before anything is loaded or written, so all reach the same verdict.

    Raises:
        CLIError: `output_dir` holds files and neither a resume nor an overwrite was asked.
    """
    if not _holds_files(output_dir) or resume is not None:
        return False
    if overwrite:
        return True
    last = last_checkpoint(output_dir)
    resume_hint = f"--resume_from_checkpoint last to continue it from {os.path.basename(last)}, " if last else ""
    raise CLIError(
        f"--output_dir {output_dir} already holds {_describe(output_dir)}; give {resume_hint}"
        "--overwrite_output_dir to start a new run there (the old files are moved aside, not deleted), "
        "or another --output_dir."
    )


def move_old_run_aside(args: Any) -> None:
    """Just before training: the saving process moves the old run aside while the others wait."""
    with args.main_process_first(local=args.save_on_each_node, desc="moving the earlier run aside"):
        if args.should_save and _holds_files(args.output_dir):
            aside = move_aside(args.output_dir)
            print(f"[fusedalign] --overwrite_output_dir: the earlier run in {args.output_dir} was moved to {aside} "
                  "(nothing deleted).", file=sys.stderr)


def _records_past(log: str, step: int) -> int:
    """How many records of a step-keyed log are past `step` (lines cut short by a kill are not records)."""
    count = 0
    with open(log) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            count += isinstance(record, dict) and record.get("step", 0) > step
    return count


def _kept_on_resume(output_dir: str, checkpoint: str, step: int, name: str) -> bool:
    """Whether an entry of `output_dir` belongs to the run up to `step`, resumed from `checkpoint`."""
    match = _CHECKPOINT.match(name)
    if match:
        return int(match.group(1)) <= step
    inside = os.path.relpath(os.path.realpath(checkpoint), os.path.realpath(output_dir))
    return name in (*STEP_LOGS, inside.split(os.sep)[0]) or bool(_EARLIER_LOG.match(name))


def move_past_checkpoint(output_dir: str, checkpoint: str) -> str | None:
    """Moves aside what `output_dir` holds past `checkpoint`'s step, before a run resumes from it.

    The later checkpoint-N directories and every other file of the run but its step-keyed
    logs (its final model, tokenizer, curves) are moved to `OUTPUT_DIR.previous-<time>`;
    each log (metrics.jsonl, completions.jsonl) is copied there whole and then cut back to
    the checkpoint's step, so that the resumed run appends exactly what the uninterrupted
    one logged after it.

    Returns:
        The line that tells the user what was moved where, or None when nothing lies past the checkpoint.
    """
    if not os.path.isdir(output_dir):
        return None
    step = checkpoint_step(checkpoint)
    logs = [name for name in STEP_LOGS if os.path.isfile(os.path.join(output_dir, name))]
    dropped = {name: _records_past(os.path.join(output_dir, name), step) for name in logs}
    later = sorted(name for name in os.listdir(output_dir)
                   if _CHECKPOINT.match(name) and int(_CHECKPOINT.match(name).group(1)) > step)
    if not later and not any(dropped.values()):
        return None  # the checkpoint is the run's latest state: resuming abandons nothing
    others = sorted(name for name in os.listdir(output_dir)
                    if name not in later and not _kept_on_resume(output_dir, checkpoint, step, name))
    aside = _aside_path(output_dir)
    os.makedirs(aside)
    for name in later + others:
        os.rename(os.path.join(output_dir, name), os.path.join(aside, name))
    from fusedalign.trainers.callbacks import keep_until_step

    for name in logs:
        shutil.copy2(os.path.join(output_dir, name), os.path.join(aside, name))
        keep_until_step(os.path.join(output_dir, name), step)
    moved = later + [_count(n, f"{name} record") for name, n in dropped.items() if n]
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    moved += [f"{_count(len(others), 'other file')} of the run ({shown})"] * bool(others)
    whole = f"; the whole earlier {' and '.join(logs)} {'are' if len(logs) > 1 else 'is'} there too" if logs else ""
    return (f"[fusedalign] resuming from step {step}: what {output_dir} held past it was moved to {aside} "
            f"(nothing deleted): {', '.join(moved)}{whole}.")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def move_past_checkpoint_aside(args: Any, checkpoint: str) -> None:
    """Just before a resumed run trains: the saving process moves aside what lies past its checkpoint."""
    with args.main_process_first(local=args.save_on_each_node, desc="moving aside what lies past the checkpoint"):
        if args.should_save:
            report = move_past_checkpoint(args.output_dir, checkpoint)
            if report:
                print(report, file=sys.stderr)
    if args.process_index == 0:
        note = elsewhere_note(args.output_dir, checkpoint)
        if note:
            print(note, file=sys.stderr)


def elsewhere_note(output_dir: str, checkpoint: str) -> str | None:
    """The line saying where the first steps are logged when the checkpoint is another directory's."""
    inside = os.path.relpath(os.path.realpath(checkpoint), os.path.realpath(output_dir))
    if inside != ".." and not inside.startswith(".." + os.sep):
        return None
    step = checkpoint_step(checkpoint)
    earlier = os.path.join(os.path.dirname(os.path.normpath(checkpoint)), METRICS_FILE)
    where = f"are logged in {earlier}" if os.path.isfile(earlier) else "are not in it"
    return (f"[fusedalign] resuming from {checkpoint}, outside --output_dir: {os.path.join(output_dir, METRICS_FILE)} "
            f"starts at step {step + 1}; steps 1-{step} {where}.")
