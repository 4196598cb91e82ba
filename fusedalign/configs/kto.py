"""KTOConfig: the arguments of `fusedalign kto` and `KTOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from fusedalign.configs.common import TRUNCATION_MODES, FusedAlignConfig, check_choice
from fusedalign.configs.dpo import resolve_pad_to_multiple_of
from fusedalign.configs.packed import MAX_TOKENS_HELP, PAD_MULTIPLE_HELP, PADDING_FREE_HELP, check_packed_batching
from fusedalign.losses import KTO_LOSSES, KTOOptions, check_kto_args


@dataclass
class KTOConfig(FusedAlignConfig):
    """Kahneman-Tversky Optimization (Ethayarajh et al., 2024) on unpaired preference data.

    KTO has no reference-free mode: its implied reward is log pi(y|x) - log pi_ref(y|x)
    and its reference point z0 is a KL divergence from the reference, so both need a
    reference model (a separate one, or the policy with its PEFT adapter disabled, or
    reference log-probs precomputed before training).
    """

    output_dir: str | None = field(default="outputs/kto")
    learning_rate: float = field(default=1e-6)
    beta: float = field(default=0.1, metadata={"help": "Temperature of the implied reward; > 0."})
    desirable_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of the losses of desirable examples (lambda_D). With unbalanced classes, "
                  "keep (desirable_weight * n_desirable) / (undesirable_weight * n_undesirable) in [1, 4/3]."},
    )
    undesirable_weight: float = field(default=1.0, metadata={"help": "Weight of the losses of undesirable examples (lambda_U)."})
    loss_type: str = field(default="kto", metadata={"help": "One of: " + ", ".join(KTO_LOSSES) + "."})
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "Keep at most this many prompt tokens (its last ones). Default: no limit, as TRL 1.16."},
    )
    max_completion_length: int | None = field(default=None)
    truncation_mode: str = field(
        default="keep_start",
        metadata={"help": "Rows over max_length: keep_start (TRL 1.16's behaviour) drops tokens from the end; "
                  "keep_end from the start of the prompt. A row and its KL pair keep the same prompt tokens."},
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute the reference log-probs of every row (its completion and its KL pair) in one "
                  "pass before they are needed, and drop the reference forward from training."},
    )
    ref_model_name_or_path: str | None = field(default=None, metadata={"help": "Default: the policy's own path."})
    unpair_preference: bool = field(
        default=False,
        metadata={"help": "Accept paired preference data (prompt/chosen/rejected) and train on it unpaired: "
                  "each pair becomes a desirable and an undesirable example."},
    )
    padding_free: bool = field(default=False, metadata={"help": PADDING_FREE_HELP + " (TRL's KTO has no such flag.)"})
    share_prompt: bool = field(
        default=False,
        metadata={"help": "With padding_free: the reference's one forward over each completion and its KL partner "
                  "computes their shared prompt once. (The policy's two forwards, with and without gradient, are "
                  "separate rows and gain nothing.) Needs flex_attention, sdpa or eager attention."},
    )
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": MAX_TOKENS_HELP.format(units="examples", unit="example") + " An example counts with its "
                  "KL partner (the reference's joint row), the longest row a micro-batch runs."},
    )
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": PAD_MULTIPLE_HELP})

    def __post_init__(self):
        super().__post_init__()
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        check_packed_batching(self, "example")
        # Every KTO option is validated here, once, before any model loads.
        check_kto_args(
            self.loss_type, beta=self.beta, desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
        check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        self._check_kl_batch()

    @property
    def uses_kl(self) -> bool:
        """Whether the loss needs the KL reference point z0 (apo_zero_unpaired does not)."""
        return self.loss_type == "kto"

    def loss_options(self) -> KTOOptions:
        return KTOOptions(self.beta, self.desirable_weight, self.undesirable_weight, self.loss_type)

    def _check_kl_batch(self) -> None:
        """z0 is a mean over the mismatched pairs of a step: at least 2 examples per optimizer step.

        (TRL asks for a per-device batch >= 2 because it pairs within the micro-batch, where a
        batch of 1 pairs a row with itself; here pairs are fixed per row, so accumulating
        per-device batches of 1 is fine, but a step of one example would set z0 from one sample.)
        """
        if self.max_tokens_per_batch is not None:
            return  # a token budget fills each micro-batch with as many examples as fit
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
        if self.uses_kl and per_step < 2:
            raise ValueError(
                "KTO (loss_type='kto') estimates its KL reference point as a mean over the mismatched prompt/completion "
                f"pairs of each optimizer step, which needs at least 2 examples per step; got per_device_train_batch_size="
                f"{self.per_device_train_batch_size} x gradient_accumulation_steps={self.gradient_accumulation_steps} x "
                f"{self.world_size} process(es) = {per_step}. Use per_device_train_batch_size >= 2 (or accumulate "
                "several micro-batches); loss_type='apo_zero_unpaired' has no KL term."
            )
