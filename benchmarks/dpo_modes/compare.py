"""The fixed-length comparison: every configuration at each length, a table per length,
and the check that the trainers computed the same loss on the same tokens."""

from __future__ import annotations

import math

from benchmarks.builders.dpo_configs import BASELINES, FIXED
from benchmarks.dpo_modes.launch import launch
from benchmarks.dpo_modes.memory import log_memory
from benchmarks.harness import agreement
from benchmarks.harness.agreement import first
from benchmarks.harness.env import log
from benchmarks.harness.profiling import format_profile
from benchmarks.harness.tables import fmt, markdown, ratio, write_markdown

LN2 = math.log(2.0)
LABELS = {"trl_liger": "TRL+Liger", "trl": "TRL"}


def baseline(results: dict[str, dict]) -> str | None:
    """The first of BASELINES that ran: the ratios' denominator."""
    return next((c for c in BASELINES if results.get(c, {}).get("status") == "ok"), None)


def table(length: int, results: dict[str, dict], skipped: dict[str, str | None], args) -> str:
    base_name = baseline(results)
    base = results.get(base_name) if base_name else None
    label = LABELS.get(base_name, "TRL+Liger")
    title = (f"### length {length} ({args.pairs} pairs/step = {2 * args.pairs * length} tokens, "
             f"micro-batch {args.per_device_train_batch_size} x GA {args.pairs // args.per_device_train_batch_size}"
             f"{', gradient checkpointing' if args.gradient_checkpointing else ''}"
             f"{', precomputed reference' if args.precompute_ref_log_probs else ''})")
    rows = []
    for config in FIXED:
        if config not in results:
            if config in args.configs:
                why = f"skipped: {skipped[config]}" if skipped.get(config) else "not run"
                rows.append([config, why] + [""] * 6)
            continue
        r = results[config]
        if r["status"] != "ok":
            what = "OOM" if r["status"] == "OOM" else f"error ({r.get('error', '')[:80]})"
            rows.append([config, what, "", "", fmt(r.get("peak_gib"), ".1f"), "", "", ""])
            continue
        losses = ", ".join(f"{x:.4f}" for x in first(r, "loss"))
        speed = ratio(r["tokens_per_s"], base["tokens_per_s"]) if base else "—"
        memory = ratio(r.get("peak_gib"), base.get("peak_gib")) if base else "—"
        rows.append([config, f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_loop']:,.0f}",
                     f"{r['tokens_per_s_train']:,.0f}", fmt(r.get("peak_gib"), ".1f"), losses, speed, memory])
    columns = ["config", "tok/s", "tok/s loop", "tok/s train()", "peak GiB", "first losses",
               f"speed vs {label}", f"memory vs {label}"]
    return title + "\n\n" + markdown(columns, rows, numeric={1, 2, 3, 4, 6, 7})


