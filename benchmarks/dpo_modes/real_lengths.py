"""--real_lengths DATASET: DPO on preference pairs at that dataset's lengths.

Every configuration trains the same pairs (drawn once from the seed, truncated at
max_length as TRL truncates), the same number a step (--pairs, as micro-batches x
accumulation). The first --warmup_steps steps take the same rows in the same order in
every run; after them each run takes the timed rows in its own order ("random": one
seeded permutation shared by the runs that use it; "grouped": TRL's group_by_length).
The unit is pairs/s, the one that is fair to a trainer that processes fewer tokens for
the same pairs; unique tokens/s counts each pair once (prompt + chosen + rejected).
"""

from __future__ import annotations

import statistics

from benchmarks.builders import lengths
from benchmarks.builders.dpo_configs import REAL
from benchmarks.dpo_modes.launch import launch
from benchmarks.harness import agreement
from benchmarks.harness.agreement import first
from benchmarks.harness.env import log
from benchmarks.harness.tables import fmt, markdown, ratio, write_markdown


def describe(args, length: int) -> str:
    fits = lengths.DATASETS[args.real_lengths]
    pairs = lengths.sample_pairs(fits, args.total_steps * args.pairs, seed=args.seed, max_length=length)
    n = len(pairs["prompt"])
    med = {k: statistics.median(pairs[k]) for k in ("prompt", "chosen", "rejected")}
    unique = lengths.unique_tokens(pairs, list(range(n))) / n
    return (f"{fits.name} lengths (log-normal fits; median prompt {med['prompt']:.0f}, chosen {med['chosen']:.0f}, "
            f"rejected {med['rejected']:.0f} tokens in this draw; {unique:.0f} unique tokens a pair), max_length "
            f"{length}: {pairs['dropped']} pairs dropped (prompt >= max_length), {pairs['truncated']} of {n} "
            "truncated")


