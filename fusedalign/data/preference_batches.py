"""Preference batches at real lengths: padding-free rows, the prompt computed once.

Design note (how the layouts, masks and labels fit together, and what a trainer does).

**A row is a list of segments.** A segment is a run of tokens with consecutive positions
from its `start`; it sees its own earlier tokens and all of one other segment, its parent
(the mask rule is in `fusedalign.attention.masks`). A micro-batch is one row `[1, L]`:

- padding-free (`share_prompt=False`): per pair, two root segments, prompt + chosen and
  prompt + rejected, each from position 0. Without a parent, the mask is the one
  transformers builds from restarting `position_ids` itself, so these rows run on every
  attention implementation (flash kernels as varlen) with no explicit mask.
- shared prompt (`share_prompt=True`): per pair, a prefix segment prompt[:p-1] at
  positions 0..p-2, then two branches, each the *last prompt token* followed by one
  completion, both at positions p-1.., both with the prefix as parent:

      [ x_0 .. x_{p-2} | x_{p-1} c_0 .. c_{n-1} | x_{p-1} r_0 .. r_{m-1} ]
        prefix            chosen branch            rejected branch

  Why the last prompt token opens each branch: the first rejected token is predicted from
  the last prompt token's output, and in a shared row that output already predicts the
  first chosen token (one label a position). So each branch carries its own copy, and the
  copies are the only last-prompt token a branch sees: a rejected segment that also saw the
  chosen branch's copy (a mask that hides only the chosen *completion*) would find that key
  twice in its softmax. Proof that every log-prob equals the unshared one: by induction over
  layers, each shared position has the hidden state of its unshared counterpart (prefix ->
  prompt[:p-1], a branch's copy -> prompt[p-1] of that row, completion tokens -> themselves).
  A position's next state depends on its own state, its position, and the (key, value,
  position) set it attends to; a branch position attends to prefix + its earlier branch
  tokens, which map one to one, with the same positions, onto what its counterpart attends
  to (prompt + earlier completion tokens); attention is invariant to the order of keys.
  The cost is one token a pair: p + c + r + 1 tokens instead of 2p + c + r. (p = 0: two
  roots, as padding-free; p = 1: no prefix, two branches of the one prompt token.)
- several pairs a row: pairs follow each other, every segment id unique to its pair, so no
  pair sees another. `pad_to_multiple_of` appends one padding segment that sees only itself.
- KTO (`kto_batch`): the same with a completion and its KL partner (`kl_completion_ids`,
  which the KTO trainer pairs with the row's own prompt) as the two completions. The
  policy's KL forward is a no-grad pass separate from its forward over the completions
  (kept apart, the KL tokens hold no activations for backward), so sharing pays in the
  reference's one forward over both (`PackedKTOCollator`'s `joint_` rows).

**Labels** are position-aligned as `data.position_labels` gives them: `labels[t]` is the
next token of t's own segment when that token is a completion token, -100 otherwise, so no
label crosses a segment (equal to `position_labels(input_ids, completion_mask,
position_ids)`). `sequence_ids[t]` names the sequence t's label is summed into, -1 where
the label is -100. Sequences are numbered as `DPOCollator` orders its rows: chosen of pair i
is sequence i, rejected is B + i (KTO: completion i, KL partner B + i), so `seq[:B]` and
`seq[B:]` keep their meaning.

**What a trainer does** (DPO; KTO alike), through the one row layout,
`fusedalign.data.packed_rows.PackedRows.from_packed(batch)` (`rows`):
1. kwargs = `rows.model_inputs(model)`, built once per row and model signature
   (`fusedalign.attention.attention_inputs`); the policy and the reference forward take the
   same kwargs, so the reference runs in the same layout.
2. token log-probs [1, L] from `token_logprobs(model, kwargs, targets=rows.labels)`; per-sequence
   sums [2B] = `rows.sums(logps)` (fp64, as the loss-aware head sums; `sequence_logps` here
   is the same sum over a batch dict); lengths = `rows.lengths()`.
3. `count_items` = `valid_pairs(batch).sum()`: pairs whose chosen and rejected both keep a
   scored token, the unit of the global normaliser (pairs of the optimizer step, all ranks).
4. Precomputed reference log-probs stay per pair, keyed by `row_key` (the collators'
   `row_keys=True`, the same hash as the padded collators'): sums of the same layout equal
   the padded ones to rounding, so either layout fills them.
5. The loss-aware head takes per-position segments: `rows.row_loss(grad)`, i.e.
   `RowLoss(groups=sequence_pair, grad, segments=sequence_ids)` (a row holds both sequences
   of a pair, and several pairs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Number

import torch
from torch import Tensor

from .collators import row_keys
from .formats import DataError
from .packed_rows import group_tokens, pack_groups, segment_sums

__all__ = ["dpo_row_tokens", "kto_row_tokens", "pack_groups", "preference_batch", "kto_batch", "sequence_logps",
           "valid_pairs", "PackedDPOCollator", "PackedKTOCollator"]

CHOSEN, REJECTED = 0, 1  # roles of a DPO pair's sequences (KTO: completion, KL partner)


def dpo_row_tokens(row: Mapping, share_prompt: bool = False) -> int:
    """Tokens a DPO pair occupies in a packed row (what a token budget counts)."""
    return group_tokens(len(row["prompt_ids"]), [len(row["chosen_ids"]), len(row["rejected_ids"])], share_prompt)


def kto_row_tokens(row: Mapping, share_prompt: bool = False, kl: bool = True) -> int:
    """Tokens of a KTO example with its KL partner (`kl`) in one row: the reference's forward."""
    completions = [len(row["completion_ids"])] + ([len(row["kl_completion_ids"])] if kl else [])
    return group_tokens(len(row["prompt_ids"]), completions, share_prompt)


