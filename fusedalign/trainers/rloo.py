"""RLOOTrainer: GRPO's rollout with a leave-one-out advantage, and RLOO's sequence-ratio loss.

Everything up to the advantages is GRPO's (`trainers/grpo.py`, `trainers/grpo_rollout.py`):
the sampler, generation on whole weights, rewards gathered over ranks, the typed micro-batches,
the window served `num_iterations` times and checkpointed per rank. RLOO differs in two places:

- the advantage (`LeaveOneOut`, the rollout's strategy): with beta != 0 the rollout computes,
  at generation, the policy's and the reference's log-probs of every micro-batch through the
  fused head, and each completion's summed log-ratio, times beta, is taken off its reward
  before the leave-one-out baseline (TRL 1.16: the KL is a per-sequence reward penalty, not
  a loss term; the micro-batch carries no reference log-probs);
- the loss (`losses/rloo.py`): a PPO clip on the ratio of whole-sequence log-probs, one term
  per completion, normalised by the optimizer step's sequences over every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fusedalign.configs import RLOOConfig
from fusedalign.losses import Advantages, GRPOLossMetrics, rloo_advantages, rloo_loss
from fusedalign.trainers.grpo import GRPOTrainer
from fusedalign.trainers.grpo_batch import GRPOMicroBatch


@dataclass(frozen=True)
class LeaveOneOut:
    """RLOO's advantage strategy for the rollout (`losses.rloo_advantages`, TRL 1.16's options)."""

    beta: float
    reward_clip_range: tuple[float, float] | None
    normalize_advantages: bool
    kl_in_reward: bool = True

    def __call__(self, rewards: torch.Tensor, weights: torch.Tensor, num_generations: int,
                 sequence_kl: torch.Tensor | None) -> Advantages:
        return rloo_advantages(rewards, weights, num_generations, sequence_kl, beta=self.beta,
                               reward_clip_range=self.reward_clip_range,
                               normalize_advantages=self.normalize_advantages)


class RLOOTrainer(GRPOTrainer):
    """REINFORCE Leave-One-Out with the fused output head.

    Takes GRPOTrainer's arguments (model, reward_funcs, args, train_dataset, eval_dataset,
    processing_class, peft_config, callbacks, ref_model, generator), with an RLOOConfig.
    The reference (a model, or the policy with its adapter disabled under PEFT) is loaded
    only when beta != 0, and only read at generation.
    """

    def __init__(self, model, reward_funcs=None, args: RLOOConfig | None = None, **kwargs):
        args = args or RLOOConfig()
        if not isinstance(args, RLOOConfig):
            raise TypeError(f"RLOOTrainer takes an RLOOConfig; got {type(args).__name__}")
        super().__init__(model, reward_funcs, args, **kwargs)

    def advantage_strategy(self, args: RLOOConfig) -> LeaveOneOut:
        return LeaveOneOut(args.beta, args.reward_clip_range, args.normalize_advantages)

    def prepare_step(self, model: nn.Module, batches: list, mode: str) -> list[GRPOMicroBatch]:
        return self.served(self.serve(model, batches, mode))

    def count_items(self, inputs: GRPOMicroBatch) -> torch.Tensor:
        """Sequences: TRL means the per-sequence losses of each micro-batch."""
        return torch.tensor(float(inputs.loss_mask.shape[0]), device=inputs.loss_mask.device)

    def loss_and_metrics(self, model: nn.Module, inputs: GRPOMicroBatch,
                         mode: str) -> tuple[torch.Tensor, GRPOLossMetrics]:
        args = self.args
        batch = inputs.require(old_logps=mode == "train" and args.needs_old_logps, ref_logps=False,
                               entropy_weight=False)
        out = self.token_logprobs(model, *batch.forward_args(model), entropy=True)
        result = rloo_loss(batch.per_completion(out.logps), batch.loss_mask, batch.advantages,
                           old_logps=batch.old_logps, epsilon=args.epsilon, epsilon_high=args.epsilon_high,
                           entropy=batch.per_completion(out.entropy))
        return result.loss_sum, result.metrics
