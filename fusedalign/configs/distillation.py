"""DistillationConfig: the arguments of `fusedalign distillation` and `DistillationTrainer`, TRL 1.16's names and defaults.

On-policy distillation samples completions from the student exactly as GRPO samples them
(so this class extends GRPOConfig and keeps its generation flags, their TRL defaults and
checks, and GRPO's departures from TRL's base defaults: bf16 only where CUDA supports it,
logging every step, no gradient checkpointing, `max_prompt_length`), with TRL 1.16's
`DistillationConfig` on top:

- `teacher_model_name_or_path` (with `teacher_model_revision`, `teacher_model_init_kwargs`):
  the teacher whose next-token distribution the student learns; it must share the student's
  tokenizer.
- `beta` (default 1.0) selects the divergence, not a KL penalty: 0 forward KL(teacher ||
  student), 1 reverse KL(student || teacher), in between the generalised JSD
  (`losses/distillation.py`).
- `temperature` divides both models' logits in the loss as well as the student's in sampling.
- one completion per prompt; the generation batch is the optimizer step's batch
  (per-device batch x ranks x gradient_accumulation_steps), generated once per step and used
  once (TRL: no num_generations, steps_per_generation, num_iterations).
- `padding_free` and `max_tokens_per_batch` (TRL 1.16 has neither) as for GRPO: each
  micro-batch's prompt + completion sequences in one row, the teacher and the student reading
  the same row; `share_prompt` is refused (one completion per prompt: nothing to share).

GRPO's reward, advantage, loss and reference flags mean nothing here: they are hidden from
`--help` and refused when set, naming the flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from fusedalign.configs.common import _init_kwargs, check_attention_available, check_init_dtype
from fusedalign.configs.grpo import GRPOConfig
from fusedalign.configs.packed import PADDING_FREE_HELP

# GRPO's options with no meaning in distillation (TRL's DistillationConfig has none of them).
GRPO_ONLY = ("reward_funcs", "reward_model_name_or_path", "reward_weights", "multi_objective_aggregation",
             "scale_rewards", "num_generations", "num_generations_eval", "mask_truncated_completions", "loss_type", "epsilon", "epsilon_high", "delta",
             "importance_sampling_level", "num_iterations", "use_bias_correction_kl", "sapo_temperature_pos",
             "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
             "top_entropy_quantile", "entropy_coef", "ref_model_name_or_path")


def _hidden(default):
    return field(default=default, metadata={"help": argparse.SUPPRESS})


@dataclass
class DistillationConfig(GRPOConfig):
    """On-policy distillation (Agarwal et al., 2023, GKD's generalised JSD) on GRPO's generation machinery."""

    output_dir: str | None = field(default="outputs/distillation")
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The teacher: builtin:<name>, a local path or a hub id; it must use the "
                                "student's tokenizer (its head may have more, padded, rows when beta > 0)."})
    teacher_model_revision: str | None = field(default=None, metadata={"help": "Revision of a hub teacher."})
    teacher_model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "More keyword arguments of the teacher's from_pretrained: a dict, or its JSON "
                                "('{\"dtype\": \"bfloat16\"}' on the command line)."})
    beta: float = field(default=1.0, metadata={"help": "The divergence: 0 forward KL(teacher || student), 0.5 JSD, "
                                                       "1 reverse KL(student || teacher); in [0, 1]. Not a KL "
                                                       "penalty: there is no reference model."})
    temperature: float = field(default=1.0, metadata={"help": "Divides the logits in sampling and, for both "
                                                              "models, in the loss."})
    # ---------------------------------------------------------------- packed rows (TRL 1.16 has none of these)
    padding_free: bool = field(
        default=False,
        metadata={"help": PADDING_FREE_HELP + " Each micro-batch's prompt + completion sequences are one row; the "
                  "teacher's forward and the student's read the same row."})
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": "With padding_free: the prompts and completions of each optimizer step (the same ones as "
                  "padded batches) are packed into rows of at most this many tokens, one row a micro-batch where the "
                  "step's gradient_accumulation_steps forwards hold them, else each micro-batch trained as several "
                  "rows, one forward and backward each, so memory stays that of one row. Same "
                  "update as padded batches. Must hold one prompt of max_prompt_length and a completion of "
                  "max_completion_length."})
    share_prompt: bool = _hidden(False)  # refused: one completion per prompt
    log_completions: bool = field(
        default=False, metadata={"help": "At each logging step, print a table of the prompts and completions "
                                 "generated since the last one and append them to OUTPUT_DIR/completions.jsonl."})
    # GRPO's options, hidden and refused (the values distillation runs with).
    num_generations: int = _hidden(1)
    num_generations_eval: int | None = _hidden(None)
    generation_batch_size: int | None = _hidden(None)
    steps_per_generation: int | None = _hidden(None)
    mask_truncated_completions: bool = _hidden(False)
    reward_funcs: list[str] | None = _hidden(None)
    reward_model_name_or_path: str | None = _hidden(None)
    reward_weights: list[float] | None = _hidden(None)
    multi_objective_aggregation: str = _hidden("sum_then_normalize")
    scale_rewards: str = _hidden("group")
    loss_type: str = _hidden("dapo")
    epsilon: float = _hidden(0.2)
    epsilon_high: float | None = _hidden(None)
    delta: float | None = _hidden(None)
    importance_sampling_level: str = _hidden("token")
    num_iterations: int = _hidden(1)
    use_bias_correction_kl: bool = _hidden(True)
    sapo_temperature_pos: float = _hidden(1.0)
    sapo_temperature_neg: float = _hidden(1.05)
    vespo_k_pos: float = _hidden(2.0)
    vespo_lambda_pos: float = _hidden(3.0)
    vespo_k_neg: float = _hidden(3.0)
    vespo_lambda_neg: float = _hidden(2.0)
    top_entropy_quantile: float = _hidden(1.0)
    entropy_coef: float = _hidden(0.0)
    ref_model_name_or_path: str | None = _hidden(None)

    def __post_init__(self):
        defaults = {f.name: f.default for f in fields(DistillationConfig) if f.name in GRPO_ONLY}
        for name in GRPO_ONLY:
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"--{name} is an option of GRPO; distillation has none (one completion per prompt, "
                                 "scored by the teacher: see `fusedalign distillation --help`).")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] (0 forward KL, 0.5 JSD, 1 reverse KL); got {self.beta!r}.")
        self.teacher_model_init_kwargs = _init_kwargs(self.teacher_model_init_kwargs, "teacher_model_init_kwargs")
        check_init_dtype(self.teacher_model_init_kwargs, "teacher_model_init_kwargs")
        check_attention_available((self.teacher_model_init_kwargs or {}).get("attn_implementation"),
                                  "teacher_model_init_kwargs attn_implementation")
        super().__post_init__()

    def _check_packed(self) -> None:
        """GRPO's packed-row checks, less `share_prompt`: one completion per prompt leaves nothing to share."""
        if self.share_prompt:
            raise ValueError("--share_prompt: distillation samples one completion per prompt, so a prompt is never "
                             "repeated in a micro-batch and there is nothing to share; drop the flag (--padding_free "
                             "already runs each prompt once through each model).")
        super()._check_packed()

    def _check_batches(self) -> None:
        """TRL's generation batch: the optimizer step's prompts, one completion each, used once."""
        if self.auto_find_batch_size:
            raise ValueError("auto_find_batch_size is not supported by distillation: the completions of a step are "
                             "generated at its start; lower per_device_train_batch_size instead.")
        steps = self.gradient_accumulation_steps
        size = self.per_device_train_batch_size * self.world_size * steps
        # Set here; a value given (or left by an earlier __post_init__) must be this one.
        for flag, value, wanted in (("steps_per_generation", self.steps_per_generation, steps),
                                    ("generation_batch_size", self.generation_batch_size, size)):
            if value not in (None, wanted):
                raise ValueError(f"--{flag} is an option of GRPO; distillation generates once per optimizer step "
                                 f"(per_device_train_batch_size x ranks x gradient_accumulation_steps prompts).")
        self.steps_per_generation, self.generation_batch_size = steps, size