def preference_batch(rows: Sequence[Mapping], *, share_prompt: bool = False, pad_token_id: int = 0,
                     pad_to_multiple_of: int | None = None) -> dict[str, Tensor]:
    """Packs DPO pairs (`prompt_ids, chosen_ids, rejected_ids`) into one row; see the module docstring."""
    groups = [(_ids(r, "prompt_ids", i), [_ids(r, "chosen_ids", i), _ids(r, "rejected_ids", i)])
              for i, r in enumerate(rows)]
    return pack_groups(groups, share_prompt=share_prompt, pad_token_id=pad_token_id,
                       pad_to_multiple_of=pad_to_multiple_of)


def kto_batch(rows: Sequence[Mapping], *, kl: bool = True, completion: bool = True, share_prompt: bool = False,
              pad_token_id: int = 0, pad_to_multiple_of: int | None = None) -> dict[str, Tensor]:
    """Packs KTO examples (`prompt_ids, completion_ids[, kl_completion_ids]`) into one row.

    `completion` and `kl` pick which completions of each example the row holds (both:
    completion i is sequence i, its KL partner B + i).
    """
    keys = [k for k, on in (("completion_ids", completion), ("kl_completion_ids", kl)) if on]
    if not keys:
        raise ValueError("kto_batch: completion and kl are both False; nothing to pack")
    groups = [(_ids(r, "prompt_ids", i), [_ids(r, k, i) for k in keys]) for i, r in enumerate(rows)]
    return pack_groups(groups, share_prompt=share_prompt, pad_token_id=pad_token_id,
                       pad_to_multiple_of=pad_to_multiple_of)


def _ids(row: Mapping, key: str, index: int) -> list[int]:
    if key not in row:
        raise DataError(f"row {index}: missing column {key!r} (expected token ids from tokenisation)")
    return list(row[key])


def sequence_logps(token_logps: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """Sums per-position log-probs into their sequences, in fp64 (as the loss-aware head does).

    Args:
        token_logps: [R, L] log-probs of `batch["labels"]`, 0 where the label is ignored.
        batch: a packed batch (`sequence_ids` [R, L], `scored_tokens` [S]).

    Returns:
        [S] in `token_logps`' dtype, differentiable.
    """
    return segment_sums(token_logps, batch["sequence_ids"], batch["scored_tokens"].shape[0])


def valid_pairs(batch: Mapping[str, Tensor]) -> Tensor:
    """[B] bool: the pairs all of whose sequences keep at least one scored token."""
    b = batch["pair_tokens"].shape[0]
    return (batch["scored_tokens"].view(-1, b) > 0).all(0)


def _scalars(features: Sequence[Mapping], used: set[str]) -> dict[str, Tensor]:
    """Per-row numbers beside the token lists (numeric columns the dataset carries), as [B] tensors."""
    return {key: torch.tensor([f[key] for f in features]) for key, value in features[0].items()
            if key not in used and isinstance(value, (Number, bool))}


@dataclass
class PackedDPOCollator:
    """Batches DPO rows into one padding-free row (`preference_batch`), plus scalar columns as [B].

    With `row_keys`, also `row_key` [B]: the content hash `DPOCollator(row_keys=True)` gives the
    same row (the key of precomputed reference log-probs, so either layout reads one store).
    """

    pad_token_id: int = 0
    share_prompt: bool = False
    pad_to_multiple_of: int | None = None
    row_keys: bool = False

    def __call__(self, features: Sequence[Mapping]) -> dict[str, Tensor]:
        batch = preference_batch(features, share_prompt=self.share_prompt, pad_token_id=self.pad_token_id,
                                 pad_to_multiple_of=self.pad_to_multiple_of)
        batch.update(_scalars(features, {"prompt_ids", "chosen_ids", "rejected_ids"}))
        if self.row_keys:
            batch["row_key"] = row_keys(features, ("prompt_ids", "chosen_ids", "rejected_ids"))
        return batch


@dataclass
class PackedKTOCollator:
    """Batches KTO rows into the rows of its three forwards, plus `label` and scalars as [B].

    Output: the completions (the policy's forward with gradient) under plain keys; with
    `kl_completion_ids` in the rows, the KL partners (the policy's no-grad forward) under
    `kl_` keys and both in one row (the reference's forward; sharing the prompt if
    `share_prompt`) under `joint_` keys. With `row_keys`, `row_key` [B] as `KLPairCollator`
    gives it (completion and KL partner).
    """

    pad_token_id: int = 0
    share_prompt: bool = False
    pad_to_multiple_of: int | None = None
    row_keys: bool = False

    def __call__(self, features: Sequence[Mapping]) -> dict[str, Tensor]:
        opts = dict(pad_token_id=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of)
        batch = kto_batch(features, kl=False, **opts)
        fields: tuple[str, ...] = ("prompt_ids", "completion_ids")
        if "kl_completion_ids" in features[0]:
            batch.update({f"kl_{k}": v for k, v in kto_batch(features, completion=False, **opts).items()})
            joint = kto_batch(features, share_prompt=self.share_prompt, **opts)
            batch.update({f"joint_{k}": v for k, v in joint.items()})
            fields += ("kl_completion_ids",)
        if self.row_keys:
            batch["row_key"] = row_keys(features, fields)
        batch["label"] = torch.tensor([bool(f["label"]) for f in features], dtype=torch.bool)
        batch.update(_scalars(features, {"prompt_ids", "completion_ids", "kl_completion_ids", "label"}))
        return batch
