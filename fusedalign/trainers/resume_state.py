"""What the base writes into every checkpoint beside the Trainer's, and how it reads it back.

Components registered with `checkpointed(name, obj)` (`ComponentStates`,
`trainers/component_states.py`) are saved with the RNG states, which every rank writes before
`trainer_state.json` (whose presence marks a complete checkpoint), and loaded with the
optimizer. The RNG states of a resumed checkpoint are restored once, by whichever comes first:
the Trainer, or the base's `get_batch_samples` before the first resumed step's preparation
(the Trainer restores them only after fetching the step's batches, and GRPO samples while
preparing). A mixin of `FusedAlignTrainer` (`trainers/base.py`), which creates `_components`
and `_rng_pending`; the pending input tokens are folded into the state before it is saved
(`num_input_tokens_seen`, `trainers/step_logging.py`).
"""

from __future__ import annotations

from typing import Any


class ResumeState:
    """Registered components and RNG states, saved in every checkpoint and restored on resume."""

    def checkpointed(self, name: str, component: Any, per_rank: bool = False) -> Any:
        """Registers a component whose `state_dict()` goes into every checkpoint (and returns it).

        Shared components are written once (JSON); `per_rank` ones by every rank (torch.save,
        tensors allowed), each read back by the same rank with `load_state_dict(state,
        same_ranks=...)`, `same_ranks` False when another number of ranks wrote it (rank 0's
        state is then given to every rank; the component refuses what it cannot resume).
        """
        return self._components.register(name, component, per_rank)

    def _save_checkpoint(self, model, trial) -> None:
        _ = self.num_input_tokens_seen  # fold pending tokens into the state it saves
        super()._save_checkpoint(model, trial)

    def _save_rng_state(self, output_dir: str) -> None:
        """Every rank passes here before `trainer_state.json` (whose presence marks a complete
        checkpoint) is written: the components' states go in with the RNG states."""
        super()._save_rng_state(output_dir)
        self._components.save(output_dir, self.accelerator, self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint:
            self._components.load(checkpoint, self.accelerator)
        self._fusedalign_last_logged = self.state.global_step
        self._rng_pending = checkpoint

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Restores the checkpoint's RNG states once, whichever of Trainer and `get_batch_samples`
        (before the first resumed step's preparation) comes first."""
        if checkpoint is not None and checkpoint == self._rng_pending:
            super()._load_rng_state(checkpoint)
            self._rng_pending = None
