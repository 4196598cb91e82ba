"""The longest length that fits: binary search over multiples of a step, one probe a length;
or, where a probe near the boundary would take too long, a line through measured peaks and
where it meets the GPU's memory (`memory_line`).

A probe returns a worker result (`harness/runner.py`): status "ok" (it fits), "OOM" (it does
not) or anything else (an error, which ends the search).
"""

from __future__ import annotations

from typing import Callable

from benchmarks.harness.env import log
from benchmarks.harness.tables import fmt


def longest_that_fits(probe: Callable[[int], dict], *, name: str, step: int, smallest: int, largest: int,
                      known_to_fit: Callable[[int], bool] = lambda length: False) -> dict:
    """Searches (smallest .. largest] in multiples of `step`; `known_to_fit(length)` skips a probe.

    Returns:
        {"status": "ok", "longest": tokens or None, "capped": the largest fitted, "probes": [...]},
        or {"status": "error", "error": ..., "probes": [...]}.
    """
    lo, hi = smallest // step, largest // step + 1  # lo fits (0: none known), hi does not (one past the range)
    probes = []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        length = mid * step
        if known_to_fit(length):
            lo = mid
            continue
        r = probe(length)
        probes.append({"length": length, "status": r["status"], "peak_gib": r.get("peak_gib"),
                       "tokens_per_s": r.get("tokens_per_s")})
        log(f"  {length}: {r['status']}" + (f", peak {fmt(r.get('peak_gib'), '.1f')} GiB" if r.get("peak_gib") else ""))
        if r["status"] == "ok":
            lo = mid
        elif r["status"] == "OOM":
            hi = mid
        else:
            log(f"  {name}: search stopped by an error: {r.get('error')}")
            return {"status": "error", "error": r.get("error"), "probes": probes}
    longest = lo * step if lo > 0 else None
    capped = hi > largest // step
    log(f"  {name}: longest that fits: " + ("none" if longest is None else f"{'>= ' if capped else ''}{longest}"))
    return {"status": "ok", "longest": longest, "capped": capped, "probes": probes}


def line_fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """(slope, intercept, worst residual) of the least-squares line through `points`."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    intercept = my - slope * mx
    return slope, intercept, max(abs(intercept + slope * x - y) for x, y in points)


def memory_line(name: str, points: list[tuple[int, float]], total_gib: float | None) -> dict | None:
    """The least-squares line through (length, peak GiB) `points` and the length where it meets
    `total_gib`, logged: {slope_gib_per_1k, intercept_gib, max_residual_gib, predicted (None when
    the peak does not grow)}; None with fewer than two points or no total (the CPU)."""
    if len(points) < 2 or not total_gib:
        return None
    slope, intercept, worst = line_fit(points)
    predicted = int((total_gib - intercept) / slope) if slope > 0 else None
    log(f"  {name}: peak = {intercept:.2f} GiB + {slope * 1024:.3f} GiB per 1k tokens of length (worst residual "
        f"{worst:.3f} GiB); reaches {total_gib:.1f} GiB at ~{predicted}")
    return dict(slope_gib_per_1k=slope * 1024, intercept_gib=intercept, max_residual_gib=worst, predicted=predicted)
