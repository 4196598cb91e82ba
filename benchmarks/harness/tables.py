"""Markdown tables, the way every benchmark here prints its results."""

from __future__ import annotations


def fmt(x, spec: str) -> str:
    """`x` formatted with `spec`, or an em dash when it is None."""
    return "—" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> str:
    """a / b as "1.07x", or an em dash when either is missing or b is 0."""
    return "—" if not a or not b else f"{a / b:.2f}x"


def markdown(columns: list[str], rows: list[list[str]], numeric: set[int] | None = None) -> str:
    """A markdown table; `numeric` columns (by index) are right-aligned.

    Raises:
        ValueError: a row does not have one cell per column.
    """
    numeric = numeric or set()
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"table row has {len(row)} cells for {len(columns)} columns: {row}")
    rule = ["---:" if i in numeric else "---" for i in range(len(columns))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(args, tables: list[str]) -> None:
    """Writes the tables so far to `args.markdown_out` (when given), so that a run cut short
    still leaves what it measured."""
    path = getattr(args, "markdown_out", None)
    if path:
        with open(path, "w") as f:
            f.write("\n\n".join(tables) + "\n")
