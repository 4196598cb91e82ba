"""--max_length_search: the longest length that fits at --pairs pairs, with gradient
checkpointing, by binary search over multiples of --search_step (2 steps a probe)."""

from __future__ import annotations

from benchmarks.dpo_modes.launch import launch
from benchmarks.harness.env import log
from benchmarks.harness.tables import fmt, markdown


def search_one(args, config: str) -> dict:
    step = args.search_step
    lo = args.search_min // step  # the largest multiple of step known to fit (0: none)
    hi = args.search_max // step + 1  # known not to fit (one past the range)
    probes = []
    log(f"\n{config}: searching {max(lo, 1) * step}..{args.search_max} in steps of {step} "
        f"({args.pairs} pairs, micro-batch {args.per_device_train_batch_size}, gradient checkpointing)")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        length = mid * step
        if length <= args.prompt_length:
            lo = mid
            continue
        r = launch(args, config, length, f"search-{config}-{length}", warmup=1, timed=1)
        probes.append({"length": length, "status": r["status"], "peak_gib": r.get("peak_gib"),
                       "tokens_per_s": r.get("tokens_per_s")})
        log(f"  {length}: {r['status']}" + (f", peak {fmt(r.get('peak_gib'), '.1f')} GiB" if r.get("peak_gib") else ""))
        if r["status"] == "ok":
            lo = mid
        elif r["status"] == "OOM":
            hi = mid
        else:
            log(f"  {config}: search stopped by an error: {r.get('error')}")
            return {"status": "error", "error": r.get("error"), "probes": probes}
    longest = lo * step if lo > 0 else None
    capped = hi > args.search_max // step
    log(f"  {config}: longest that fits: " + ("none" if longest is None else f"{'>= ' if capped else ''}{longest}"))
    return {"status": "ok", "longest": longest, "capped": capped, "probes": probes}


def search(args, skipped) -> tuple[dict, list[str]]:
    out = {}
    for config in args.configs:
        if skipped[config]:
            log(f"\n{config}: skipped: {skipped[config]}")
            out[config] = {"status": "skipped", "reason": skipped[config]}
        else:
            out[config] = search_one(args, config)
    rows = []
    for config, r in out.items():
        if r["status"] == "ok":
            value = "none" if r["longest"] is None else f"{'>= ' if r['capped'] else ''}{r['longest']}"
        else:
            value = r["status"] + f": {r.get('reason') or r.get('error')}"
        rows.append([config, value])
    text = markdown(["config", f"longest length at {args.pairs} pairs (gradient checkpointing)"], rows)
    log("\n" + text)
    return out, [text]