def grouping_note(args, length: int) -> str:
    """How much TRL's length grouping pads here against a full epoch's mega-batches.

    transformers' LengthGroupedSampler sorts mega-batches of min(N / (4 P), 50) steps of
    P pairs: over this benchmark's few timed steps that is less than over a real dataset,
    so the padding it would reach there is simulated on a larger draw of the same fits.
    """
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    fits = lengths.DATASETS[args.real_lengths]
    timed = args.timed_steps * args.pairs
    here = max(1, min(timed // (4 * args.pairs), 50))
    big = lengths.sample_pairs(fits, 200 * args.pairs, seed=args.seed + 1, max_length=length)
    rows = [p + max(c, r) for p, c, r in zip(big["prompt"], big["chosen"], big["rejected"])]
    order = get_length_grouped_indices(rows, args.pairs, generator=torch.Generator().manual_seed(args.seed))
    every = list(range(len(rows)))
    ratio = lengths.padded_tokens(big, order, args.per_device_train_batch_size) / lengths.unique_tokens(big, every)
    random = lengths.padded_tokens(big, every, args.per_device_train_batch_size) / lengths.unique_tokens(big, every)
    return (f"TRL's group_by_length sorts mega-batches of {here} step(s) of {args.pairs} pairs here; over "
            f"{len(rows)} pairs (mega-batches of 50 steps) it would run {ratio:.2f} backbone tokens per unique "
            f"token, against {random:.2f} padded in random order (simulated, not trained)")


def table(length: int, results: dict[str, dict], skipped: dict, args) -> str:
    base = results.get("trl_liger") if results.get("trl_liger", {}).get("status") == "ok" else None
    title = (f"### {args.real_lengths}, max_length {length} ({args.pairs} pairs/step, micro-batch "
             f"{args.per_device_train_batch_size} x GA {args.pairs // args.per_device_train_batch_size}, "
             f"{args.timed_steps} timed steps)")
    rows = []
    for config in REAL:
        r = results.get(config)
        if r is None:
            if config in args.configs:
                why = f"skipped: {skipped[config]}" if skipped.get(config) else "not run"
                rows.append([config, why] + [""] * 7)
            continue
        if r["status"] != "ok":
            what = "OOM" if r["status"] == "OOM" else f"error ({r.get('error', '')[:80]})"
            rows.append([config, what, "", "", "", fmt(r.get("peak_gib"), ".1f"), "", "", ""])
            continue
        work = r["backbone_tokens"] / r["unique_tokens"]
        rows.append([config, f"{r['pairs_per_s']:,.1f}", f"{r['unique_tokens_per_s']:,.0f}", f"{work:.2f}",
                     f"{r['pairs_per_step']:.1f}",
                     fmt(r.get("peak_gib"), ".1f"), ", ".join(f"{x:.4f}" for x in first(r, "loss")),
                     ratio(r["pairs_per_s"], base["pairs_per_s"]) if base else "—",
                     ratio(r.get("peak_gib"), base.get("peak_gib")) if base else "—"])
    columns = ["config", "pairs/s", "unique tok/s", "backbone tokens / unique", "pairs/step", "peak GiB",
               "first losses", "pairs/s vs TRL+Liger", "memory vs TRL+Liger"]
    return title + "\n\n" + markdown(columns, rows, numeric={1, 2, 3, 4, 5, 7, 8})


def check_agreement(length: int, results: dict[str, dict], args) -> str:
    """Every run with a fixed order takes the warm-up rows in the same order: their logps
    must agree there. Token-budget runs batch the pairs their own way and are not held.

    The loss is held among ours only: TRL applies Liger's kernels to the policy and not
    to its reference, so its first loss is not ln 2 (see compare.check_agreement).
    """
    steps = min(3, args.warmup_steps)
    names = [c for c in REAL if results.get(c, {}).get("status") == "ok" and not REAL[c].token_budget]
    trl = tuple(c for c in names if REAL[c].is_trl)
    names = [c for c in names if c not in trl] + list(trl)  # ours first: the loss is compared to ours
    checks = [agreement.Check("loss", args.loss_atol, steps, skip=trl),
              agreement.Check("logps/chosen", args.logps_atol, steps),
              agreement.Check("logps/rejected", args.logps_atol, steps)]
    found = agreement.compare(results, names, checks)
    log(f"\nAgreement on the {steps} warm-up step(s) every run takes in the same order ({', '.join(names)}; "
        f"loss within {args.loss_atol:g} among ours, logps within {args.logps_atol:g} nats):")
    for line in found.lines:
        log("  " + line)
    if found.verdict == "void":
        log("\n" + "!" * 78 + f"\n!!  COMPARISON VOID ({args.real_lengths}): the runs do not compute the same "
            "loss on the same tokens\n" + "!" * 78)
    else:
        log("  " + found.verdict)
    return found.verdict


def real_lengths(args, skipped) -> tuple[dict, list[str]]:
    length = args.lengths[0]
    log("\n" + describe(args, length))
    results = {}
    for config in args.configs:
        if skipped[config]:
            log(f"  {config}: skipped: {skipped[config]}")
            continue
        log(f"  {config}: running ...")
        r = launch(args, config, length, f"{args.real_lengths}-{config}-{length}")
        results[config] = r
        if r["status"] == "ok":
            log(f"  {config}: {r['pairs_per_s']:,.1f} pairs/s, {r['unique_tokens_per_s']:,.0f} unique tok/s, peak "
                f"{fmt(r.get('peak_gib'), '.2f')} GiB ({r['wall_s']:.0f} s)")
        else:
            log(f"  {config}: {r['status']} ({r.get('error', '')[:200]})")
        write_markdown(args, [describe(args, length) + "\n\n" + table(length, results, skipped, args)])
    text = describe(args, length) + "\n\n" + table(length, results, skipped, args)
    if any(run.order == "grouped" for name, run in REAL.items() if name in args.configs):
        text += "\n\n" + grouping_note(args, length)
    log("\n" + text + "\n")
    check_agreement(length, results, args)
    return {str(length): results}, [text]
