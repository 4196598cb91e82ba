"""The states of a trainer's components, written into every checkpoint and read back on resume.

Shared components (one state for the run, e.g. a running reward mean) go to
`fusedalign_state.json`, written by the process that saves; per-rank ones (e.g. GRPO's
generation window on that rank) to `fusedalign_rank<R>.pt`, written by every rank. Both are
written with the RNG states, before `trainer_state.json`, whose presence marks a complete
checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

STATE_FILE = "fusedalign_state.json"  # checkpointed components, beside trainer_state.json
RANK_STATE_FILE = "fusedalign_rank{rank}.pt"  # per-rank checkpointed components


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed as asked (e.g. with another number of ranks mid-window)."""


class ComponentStates:
    """The registered components: name -> object with `state_dict()` / `load_state_dict()`."""

    def __init__(self):
        self.shared: dict[str, Any] = {}
        self.per_rank: dict[str, Any] = {}

    def register(self, name: str, component: Any, per_rank: bool = False) -> Any:
        (self.per_rank if per_rank else self.shared)[name] = component
        return component

    def save(self, output_dir: str, accelerator: Any, should_save: bool) -> None:
        os.makedirs(output_dir, exist_ok=True)
        if self.shared and should_save:
            state = {name: component.state_dict() for name, component in self.shared.items()}
            with open(os.path.join(output_dir, STATE_FILE), "w") as f:
                json.dump(state, f, indent=1)
        if self.per_rank:
            state = {name: component.state_dict() for name, component in self.per_rank.items()}
            state["num_processes"] = accelerator.num_processes
            torch.save(state, os.path.join(output_dir, RANK_STATE_FILE.format(rank=accelerator.process_index)))

    def load(self, checkpoint: str, accelerator: Any) -> None:
        path = os.path.join(checkpoint, STATE_FILE)
        if self.shared and os.path.isfile(path):
            with open(path) as f:
                state = json.load(f)
            for name, component in self.shared.items():
                if name in state:
                    component.load_state_dict(state[name])
        if self.per_rank:
            self._load_per_rank(checkpoint, accelerator)

    def _load_per_rank(self, checkpoint: str, accelerator: Any) -> None:
        """This rank's states; rank 0's when another number of ranks wrote the checkpoint."""
        path = os.path.join(checkpoint, RANK_STATE_FILE.format(rank=accelerator.process_index))
        if not os.path.isfile(path):
            path = os.path.join(checkpoint, RANK_STATE_FILE.format(rank=0))
            if not os.path.isfile(path):
                return  # a checkpoint written before these states existed
        state = torch.load(path, map_location="cpu", weights_only=False)
        same_ranks = state.pop("num_processes", None) == accelerator.num_processes
        for name, component in self.per_rank.items():
            if name in state:
                component.load_state_dict(state[name], same_ranks=same_ranks)
