"""Datasets: loading, format detection and validation, tokenisation, collation, packing.

Typical use by a trainer::

    dataset = load_dataset_any("builtin:zen", "standard_preference")
    dataset, stats = prepare_dpo_dataset(dataset, tokenizer, max_length=512)   # DataError if bad
    batch = DPOCollator(tokenizer.pad_token_id)([dataset[i] for i in range(4)])
    labels = position_labels(batch["input_ids"], batch["completion_mask"])
"""

from .builtin import list_builtin_datasets, load_builtin_dataset, load_dataset_any
from .collators import DPOCollator, KTOCollator, SFTCollator, pad, position_labels
from .convert import unpair_preference_dataset
from .formats import (
    KIND_COLUMNS,
    TRAINER_KINDS,
    DataError,
    DataFormat,
    check_row,
    check_tokenizer,
    detect_format,
    has_generation_markers,
    validate_dataset,
)
from .packing import pack_dataset, pack_sequences
from .preference_batches import (
    PackedDPOCollator,
    PackedKTOCollator,
    dpo_row_tokens,
    kto_batch,
    kto_row_tokens,
    preference_batch,
    sequence_logps,
)
from .samplers import LengthGroupedSampler, TokenBudgetBatchSampler
from .token_ids import extract_prompt, truncate_pair
from .tokenize import TokenizeStats, prepare_dpo_dataset, prepare_kto_dataset, prepare_sft_dataset
from .tokenize_rows import tokenize_dpo_row, tokenize_kto_row, tokenize_prompt_row, tokenize_sft_row

__all__ = [
    "DPOCollator", "DataError", "DataFormat", "KIND_COLUMNS", "KTOCollator", "LengthGroupedSampler",
    "PackedDPOCollator", "PackedKTOCollator", "SFTCollator", "TRAINER_KINDS", "TokenBudgetBatchSampler",
    "TokenizeStats", "check_row", "check_tokenizer", "detect_format", "dpo_row_tokens",
    "extract_prompt", "has_generation_markers", "kto_batch", "kto_row_tokens", "list_builtin_datasets",
    "load_builtin_dataset", "load_dataset_any", "pack_dataset", "pack_sequences", "pad", "position_labels",
    "preference_batch", "sequence_logps",
    "prepare_dpo_dataset", "prepare_kto_dataset", "prepare_sft_dataset", "tokenize_dpo_row",
    "tokenize_kto_row", "tokenize_prompt_row", "tokenize_sft_row", "truncate_pair",
    "unpair_preference_dataset", "validate_dataset",
]
