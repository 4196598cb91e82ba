"""Distillation's rollout: GRPO's, with no rewards, no advantages and no fixed log-probs.

The student samples completions exactly as GRPO's policy does (`trainers/grpo_rollout.py`:
keyed sampling and replay by (dataset row, 0) keys, generation on whole weights, the
generation counter and the window being served saved per rank in every checkpoint), one
completion per prompt, a generation batch per optimizer step. What GRPO does next has no
counterpart here: the teacher scores the completions inside the loss (both heads fused in
one forward each), so a window's micro-batches need no reward, no advantage, and no old-policy
or reference log-probs (a generation is always trained on by the policy that sampled it:
`DistillationConfig.needs_old_logps` is False). The micro-batches keep GRPO's type, with zero
advantages, so the window and its checkpoint are GRPO's; the trainer turns each into a
`DistillationBatch` when it is served.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fusedalign.distributed import generation_weights
from fusedalign.trainers.grpo_batch import GRPOMicroBatch
from fusedalign.trainers.grpo_rollout import GRPORollout
from fusedalign.trainers.rollout_types import CompletionMetrics


class DistillationRollout(GRPORollout):
    """GRPORollout without rewards; see the module docstring.

    Args:
        args: the DistillationConfig.
        generator: a `fusedalign.generation.Generator`.
        tokenizer, accelerator, metrics: as GRPORollout's.
        train_split, eval_split: the formats of the splits (None: no such split).
    """

    def __init__(self, args: Any, generator: Any, tokenizer: Any, accelerator: Any, metrics: Any,
                 train_split: Any, eval_split: Any):
        super().__init__(args, generator, None, tokenizer, accelerator, metrics, score=None, reference=None,
                         train_split=train_split, eval_split=eval_split, advantages=_NoAdvantages())

    def _generate(self, model: Any, rows: list[dict[str, Any]], mode: str, key: int,
                  trainer_state: Any) -> list[GRPOMicroBatch]:
        """Generates `rows` (this rank's share, one completion each) and cuts them into micro-batches."""
        acc = self.accelerator
        keys = [(int(r["row_index"]), 0) for r in rows]  # one completion per prompt: generation index 0
        prompt_ids = [list(r["prompt_ids"]) for r in rows]
        start = time.perf_counter()
        with generation_weights(model, acc) as whole:
            out = self.generator.generate(whole, prompt_ids, keys, step=key)
        seconds = time.perf_counter() - start
        truncated = torch.tensor(out.truncated)
        batches, _ = self._cut(model, rows, prompt_ids, out, truncated, mode, key)
        lengths = torch.tensor([len(c) for c in out.completion_ids])
        self.metrics.record(mode, [CompletionMetrics.of(lengths, truncated, seconds)])
        if mode == "train":
            completions = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
            nothing = torch.full((len(rows),), float("nan"))  # no rewards, no advantage: logged as None
            self.completion_log.add(trainer_state.global_step + 1, [r["prompt"] for r in rows], completions,
                                    nothing[:, None][:, :0], [], nothing)
        return [b for b, _ in batches]

    def _with_fixed_logps(self, model: Any, batch: GRPOMicroBatch, mode: str) -> tuple[GRPOMicroBatch, None]:
        """Nothing is fixed at generation: the teacher runs in the loss, the sampler is the trained policy."""
        return batch, None


class _NoAdvantages:
    """The rollout's strategy slot, never called (distillation has no rewards)."""

    kl_in_reward = False

    def __call__(self, *args: Any) -> Any:
        raise RuntimeError("distillation has no rewards, hence no advantages")
