"""TRL's `dataset_text_field`: the column that holds a language-modeling dataset's text.

fusedalign's formats read language-modeling text from the column `text`; a dataset whose
text lies in another column is read through this one renaming (a column `text` beside it
is then not the text, and is dropped). Conversational data (`messages`) has no text
column, as in TRL, where the field is read only for non-conversational rows.
"""

from __future__ import annotations

from typing import Any

from fusedalign.data.formats import DataError

DEFAULT = "text"


def with_text_field(dataset: Any, field: str) -> Any:
    """`dataset` with its column `field` read as `text` (unchanged for `text`, or for tokenised or
    conversational data without that column).

    Raises:
        DataError: a dataset with neither the column `field` nor `messages` (naming the columns it has).
    """
    columns = list(getattr(dataset, "column_names", None) or [])
    if field == DEFAULT or dataset is None:
        return dataset
    if field not in columns:
        if "messages" in columns or "input_ids" in columns:
            return dataset  # conversational or tokenised: no text column to read
        raise DataError(f"--dataset_text_field {field}: the dataset has no column {field!r} (its columns: "
                        f"{', '.join(columns) or 'none'}); name the column that holds the text")
    if DEFAULT in columns:
        dataset = dataset.remove_columns([DEFAULT])
    return dataset.rename_column(field, DEFAULT)
