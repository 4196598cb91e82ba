"""The DPO benchmark's configurations: one named row of explicit options each.

A configuration says which trainer runs and with which options; nothing is parsed from
its name. `FIXED` are the configurations of the fixed-length comparison
(`e2e_dpo.py --lengths ...`), `REAL` those of the real-length mode
(`e2e_dpo.py --real_lengths ...`); their names are cited in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DPORun:
    """One configuration.

    Attributes:
        name: as given to `--configs`.
        trainer: "ours" (fusedalign.trainers.dpo.DPOTrainer) or "trl" (trl.DPOTrainer).
        fused_head: ours: the fused head (False: full logits). TRL 1.16 always scores
            through its own chunked head, so it is True there.
        liger_layers: Liger's RMSNorm/SwiGLU/RoPE kernels (ours: liger_kernels; TRL:
            use_liger_kernel, which in TRL 1.16 means these kernels only).
        compile_layers: ours: each decoder layer torch.compile'd.
        loss_aware_head: ours, fused: the head forms its gradient in the forward (the
            default); False runs the per-token head.
        padding_free: ours: DPOConfig.padding_free (rows concatenated, no padding).
        share_prompt: ours: DPOConfig.share_prompt (the prompt computed once per pair).
        token_budget: ours, padding-free: micro-batches of whole pairs up to
            --max_tokens_per_batch tokens (DPOConfig.max_tokens_per_batch), in the trainer's
            own order; the pairs of an optimizer step then vary around --pairs.
        attn: ours: the attention implementation the policy and reference load with
            (None: the trainer's default: sdpa, except padding-free rows on CUDA, which it
            moves to flex attention, fusedalign.attention.selection). On
            "flex_attention" packed rows attend through a BlockMask whose empty blocks
            (other sequences) the kernel skips, where sdpa takes a dense L x L mask.
        pad_to_multiple_of: ours: round each micro-batch's length up (DPOConfig.pad_to_multiple_of),
            so that compiled layers see few shapes.
        order: real-length mode only: "random" (one seeded permutation, the same for
            every configuration that asks for it) or "grouped" (TRL's
            group_by_length sampler); the fixed-length mode runs every row in order.
        checked: held to the first-steps agreement check (fixed-length mode).
        about: one line for the table's notes.
    """

    name: str
    trainer: str
    fused_head: bool = True
    liger_layers: bool = False
    compile_layers: bool = False
    loss_aware_head: bool = True
    padding_free: bool = False
    share_prompt: bool = False
    token_budget: bool = False
    attn: str | None = None
    pad_to_multiple_of: int | None = None
    order: str = "random"
    checked: bool = False
    about: str = ""

    def __post_init__(self):
        if self.trainer not in ("ours", "trl"):
            raise ValueError(f"{self.name}: trainer must be 'ours' or 'trl', got {self.trainer!r}")
        if self.order not in ("random", "grouped"):
            raise ValueError(f"{self.name}: order must be 'random' or 'grouped', got {self.order!r}")
        if self.trainer == "trl" and (self.compile_layers or self.padding_free or self.share_prompt
                                      or self.token_budget or not self.fused_head or not self.loss_aware_head
                                      or self.attn or self.pad_to_multiple_of):
            raise ValueError(f"{self.name}: compile_layers, padding_free, share_prompt, token_budget, "
                             "fused_head=False, loss_aware_head=False, attn and pad_to_multiple_of are options of ours, not of TRL's DPOTrainer")
        if self.order == "grouped" and self.trainer != "trl":
            raise ValueError(f"{self.name}: 'grouped' order is TRL's length-grouped sampler")
        if (self.share_prompt or self.token_budget) and not self.padding_free:
            raise ValueError(f"{self.name}: share_prompt and token_budget pack the pairs' rows, so they need "
                             "padding_free")

    @property
    def is_trl(self) -> bool:
        return self.trainer == "trl"


def _table(*runs: DPORun) -> dict[str, DPORun]:
    return {r.name: r for r in runs}


FIXED = _table(
    DPORun("ours_fused", "ours", checked=True, about="fused head (loss-aware), the default"),
    DPORun("ours_fused_liger", "ours", liger_layers=True, about="ours fused + Liger's layer kernels"),
    DPORun("ours_fused_compile", "ours", compile_layers=True, checked=True,
           about="ours fused, decoder layers torch.compile'd"),
    DPORun("ours_fused_compile_liger", "ours", liger_layers=True, compile_layers=True, about="both of the above"),
    DPORun("ours_fused_compile_pertoken", "ours", compile_layers=True, loss_aware_head=False, checked=True,
           about="ours_fused_compile with the per-token head (four logits GEMMs, not three)"),
    DPORun("ours_unfused", "ours", fused_head=False, checked=True, about="full logits (the oracle path)"),
    DPORun("trl", "trl", checked=True, about="trl.DPOTrainer (its own chunked head)"),
    DPORun("trl_liger", "trl", liger_layers=True, about="trl.DPOTrainer, use_liger_kernel=True"),
)

REAL = _table(
    DPORun("trl", "trl", about="TRL without Liger, padded, random order (not run unless named)"),
    DPORun("trl_grouped", "trl", order="grouped", about="TRL without Liger, length-grouped (not run unless named)"),
    DPORun("trl_liger", "trl", liger_layers=True, about="TRL + Liger, padded, random order"),
    DPORun("trl_liger_grouped", "trl", liger_layers=True, order="grouped",
           about="TRL + Liger, padded, train_sampling_strategy='group_by_length' over a `length` column"),
    DPORun("ours_fused_compile", "ours", compile_layers=True, about="ours, padded, random order"),
    DPORun("ours_padding_free", "ours", compile_layers=True, padding_free=True, token_budget=True,
           about="ours, padding_free=True, max_tokens_per_batch"),
    DPORun("ours_shared_prompt", "ours", compile_layers=True, padding_free=True, share_prompt=True, token_budget=True,
           about="ours, padding-free with the prompt computed once per pair (share_prompt=True), max_tokens_per_batch"),
    DPORun("ours_padding_free_flex", "ours", compile_layers=True, padding_free=True, token_budget=True,
           attn="flex_attention", pad_to_multiple_of=1024,
           about="ours_padding_free on flex_attention, micro-batches rounded up to a multiple of 1,024 tokens"),
    DPORun("ours_shared_prompt_flex", "ours", compile_layers=True, padding_free=True, share_prompt=True,
           token_budget=True, attn="flex_attention", pad_to_multiple_of=1024,
           about="ours_shared_prompt on flex_attention (BlockMask), micro-batches rounded up to a multiple of 1,024"),
    DPORun("ours_padding_free_fixed", "ours", compile_layers=True, padding_free=True,
           about="ours, padding_free=True, --per_device_train_batch_size pairs a micro-batch (not run unless named)"),
    DPORun("ours_shared_prompt_fixed", "ours", compile_layers=True, padding_free=True, share_prompt=True,
           about="ours, share_prompt=True, --per_device_train_batch_size pairs a micro-batch (not run unless named)"),
    # Like for like with TRL + Liger at the same micro-batch (--per_device_train_batch_size 8, then 16):
    DPORun("ours_padding_free_fixed_flex", "ours", compile_layers=True, padding_free=True, attn="flex_attention",
           pad_to_multiple_of=1024,
           about="ours_padding_free_fixed on flex_attention, rows rounded up to a multiple of 1,024 (not run unless named)"),
    DPORun("ours_shared_prompt_fixed_flex", "ours", compile_layers=True, padding_free=True, share_prompt=True,
           attn="flex_attention", pad_to_multiple_of=1024,
           about="ours_shared_prompt_fixed on flex_attention, rows rounded up to a multiple of 1,024 (not run unless named)"),
    DPORun("ours_padding_free_fixed_sdpa", "ours", compile_layers=True, padding_free=True, attn="sdpa",
           about="ours_padding_free_fixed kept on sdpa (its dense row mask; the 0.50x row of 2026-12-04) (not run unless named)"),
)

REAL_DEFAULT = ("trl_liger", "trl_liger_grouped", "ours_fused_compile", "ours_padding_free", "ours_shared_prompt")
ALL_NAMES = tuple(dict.fromkeys([*FIXED, *REAL]))
SEARCH_DEFAULT = ("ours_fused", "trl_liger")  # --max_length_search and --memory_fit
BASELINES = ("trl_liger", "trl")               # the ratios' denominator, first that ran