def check_agreement(length: int, results: dict[str, dict], args) -> str:
    """Ours fused, ours unfused and TRL must agree on the first steps.

    Returns "agree", "void" (they ran and disagree) or "incomplete" (fewer than two ran).
    When TRL (unfused) did not run, TRL + Liger stands in for it, said so.

    Tolerances (bf16):
    - loss, absolute (default 5e-2), first 3 steps: every run starts at exactly ln 2 (policy
      == reference), and the later losses depend on the first updates. With bf16 weights,
      AdamW's first update is about lr * sign(grad) per weight, and at lr 1e-6 it survives
      bf16 rounding only for the smallest weights, so which weights move is decided by
      rounding and by kernels that are not bit-reproducible (attention backward, split-K
      GEMMs). Two runs of the SAME configuration differed by up to 0.024 at steps 2-3 on the
      H200 (2026-12-02, docs/benchmarks.md); the tolerance is about twice that noise. (It
      was 2e-2 until then, which was below that noise: it voided runs that agreed.)
    - logps/chosen and logps/rejected, first 3 steps, absolute (default 2.0 nats): the mean
      over pairs of a sequence's summed log-prob (~ -L ln V). Implementations differ by
      0.01-0.6 nats (bf16 rounding of ~1.8k-3.8k per-token values); a different row or a
      different model changes each per-token log-prob by ~0.5 (the random model's logits
      have std ~0.6), tens of nats on the mean. So this catches trainers fed different
      tokens or models, which the loss alone cannot at step 1; at steps 2-3 it follows the
      trajectories after the updates.
    """
    ran = lambda c: results.get(c, {}).get("status") == "ok"  # noqa: E731
    checked = [c for c, run in FIXED.items() if run.checked]
    present = [c for c in checked if ran(c)]
    stand_in = "trl_liger" if not ran("trl") and ran("trl_liger") else None
    if stand_in:
        present.append(stand_in)
    log(f"\nAgreement at length {length} ({', '.join(present) or 'no runs'}; loss within "
        f"{args.loss_atol:g}, logps within {args.logps_atol:g} nats, first 3 steps):")
    if stand_in:
        log("  (trl did not run: trl_liger stands in for it, on the logps only. Its losses are shown, not "
            "checked: TRL applies Liger's kernels to the policy but not to the reference model, so policy and "
            "reference differ by kernel rounding from step 1 and its first loss is not ln 2)")
    missing = [c for c in checked if c in args.configs and not ran(c)]
    skip = (stand_in,) if stand_in else ()
    checks = [agreement.Check("loss", args.loss_atol, skip=skip), agreement.Check("logps/chosen", args.logps_atol),
              agreement.Check("logps/rejected", args.logps_atol)]
    found = agreement.compare(results, present, checks)
    if found.verdict == "incomplete":
        log("  COMPARISON INCOMPLETE: fewer than two of the checked trainers ran"
            + (f" (did not run: {missing})" if missing else ""))
        return "incomplete"
    for line in found.lines:
        log("  " + line)
    liger = results.get("trl_liger", {})  # other backbone kernels: shown, not required to match
    if liger.get("status") == "ok" and not stand_in:
        for key in ("loss", "logps/chosen", "logps/rejected"):
            d = max((abs(a - b) for a, b in zip(first(liger, key), first(results[present[0]], key))), default=0.0)
            log(f"  (trl_liger's first {key} differ from {present[0]}'s by at most {d:.4g}; not part of the check)")
    moved = max((abs(x - LN2) for c in present for x in first(results[c], "loss")), default=0.0)
    if moved < 5 * args.loss_atol:
        log(f"  note: the first losses move at most {moved:.2g} from ln 2, so the loss check is weak here "
            f"(the weights hardly change in a few steps at lr {args.learning_rate:g}, less so in bf16); "
            "the logps check carries it.")
    if found.verdict == "void":
        log("\n" + "!" * 78 + f"\n!!  COMPARISON VOID at length {length}: the trainers do not compute the same "
            "loss on the same tokens\n" + "!" * 78)
        return "void"
    if missing:
        log(f"  agree, but incomplete: {missing} did not run")
        return "incomplete"
    log("  agree")
    return "agree"


def targets(length: int, results: dict[str, dict]) -> None:
    """Speed and memory of each ours_fused* run against TRL + Liger (issue 6's targets)."""
    base = results.get("trl_liger", {})
    if base.get("status") != "ok":
        return
    for config, run in FIXED.items():
        ours = results.get(config, {})
        if run.is_trl or not run.fused_head or ours.get("status") != "ok":
            continue
        speed = ours["tokens_per_s"] / base["tokens_per_s"]
        line = (f"Targets at {length} (issue 6), {config}: speed {speed:.2f}x TRL+Liger "
                f"(>= 1.3: {'met' if speed >= 1.3 else 'NOT met'})")
        if ours.get("peak_gib") and base.get("peak_gib"):
            mem = ours["peak_gib"] / base["peak_gib"]
            line += f"; memory {mem:.2f}x (<= 0.8: {'met' if mem <= 0.8 else 'NOT met'})"
        log(line)


def benchmark(args, skipped) -> tuple[dict, list[str]]:
    """Every configuration at every length. Returns (results by length, the tables)."""
    all_results: dict = {}
    tables: list[str] = []
    void, incomplete = [], []
    for length in args.lengths:
        log(f"\n== length {length} ==")
        results = {}
        for config in args.configs:
            if skipped[config]:
                log(f"  {config}: skipped: {skipped[config]}")
                continue
            log(f"  {config}: running ...")
            r = launch(args, config, length, f"{config}-{length}")
            results[config] = r
            if r["status"] == "ok":
                log(f"  {config}: {r['tokens_per_s']:,.0f} tok/s, peak {fmt(r.get('peak_gib'), '.2f')} GiB, "
                    f"losses {', '.join(f'{x:.4f}' for x in first(r, 'loss'))} ({r['wall_s']:.0f} s)")
            else:
                log(f"  {config}: {r['status']} ({r.get('error', '')[:200]})")
            log_memory(config, length, r)
            if r.get("profile"):
                log("\n".join("  " + config + " " + line for line in format_profile(r["profile"])[:1])
                    + "\n" + "\n".join("  " + line for line in format_profile(r["profile"])[1:]))
        tables.append(table(length, results, skipped, args))
        log("\n" + tables[-1] + "\n")
        write_markdown(args, tables)
        verdict = check_agreement(length, results, args)
        if verdict == "void":
            void.append(length)
        elif verdict == "incomplete":
            incomplete.append(length)
        targets(length, results)
        all_results[str(length)] = results
    if void:
        log("\n" + "!" * 78 + f"\n!!  COMPARISON VOID at length(s) {void}: see above\n" + "!" * 78)
    if incomplete:
        log(f"\nComparison incomplete at length(s) {incomplete}: a checked trainer did not run (see above).")
    return all_results, tables
