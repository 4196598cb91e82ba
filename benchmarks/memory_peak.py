"""What is alive on the GPU at a step's memory peak, grouped by where it was allocated.

`e2e_dpo.py --memory_snapshot` records the CUDA caching allocator's history over one
extra training step (`torch.cuda.memory._record_memory_history`, Python stacks) and
calls `peak_breakdown` on it; this file can also read a snapshot saved with
`torch.cuda.memory._dump_snapshot`:

    python benchmarks/memory_peak.py snapshot.pickle --tokens 131072

How the peak is found: the trace lists every allocation and free after recording began.
Replaying it from the bytes already allocated when recording began (the baseline: weights,
optimizer state, ...) gives the allocated bytes after each event; the largest is the peak.
A second replay up to that event groups the blocks alive there by the innermost frame of
their allocation that is not inside torch itself (a line of fusedalign, transformers,
TRL, Liger, or a compiled graph's generated code), so "which line holds the memory" is
answered directly. Blocks allocated before recording began are one group ("before the
step"), less whatever of them was freed before the peak. Allocations made by the autograd
engine in C++ (most gradients) carry no Python frame and form their own group.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
from collections import defaultdict
from typing import Any, Iterable

GiB = 2**30
NO_FRAME = "(no Python frame: autograd engine / C++ op)"
BEFORE = "(allocated before the step, still alive)"

# Frames inside these are skipped when labelling an allocation: the label is the first
# frame outside torch's own machinery (compiled graphs' generated code is kept).
_SKIP = re.compile(r"(/torch/|/contextlib\.py|/functools\.py|<frozen |/typing\.py)")
_INDUCTOR_CODE = re.compile(r"/torchinductor_[^/]*/.*\.py$|/tmp/torchinductor")


def short_path(filename: str) -> str:
    """A file name without its installation prefix."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    for marker in ("/fusedalign/", "/benchmarks/", "/tests/"):
        if marker in filename:
            return marker.strip("/") + "/" + filename.split(marker, 1)[1]
    return filename


def label(frames: list[dict] | None) -> str:
    """The innermost frame outside torch's machinery, as 'file:line function'."""
    if not frames:
        return NO_FRAME
    compiled = False
    for frame in frames:
        name = frame.get("filename", "")
        if _INDUCTOR_CODE.search(name):
            compiled = True
        elif not _SKIP.search(name):
            where = f"{short_path(name)}:{frame.get('line', '?')} {frame.get('name', '?')}"
            return f"compiled graph called from {where}" if compiled else where
    if compiled:  # only torch's own frames outside it: the autograd engine runs a compiled backward
        return "compiled graph, backward"
    top = frames[0]
    return f"{short_path(top.get('filename', '?'))}:{top.get('line', '?')} {top.get('name', '?')}"


def _replay(trace: list[dict], baseline: int, stop: int | None = None):
    """Allocated bytes through the trace. Yields (index, total, live, pre_freed) after each event."""
    live: dict[int, tuple[int, int]] = {}  # addr -> (size, event index of its allocation)
    total, pre_freed = baseline, 0
    for i, ev in enumerate(trace):
        if stop is not None and i > stop:
            return
        action, addr, size = ev.get("action"), ev.get("addr"), ev.get("size", 0)
        if action == "alloc":
            live[addr] = (size, i)
            total += size
        elif action == "free_requested":
            if addr in live:
                total -= live.pop(addr)[0]
            else:  # allocated before recording began
                total -= size
                pre_freed += size
        yield i, total, live, pre_freed


def peak_breakdown(trace: list[dict], baseline_bytes: int, tokens: int | None = None, top: int = 25) -> dict[str, Any]:
    """The allocated-bytes peak of `trace` and what is alive there, grouped by allocation site.

    Args:
        trace: one device's events from `torch.cuda.memory._snapshot()["device_traces"]`.
        baseline_bytes: `torch.cuda.memory_allocated()` when recording began.
        tokens: input tokens of the step, to express each group per token (None: omitted).
        top: how many groups to list (the rest are summed into one line).

    Returns:
        peak_gib, baseline_gib, at_peak (the allocation that reached the peak and its stack),
        groups: [{label, gib, blocks, bytes_per_token}], largest first.
    """
    peak, peak_index = baseline_bytes, -1
    for i, total, _, _ in _replay(trace, baseline_bytes):
        if total > peak:
            peak, peak_index = total, i
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    pre_freed = 0
    live: dict[int, tuple[int, int]] = {}
    for _, _, live, pre_freed in _replay(trace, baseline_bytes, stop=peak_index):
        pass
    for size, index in live.values():
        g = groups[label(trace[index].get("frames"))]
        g[0] += size
        g[1] += 1
    groups[BEFORE] = [baseline_bytes - pre_freed, 0]
    ordered = sorted(groups.items(), key=lambda kv: -kv[1][0])
    rows = [{"label": k, "gib": v[0] / GiB, "blocks": v[1],
             "bytes_per_token": None if not tokens else v[0] / tokens} for k, v in ordered[:top]]
    rest = ordered[top:]
    if rest:
        size = sum(v[0] for _, v in rest)
        rows.append({"label": f"({len(rest)} other sites)", "gib": size / GiB, "blocks": sum(v[1] for _, v in rest),
                     "bytes_per_token": None if not tokens else size / tokens})
    at_peak = trace[peak_index] if peak_index >= 0 else {}
    stack = [f"{short_path(f.get('filename', '?'))}:{f.get('line', '?')} {f.get('name', '?')}"
             for f in (at_peak.get("frames") or [])[:12]]
    return {"peak_gib": peak / GiB, "baseline_gib": baseline_bytes / GiB, "events": len(trace),
            "peak_event": peak_index, "at_peak": {"label": label(at_peak.get("frames")), "size": at_peak.get("size"),
                                                   "stack": stack},
            "tokens": tokens, "groups": rows}


def format_breakdown(summary: dict[str, Any]) -> str:
    """A markdown table of `peak_breakdown`'s result."""
    per_token = summary.get("tokens")
    lines = [f"peak {summary['peak_gib']:.2f} GiB (before the step: {summary['baseline_gib']:.2f} GiB allocated); "
             f"reached at event {summary['peak_event']} of {summary['events']}, allocating in "
             f"{summary['at_peak']['label']}",
             "", "| alive at the peak, allocated at | GiB | blocks |" + (" bytes/token |" if per_token else ""),
             "|---|---:|---:|" + ("---:|" if per_token else "")]
    for row in summary["groups"]:
        line = f"| {row['label']} | {row['gib']:.3f} | {row['blocks']} |"
        if per_token:
            line += f" {row['bytes_per_token']:,.0f} |"
        lines.append(line)
    if summary["at_peak"]["stack"]:
        lines += ["", "stack of the allocation that reached the peak (innermost first):"]
        lines += ["    " + s for s in summary["at_peak"]["stack"]]
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot", help="a pickle from torch.cuda.memory._dump_snapshot")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--baseline_gib", type=float, default=0.0,
                   help="GiB allocated when recording began (torch.cuda.memory_allocated); default 0")
    p.add_argument("--tokens", type=int, default=None, help="tokens of the step, for bytes per token")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(list(argv) if argv is not None else None)
    with open(args.snapshot, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][args.device]
    print(format_breakdown(peak_breakdown(trace, int(args.baseline_gib * GiB), args.tokens, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
