"""Do several runs of the same training agree on their first logged steps?

Each run's result holds `logs`: the Trainer's logs that carry a loss, one per optimizer
step (logging_steps=1). Runs that compute the same loss on the same tokens must log the
same values to rounding; a run fed other tokens, another model or another loss does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def first(result: dict, key: str, n: int = 3) -> list[float]:
    """The first `n` logged values of `key`."""
    return [entry[key] for entry in result.get("logs", [])[:n] if key in entry]


@dataclass(frozen=True)
class Check:
    """One logged quantity, compared over the first `steps` steps to `atol` (absolute)."""

    key: str
    atol: float
    steps: int = 3
    skip: tuple[str, ...] = ()  # runs shown for this key but not held to it


@dataclass
class Agreement:
    verdict: str                      # "agree", "void" (they ran and differ) or "incomplete" (< 2 ran)
    lines: list[str] = field(default_factory=list)
    worst: dict[str, float] = field(default_factory=dict)  # key -> largest difference from the first run


def compare(results: dict[str, dict], names: list[str], checks: list[Check]) -> Agreement:
    """Compares the runs `names` that ran ("ok") against the first of them.

    Returns:
        "incomplete" when fewer than two ran; "void" when a checked run logged a different
        number of values than the first, or differs from it by more than a check's atol.
    """
    present = [n for n in names if results.get(n, {}).get("status") == "ok"]
    out = Agreement("agree")
    if len(present) < 2:
        out.verdict = "incomplete"
        out.lines.append("fewer than two of the checked runs ran")
        return out
    base = present[0]
    for check in checks:
        series = {n: first(results[n], check.key, check.steps) for n in present}
        for n in present:
            out.lines.append(f"{check.key:15s} {n:13s} " + ", ".join(f"{x:.4f}" for x in series[n]))
        ref = series[base]
        for n in present[1:]:
            if n in check.skip:
                continue
            if not ref or len(series[n]) != len(ref):
                out.lines.append(f"!! {check.key}: {n} logged {len(series[n])} values, {base} {len(ref)}")
                out.verdict = "void"
                continue
            worst = max(abs(a - b) for a, b in zip(series[n], ref))
            out.worst[check.key] = max(out.worst.get(check.key, 0.0), worst)
            if worst > check.atol:
                out.lines.append(f"!! {check.key}: {n} differs from {base} by {worst:.4g} > {check.atol:g}")
                out.verdict = "void"
    return out
