"""DPOConfig: the arguments of `fusedalign dpo` and `DPOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fusedalign.configs.common import TRUNCATION_MODES, FusedAlignConfig, check_choice
from fusedalign.configs.packed import MAX_TOKENS_HELP, PAD_MULTIPLE_HELP, PADDING_FREE_HELP, check_packed_batching
from fusedalign.losses import DPO_LOSSES, DPOOptions, check_dpo_args


def resolve_pad_to_multiple_of(value: int | str | None) -> int | None:
    """TRL's `pad_to_multiple_of`: `auto` (its default) pads only on Neuron, so here it is None, no padding.

    The command line gives a string (`auto`, `none`, `8`); a number is checked by `check_packed_batching`.
    """
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in ("auto", "none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"pad_to_multiple_of must be a positive number of tokens, auto or None; got {value!r}."
        ) from None


@dataclass
class DPOConfig(FusedAlignConfig):
    """Direct Preference Optimization (Rafailov et al., 2023) and its variants."""

    output_dir: str | None = field(default="outputs/dpo")
    learning_rate: float = field(default=1e-6)
    beta: float = field(default=0.1, metadata={"help": "Temperature of the implicit reward; > 0."})
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": "One or more of: " + ", ".join(DPO_LOSSES) + "."},
    )
    loss_weights: list[float] | None = field(default=None, metadata={"help": "Weight of each loss_type."})
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "Assumed rate of flipped preference labels, in [0, 0.5]. With loss_type sigmoid it gives "
                  "conservative DPO (cDPO): -(1-eps) log sigmoid(beta h) - eps log sigmoid(-beta h); TRL 1.16 ignores "
                  "it for sigmoid (see the README's differences from TRL). robust, exo_pair, aot and aot_pair use "
                  "it as TRL does."},
    )
    discopop_tau: float = field(default=0.05)
    ld_alpha: float | None = field(
        default=None,
        metadata={"help": "LD-DPO (length desensitization): in each pair, the tokens of the longer completion past "
                  "the shorter one's length weigh ld_alpha in its log-prob, for the policy and the reference, in "
                  "every loss type but sft's token mean. In [0, 1]; 0 drops them; None or 1.0: every token weighs "
                  "1 (the same computation), TRL 1.16's default."},
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        metadata={"help": "The divergence to the reference (f-DPO): reverse_kl (DPO's), forward_kl, js_divergence "
                  "or alpha_divergence, each scoring the log-ratios by its f' in the reward difference. Another "
                  "than reverse_kl only with loss types built on that difference: sigmoid, sigmoid_norm, hinge, "
                  "ipo, exo_pair, robust, discopop, sft. The rewards logged stay beta * log-ratio, as TRL's."},
    )
    f_alpha_divergence_coef: float = field(
        default=0.5,
        metadata={"help": "alpha of f_divergence_type alpha_divergence (1.0: its limit, the reverse KL)."},
    )
    use_weighting: bool = field(
        default=False,
        metadata={"help": "WPO: multiply each pair's loss by w(chosen) * w(rejected), w(y) = exp of the mean over "
                  "y's completion tokens of log p(token) - log sum_v p_v^2 under the policy, without gradient "
                  "(TRL 1.16's use_weighting). Not with aot, aot_pair, aot_unpaired (they sort the pairs); the "
                  "loss-aware head stays off (the weights come from the same forward)."},
    )
    bco_running_mean: bool = field(
        default=False,
        metadata={"help": "bco_pair only: shift the rewards by the running mean of every reward seen, this batch "
                  "included (the BCO paper, and TRL before 1.x); kept in checkpoints, so a resumed run continues "
                  "it. Default off: TRL 1.16's bco_pair, no shift."},
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "Keep at most this many prompt tokens (its last ones), before max_length applies. "
                  "Default: no prompt limit, as TRL 1.16."},
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={"help": "Rows over max_length: keep_start (TRL 1.16's default) drops tokens from the end of the "
                  "completions (then of the prompt, if it alone is too long); keep_end drops them from the start "
                  "of the prompt. Either way chosen and rejected keep the same prompt tokens (see the README)."},
    )
    precompute_ref_log_probs: bool = field(default=False)
    reference_free: bool = field(default=False)
    ref_model_name_or_path: str | None = field(default=None, metadata={"help": "Default: the policy's own path."})
    loss_aware_head: bool = field(
        default=True,
        metadata={"help": "With the fused head, form the head's gradient in its forward from the DPO loss (the "
                  "reference runs first): three logits GEMMs instead of four, at the cost of one pair's logits "
                  "(a block of whole pairs) held during the head's forward. Every loss type but aot, aot_pair "
                  "(and bco_pair with bco_running_mean), and not with use_weighting. Same result; false runs the "
                  "per-token op."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": PADDING_FREE_HELP + " TRL 1.16 warns and falls back to padding; here it works with "
                  "every attention implementation that keeps sequences apart (flash attention as varlen)."},
    )
    share_prompt: bool = field(
        default=False,
        metadata={"help": "With padding_free: each pair's prompt once, its chosen and rejected branching from it "
                  "(p + c + r + 1 tokens instead of 2p + c + r), for the policy and the reference; the same "
                  "log-probs. Needs an attention implementation that takes a mask (flex_attention, sdpa, eager), "
                  "not flash attention."},
    )
    max_tokens_per_batch: int | None = field(
        default=None, metadata={"help": MAX_TOKENS_HELP.format(units="pairs", unit="pair")}
    )
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": PAD_MULTIPLE_HELP})

    def __post_init__(self):
        super().__post_init__()
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(self.pad_to_multiple_of)
        check_packed_batching(self, "pair")
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        # Every DPO option is validated here, once, before any model loads.
        self.loss_plan = check_dpo_args(
            self.loss_type, beta=self.beta, label_smoothing=self.label_smoothing, loss_weights=self.loss_weights,
            f_divergence_type=self.f_divergence_type, use_weighting=self.use_weighting,
        )
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must lie in [0, 1] (the weight of the tokens past the shorter completion) "
                             f"or be None; got {self.ld_alpha}.")
        check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)

    def loss_options(self, bco_delta: float = 0.0, sft_tokens_per_pair: Any = None) -> DPOOptions:
        """The options the loss functions read (`bco_delta`: bco_pair's current reward shift;
        `sft_tokens_per_pair`: the step's chosen tokens per pair, the divisor of the sft term)."""
        return DPOOptions(self.beta, self.label_smoothing, bco_delta, self.discopop_tau, sft_tokens_per_pair,
                          self.f_divergence_type, self.f_alpha_divergence_coef)

    @property
    def ld_weight(self) -> float | None:
        """LD-DPO's weight of the tokens past a pair's shared length; None: no weighting (ld_alpha None or 1.0)."""
        return None if self.ld_alpha is None or self.ld_alpha == 1.0 else float(self.ld_alpha)
