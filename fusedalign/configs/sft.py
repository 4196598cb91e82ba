"""SFTConfig: the arguments of `fusedalign sft` and `SFTTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from fusedalign.configs.common import TRUNCATION_MODES, FusedAlignConfig, check_choice


@dataclass
class SFTConfig(FusedAlignConfig):
    """Supervised fine-tuning on language-modeling or prompt-completion data."""

    output_dir: str | None = field(default="outputs/sft")
    learning_rate: float = field(default=2e-5)
    dataset_text_field: str = field(
        default="text",
        metadata={"help": "The column that holds a language-modeling dataset's text (TRL's default, text); "
                  "conversational data (messages) has none."},
    )
    completion_only_loss: bool | None = field(
        default=None,
        metadata={"help": "Learn the completion tokens only (True: prompt-completion data only) or every token "
                  "(False). None (default): the completion for prompt-completion data, every token for "
                  "language-modeling data."},
    )
    assistant_only_loss: bool = field(
        default=False,
        metadata={"help": "Conversational data: learn only the assistant tokens, as marked by the chat "
                  "template's {% generation %} blocks."},
    )
    truncation_mode: str = field(
        default="keep_start", metadata={"help": "Rows over max_length keep their first (keep_start) or last (keep_end) tokens."}
    )
    packing: bool = field(
        default=False,
        metadata={"help": "Pack several sequences into each row of max_length tokens (best-fit decreasing); "
                  "batches are padding-free, and packed sequences never attend to each other."},
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Concatenate each batch into one row with position_ids and no padding (implied by --packing)."},
    )
    eval_packing: bool | None = field(
        default=None,
        metadata={"help": "TRL's flag: the eval split is packed exactly when the training split is, so None "
                  "(default, as TRL: the value of --packing) or the value of --packing."},
    )

    disable_dropout: bool = field(
        default=False,
        metadata={"help": "SFT keeps the model's dropout and --lora_dropout, as TRL's SFT does; "
                  "True sets every dropout probability to 0."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        if self.eval_packing is not None and self.eval_packing != self.packing:
            raise ValueError(f"eval_packing={self.eval_packing} with packing={self.packing}: the eval split is packed "
                             "exactly when the training split is (TRL's default, eval_packing None); drop "
                             "--eval_packing.")
        if self.packing and self.max_length is None:
            raise ValueError("packing needs max_length (the length of a packed row); set --max_length.")
