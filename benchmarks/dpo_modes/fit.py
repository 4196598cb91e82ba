"""--memory_fit: peak memory against length (gradient checkpointing), a least-squares line,
where it meets the GPU's memory; --verify_fit then measures the boundary itself."""

from __future__ import annotations

from benchmarks.dpo_modes.launch import launch
from benchmarks.dpo_modes.memory import log_memory
from benchmarks.harness.bisect import memory_line
from benchmarks.harness.env import log
from benchmarks.harness.tables import fmt, markdown


def fit_one(args, config: str) -> dict:
    points, total, breakdowns = [], None, {}
    for length in args.memory_fit:
        r = launch(args, config, length, f"fit-{config}-{length}", warmup=args.fit_warmup_steps, timed=1)
        log(f"  {config} at {length}: {r['status']}" + (f", peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") else ""))
        log_memory(config, length, r)
        if r["status"] == "ok" and r.get("peak_gib") is not None:  # None on the CPU
            points.append((length, r["peak_gib"]))
            breakdowns[length] = r.get("memory")
            total = r.get("total_gib") or total
    entry: dict = {"status": "ok", "points": points, "total_gib": total, "memory": breakdowns}
    line = memory_line(config, points, total)
    if line is None:
        entry["status"] = "incomplete"
        return entry
    entry.update(line)
    if args.verify_fit and line["predicted"]:
        entry["verified"] = verify_boundary(args, config, line["predicted"] // args.search_step * args.search_step)
    return entry


def memory_fit(args, skipped) -> tuple[dict, list[str]]:
    out = {c: ({"status": "skipped", "reason": skipped[c]} if skipped[c] else fit_one(args, c)) for c in args.configs}
    rows = []
    for config, e in out.items():
        if e["status"] == "skipped":
            rows.append([config, f"skipped: {e['reason']}", "", "", ""])
            continue
        rows.append([config, ", ".join(f"{y:.1f}" for _, y in e["points"]), fmt(e.get("slope_gib_per_1k"), ".3f"),
                     f"{fmt(e.get('predicted'), 'd')} (prediction)", checked_text(e.get("verified"))])
    text = markdown(["config", "peak GiB at " + ", ".join(str(x) for x in args.memory_fit),
                     "GiB per 1k tokens of length", "predicted longest length", "checked"], rows, numeric={2, 3})
    log("\n" + text)
    return out, [text]


def checked_text(checked: dict | None) -> str:
    if not checked:
        return "not run"
    text = "; ".join(f"{p['length']}: {p['status']}" for p in checked["probes"])
    if checked["longest_fit"]:
        text += f" -> longest that fits: {checked['longest_fit']}" + (
            f" (OOM at {checked['shortest_oom']})" if checked["shortest_oom"] else " (no OOM probed)")
    return text


def verify_boundary(args, config: str, start: int) -> dict:
    """Runs at `start`, then walks by --search_step (up after a fit, down after an OOM) until
    a length that fits and the next one that does not are both measured, or --verify_probes
    runs are spent. Returns the probes and the bracket (longest fit, shortest OOM)."""
    probes: list[dict] = []
    length, fits, ooms = start, [], []
    while len(probes) < args.verify_probes and length > args.prompt_length:
        r = launch(args, config, length, f"verify-{config}-{length}", warmup=args.fit_warmup_steps, timed=1)
        probes.append({"length": length, "status": r["status"], "peak_gib": r.get("peak_gib"),
                       "tokens_per_s": r.get("tokens_per_s")})
        log(f"  {config} at {length}{' (the prediction, rounded down)' if length == start else ''}: {r['status']}"
            + (f", peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") else ""))
        if r["status"] == "ok":
            fits.append(length)
        elif r["status"] == "OOM":
            ooms.append(length)
        else:
            break
        longest, shortest_oom = max(fits, default=None), min(ooms, default=None)
        if longest is not None and shortest_oom is not None and shortest_oom - longest <= args.search_step:
            break
        length = length + args.search_step if r["status"] == "ok" else length - args.search_step
    return {"probes": probes, "longest_fit": max(fits, default=None), "shortest_oom": min(ooms, default=None)}
