"""KTO's data: unpaired rows, and the one KL pairing its reference point z0 uses.

Row i's mismatched pair is (prompt i, completion of row sigma(i)), sigma one cycle
through a random order of the dataset fixed by a seed, so that sigma(i) != i. The pair
is fixed per row when the dataset is prepared (a `kl_completion_ids` column), as TRL
fixes its pairs when it builds its KL dataset: it does not depend on how rows are
shuffled, batched or split over ranks and accumulation steps, which is what lets
precomputed reference log-probs cover each row's KL pair and lets a run be split any
way without changing z0. (Where prompts repeat, as in unpaired data made from pairs, a
row meets its own prompt with probability about repeats / rows.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .collators import KTOCollator, row_keys
from .convert import unpair_preference_dataset
from .formats import DataError

logger = logging.getLogger(__name__)

ROW_FIELDS = ("input_ids", "attention_mask", "completion_mask")


def kl_partners(num_rows: int, seed: int) -> list[int]:
    """sigma: row i's KL completion is row sigma[i]'s; one cycle through a seeded random order."""
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    partner = [0] * num_rows
    for k, row in enumerate(order):
        partner[row] = order[(k + 1) % num_rows]
    return partner


def add_kl_pairs(dataset: Any, seed: int, split: str) -> Any:
    """Adds `kl_completion_ids`: the completion each row's prompt is mismatched with.

    Raises:
        DataError: fewer than 2 rows (a row cannot be its own mismatched pair).
    """
    from datasets import concatenate_datasets

    if len(dataset) < 2:
        raise DataError(
            f"{split} split has {len(dataset)} row: KTO's KL estimate pairs each prompt with another row's "
            "completion, so it needs at least 2 rows (or loss_type='apo_zero_unpaired', which has no KL term)."
        )
    partners = dataset.select(kl_partners(len(dataset), seed)).select_columns(["completion_ids"])
    partners = partners.rename_column("completion_ids", "kl_completion_ids").flatten_indices()
    return concatenate_datasets([dataset, partners], axis=1)


def unpaired(dataset: Any, unpair: bool, split: str) -> Any:
    """Unpaired rows as they are; paired preference rows unpaired only when asked."""
    if not {"chosen", "rejected"} <= set(dataset.column_names):
        return dataset
    if not unpair:
        raise DataError(
            f"{split} split is paired preference data (columns {sorted(dataset.column_names)}); KTO trains on "
            "unpaired data (prompt, completion, label). Set unpair_preference=True (CLI: --unpair_preference true) "
            "to train on each pair as one desirable and one undesirable example."
        )
    return unpair_preference_dataset(dataset)


@dataclass
class KLPairCollator:
    """`KTOCollator` rows plus, when the rows carry `kl_completion_ids`, their KL partners.

    Output, besides `KTOCollator`'s: `kl_input_ids`, `kl_attention_mask`,
    `kl_completion_mask` [B, T'] (prompt i + completion sigma(i)); `row_key` [B] with
    `row_keys` (the key of precomputed reference log-probs: completion and KL pair).
    """

    pad_token_id: int
    row_keys: bool = False
    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        collate = KTOCollator(self.pad_token_id, self.pad_to_multiple_of)
        batch = collate(features)
        fields = ("prompt_ids", "completion_ids")
        if "kl_completion_ids" in features[0]:
            kl = collate([{**f, "completion_ids": f["kl_completion_ids"]} for f in features])
            batch.update({f"kl_{key}": kl[key] for key in ROW_FIELDS})
            fields += ("kl_completion_ids",)
        if self.row_keys:
            batch["row_key"] = row_keys(features, fields)
        return batch


def stack_kl_rows(batch: Mapping[str, torch.Tensor], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Completion rows then KL rows as one [2B, T] batch, right-padded to a common length."""
    length = max(batch["input_ids"].shape[1], batch["kl_input_ids"].shape[1])
    pad = {"input_ids": pad_token_id, "attention_mask": 0, "completion_mask": 0}
    return {
        key: torch.cat([F.pad(batch[p + key], (0, length - batch[p + key].shape[1]), value=pad[key]) for p in ("", "kl_")])
        for key in ROW_FIELDS
    }


def warn_on_class_balance(labels: Sequence[bool], desirable_weight: float, undesirable_weight: float) -> None:
    """Warns when one class is absent, or the weights are off KTO's guidance for unbalanced data."""
    n_d = int(sum(bool(x) for x in labels))
    n_u = len(labels) - n_d
    ratio_name = "(desirable_weight * n_desirable) / (undesirable_weight * n_undesirable)"
    guidance = f"{ratio_name} in [1, 4/3]"
    if n_d == 0 or n_u == 0:
        present, absent = ("desirable", "undesirable") if n_u == 0 else ("undesirable", "desirable")
        logger.warning(
            "KTO: the training data has only %s examples (%d) and no %s ones, so only the %s loss term trains. "
            "KTO's guidance for desirable_weight/undesirable_weight, %s, cannot be met with one class: add %s "
            "examples (paired preference data: unpair_preference=True).",
            present, n_d + n_u, absent, present, guidance, absent,
        )
        return
    ratio = desirable_weight * n_d / max(undesirable_weight * n_u, 1e-12)
    if not 1.0 <= ratio <= 4 / 3:
        d_lo = undesirable_weight * n_u / n_d
        u_hi = desirable_weight * n_d / n_u
        logger.warning(
            "KTO: %d desirable and %d undesirable examples with desirable_weight=%g, undesirable_weight=%g give "
            "%s = %.3g, outside KTO's guidance %s. Set EITHER desirable_weight in [%.3g, %.3g] OR "
            "undesirable_weight in [%.3g, %.3g].",
            n_d, n_u, desirable_weight, undesirable_weight, ratio_name, ratio, guidance,
            d_lo, d_lo * 4 / 3, u_hi * 3 / 4, u_hi,
        )
