"""Ctrl-C (SIGINT) and SIGTERM: stop cleanly, never in the middle of writing a checkpoint.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread is; one raised
inside `Trainer._save_checkpoint` leaves a checkpoint without its trainer_state.json
(or a half-written model), which `--resume_from_checkpoint last` must then skip. The
guard below lets a signal raise at once, except between the moment the Trainer
decides to save (`control.should_save` after a step or an epoch) and `on_save`: a
signal there is held until the checkpoint is complete. Under `accelerate launch` the
launcher forwards SIGTERM to each process; it is treated the same way.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Iterator

from transformers import TrainerCallback


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class InterruptGuard(TrainerCallback):
    """Turns SIGINT/SIGTERM into `Interrupted`, held back while a checkpoint is being written."""

    def __init__(self) -> None:
        self.saving = False
        self.pending: int | None = None

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.saving:
            if self.pending is None:
                print("[fusedalign] interrupt received: stopping once the checkpoint being written is complete.",
                      file=sys.stderr)
            self.pending = signum
            return
        raise Interrupted(signum)

    def _set_saving(self, saving: bool) -> None:
        self.saving = saving
        if not saving and self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)

    @contextlib.contextmanager
    def protect(self) -> Iterator[None]:
        """Holds signals back for the duration of a write outside the Trainer (the final save)."""
        self._set_saving(True)
        try:
            yield
        finally:
            self._set_saving(False)

    # The Trainer's default flow callback runs first, so `control` already says whether it will save.
    def on_step_begin(self, args, state, control, **kwargs):
        self._set_saving(False)

    def on_step_end(self, args, state, control, **kwargs):
        self._set_saving(bool(control.should_save))

    def on_epoch_end(self, args, state, control, **kwargs):
        self._set_saving(bool(control.should_save))

    def on_evaluate(self, args, state, control, **kwargs):
        # save_strategy "best" decides after the evaluation whether to save.
        self._set_saving(self.saving or args.save_strategy == "best")

    def on_save(self, args, state, control, **kwargs):
        self._set_saving(False)

    def on_train_end(self, args, state, control, **kwargs):
        self._set_saving(False)
