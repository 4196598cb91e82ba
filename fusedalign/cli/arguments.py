"""Flags of the command line itself (not of a trainer)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunArguments:
    """What the command does with an output directory that already holds a run."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start a new run in an --output_dir that already holds one: the old run's files are "
                  "first moved to OUTPUT_DIR.previous-<time> (nothing is deleted). Without it, a non-empty "
                  "--output_dir is refused unless --resume_from_checkpoint is given."},
    )
