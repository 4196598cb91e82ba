"""RLOOConfig: the arguments of `fusedalign rloo` and `RLOOTrainer`, with TRL 1.16's names and defaults.

RLOO shares GRPO's generation, rewards, batching and reference (so this class extends
GRPOConfig, with its departures from TRL's base defaults: bf16 where CUDA supports it,
logging every step, no gradient checkpointing, `max_prompt_length`), and differs in its
defaults (beta 0.05, num_generations 2), its advantage (`normalize_advantages`,
`reward_clip_range`) and its loss: one PPO-clipped ratio per completion, with no loss type,
importance-sampling level, entropy bonus or reward scaling. GRPO's flags that RLOO does not
have are hidden from `--help` and refused when set, naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from fusedalign.configs.grpo import GRPOConfig
from fusedalign.configs.packed import GROUPS_BUDGET_HELP

# GRPO's options with no meaning in RLOO (TRL's RLOOConfig has none of them): refused when set.
GRPO_ONLY = ("loss_type", "scale_rewards", "multi_objective_aggregation", "delta", "importance_sampling_level",
             "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
             "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "top_entropy_quantile", "entropy_coef")


def _hidden(default):
    return field(default=default, metadata={"help": argparse.SUPPRESS})


@dataclass
class RLOOConfig(GRPOConfig):
    """REINFORCE Leave-One-Out (Ahmadian et al., 2024) on GRPO's machinery."""

    output_dir: str | None = field(default="outputs/rloo")
    num_generations: int = field(default=2, metadata={"help": "Completions per prompt (G, >= 2): each one's "
                                                              "baseline is the mean reward of the other G - 1."})
    beta: float = field(default=0.05, metadata={"help": "KL coefficient: beta x each completion's summed "
                                                        "log-ratio to the reference is subtracted from its reward "
                                                        "before the baseline; 0 loads no reference model."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip of the sequence ratio: >= 1 - epsilon."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip 1 + epsilon_high (None: "
                                                                       "epsilon)."})
    normalize_advantages: bool = field(default=False, metadata={"help": "Z-score the advantages over the "
                                                                        "generation batch (std + 1e-4)."})
    reward_clip_range: list[float] | None = field(
        default=None, metadata={"help": "Clamp the weighted reward to [min, max] (two numbers) before the KL."})
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": GROUPS_BUDGET_HELP.format(note="")})
    # GRPO's loss options, hidden and refused (their GRPO defaults, which RLOO never reads).
    loss_type: str = _hidden("dapo")
    scale_rewards: str = _hidden("group")
    multi_objective_aggregation: str = _hidden("sum_then_normalize")
    delta: float | None = _hidden(None)
    importance_sampling_level: str = _hidden("token")
    use_bias_correction_kl: bool = _hidden(True)
    sapo_temperature_pos: float = _hidden(1.0)
    sapo_temperature_neg: float = _hidden(1.05)
    vespo_k_pos: float = _hidden(2.0)
    vespo_lambda_pos: float = _hidden(3.0)
    vespo_k_neg: float = _hidden(3.0)
    vespo_lambda_neg: float = _hidden(2.0)
    top_entropy_quantile: float = _hidden(1.0)
    entropy_coef: float = _hidden(0.0)

    def __post_init__(self):
        defaults = {f.name: f.default for f in fields(GRPOConfig) if f.name in GRPO_ONLY}
        for name in GRPO_ONLY:
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"--{name} is an option of GRPO's loss; RLOO has none (its loss is one clipped "
                                 f"ratio per completion: see `fusedalign rloo --help`).")
        if self.reward_clip_range is not None:
            clip = tuple(float(v) for v in self.reward_clip_range)
            if len(clip) != 2 or clip[0] > clip[1]:
                raise ValueError(f"reward_clip_range must be two numbers, min <= max; got {self.reward_clip_range!r}.")
            self.reward_clip_range = clip
        super().__post_init__()
