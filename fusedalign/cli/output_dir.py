"""One run per output directory: refuse to mix runs, resume one, or move an old one aside.

As the transformers example scripts did with `--overwrite_output_dir`: a non-empty
`--output_dir` is refused unless the user asks to resume (`--resume_from_checkpoint
PATH|last|true`) or to start over (`--overwrite_output_dir`). The check runs before
anything slow; starting over moves the old run's files to `OUTPUT_DIR.previous-<time>`
once the new run is built and about to train (so a bad flag or row leaves the old run
where it was), and nothing is ever deleted: checkpoint names never collide with an
older run's.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

from fusedalign.errors import CLIError

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"  # written last in a checkpoint: its presence marks a complete one


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
        return found
    if not os.path.isfile(os.path.join(value, STATE_FILE)):
        what = "does not exist" if not os.path.exists(value) else f"has no {STATE_FILE}"
        raise CLIError(f"--resume_from_checkpoint {value}: {what}; expected a checkpoint-N directory, or `last`.")
    return value


def _describe(output_dir: str) -> str:
    found = checkpoints(output_dir)
    entries = sorted(os.listdir(output_dir))
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    if found:
        return f"a run with {len(found)} checkpoint(s), the last {os.path.basename(found[-1])} ({shown})"
    return f"files of an earlier run ({shown})"


def move_aside(output_dir: str) -> str:
    """Moves the contents of `output_dir` to a new sibling directory and returns its path."""
    base = os.path.normpath(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = f"{base}.previous-{stamp}", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{base}.previous-{stamp}-{n}"
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
