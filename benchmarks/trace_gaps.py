"""Where a profiled step leaves the GPU idle: gaps between kernels, and what the host was doing.

Reads a Chrome trace written by torch.profiler (`e2e_dpo.py --profile --trace DIR` writes
one per config, gzipped) and prints:
- the step's span on the GPU, the sum of kernel (and memcpy/memset) time, and the idle time;
- every gap of at least `--min_gap_ms` between one GPU activity and the next, with the CUDA
  runtime call that launched the next one and the CPU ops enclosing that call (outermost
  first): the host was late with that launch, so the enclosing ops say what it was busy with;
- the idle time summed by the outermost enclosing CPU op and by the innermost one.

A host-bound stretch (many small launches, Python overhead, a synchronising `.item()`) shows
up as many gaps under the same ops; a synchronisation shows up as one gap after a
`cudaStreamSynchronize`/`cudaMemcpy` or `aten::item`/`aten::_local_scalar_dense`.

Example:
    python benchmarks/trace_gaps.py /tmp/trace-ours_fused_compile-2048.json.gz --min_gap_ms 0.2
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def analyse(events: list[dict], min_gap_us: float, top: int) -> str:
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        return "no GPU activity in the trace"
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    cpu_ops: dict[object, list[dict]] = defaultdict(list)  # per host thread, sorted by start
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            cpu_ops[e["tid"]].append(e)
    starts = {}
    for tid, ops in cpu_ops.items():
        ops.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in ops]

    def enclosing(call: dict) -> list[str]:
        ops, ts = cpu_ops.get(call["tid"], []), call["ts"]
        i = bisect.bisect_right(starts.get(call["tid"], []), ts)
        chain = [e for e in ops[max(0, i - 4000):i] if e["ts"] <= ts <= e["ts"] + e["dur"]]
        chain.sort(key=lambda e: (e["ts"], -e["dur"]))
        return [e["name"] for e in chain]

    # Merge GPU activity into busy intervals (streams can overlap).
    busy, gaps = 0.0, []
    end = gpu[0]["ts"] + gpu[0]["dur"]
    cur_start = gpu[0]["ts"]
    for e in gpu[1:]:
        if e["ts"] > end:
            busy += end - cur_start
            gaps.append((end, e))
            cur_start = e["ts"]
        end = max(end, e["ts"] + e["dur"])
    busy += end - cur_start
    span = end - gpu[0]["ts"]
    lines = [f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms "
             f"({len(gaps)} gaps; {sum(1 for g, e in gaps if e['ts'] - g >= min_gap_us)} of >= {min_gap_us / 1e3:g} ms)"]
    by_outer: dict[str, float] = defaultdict(float)
    by_inner: dict[str, float] = defaultdict(float)
    rows = []
    for gap_start, nxt in gaps:
        length = nxt["ts"] - gap_start
        call = runtime.get(nxt.get("args", {}).get("correlation"))
        chain = enclosing(call) if call else []
        outer = chain[0] if chain else "?"
        inner = chain[-1] if chain else "?"
        by_outer[outer] += length
        by_inner[inner] += length
        if length >= min_gap_us:
            rows.append((gap_start - gpu[0]["ts"], length, nxt["name"], call["name"] if call else "?", chain))
    lines.append("")
    lines.append("| at ms | gap ms | next GPU activity | launched by | inside (outermost first) |")
    lines.append("|---:|---:|---|---|---|")
    for at, length, name, call, chain in rows:
        lines.append(f"| {at / 1e3:.2f} | {length / 1e3:.3f} | {name[:60]} | {call} | {' > '.join(c[:50] for c in chain[-6:])} |")
    for title, table in (("outermost", by_outer), ("innermost", by_inner)):
        lines.append("")
        lines.append(f"idle by {title} enclosing CPU op (all gaps):")
        for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {us / 1e3:8.2f} ms  {name[:100]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.gz)")
    p.add_argument("--min_gap_ms", type=float, default=0.2, help="list gaps at least this long (default 0.2)")
    p.add_argument("--top", type=int, default=15, help="rows of the per-op idle summaries (default 15)")
    args = p.parse_args(argv)
    for path in args.traces:
        print(f"## {path}")
        print(analyse(load(path), args.min_gap_ms * 1e3, args.top))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
