"""--max_length_search: the longest length that fits at --pairs pairs, with gradient
checkpointing, by binary search over multiples of --search_step (2 steps a probe)."""

from __future__ import annotations

from benchmarks.dpo_modes.launch import launch
from benchmarks.harness.bisect import longest_that_fits
from benchmarks.harness.env import log
from benchmarks.harness.tables import markdown


def search_one(args, config: str) -> dict:
    log(f"\n{config}: searching {max(args.search_min // args.search_step, 1) * args.search_step}..{args.search_max} "
        f"in steps of {args.search_step} ({args.pairs} pairs, micro-batch {args.per_device_train_batch_size}, "
        "gradient checkpointing)")
    return longest_that_fits(
        lambda length: launch(args, config, length, f"search-{config}-{length}", warmup=1, timed=1),
        name=config, step=args.search_step, smallest=args.search_min, largest=args.search_max,
        known_to_fit=lambda length: length <= args.prompt_length)


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
