"""e2e_grpo.py --longest_search: the longest max_completion_length each configuration trains at
--prompts x --num_generations completions (default 8 x 8, micro-batch 8, gradient checkpointing
on: TRL 1.16's defaults), by binary search over multiples of --search_step, one worker a probe
(one warm-up step and one timed step).

Every completion of a probe has exactly max_completion_length tokens: generation is replaced by
random token ids (`--random_completions`, the same for both trainers), since a random model
sampling tens of thousands of tokens a completion would take the probe's whole time and the
question is what the training step holds. A probe's peak is therefore the training step's (the
policy's and, with beta != 0, the reference's passes, the backward and the optimizer), not a
generation's KV cache.

With --memory_fit L1 L2 ... the search is replaced by a prediction: each configuration's peak at
those lengths, the least-squares line through them, and the length where it meets the GPU's
memory. That is for boundaries a probe cannot reach in a benchmark command's ten minutes: with
checkpointing a step of 64 completions holds little per token, so the boundary lies at tens of
thousands of tokens a completion, where one step's attention alone takes minutes.
"""

from __future__ import annotations

import os
import sys

from benchmarks.builders import grpo
from benchmarks.builders.model import model_config
from benchmarks.harness import runner
from benchmarks.harness.bisect import longest_that_fits, memory_line
from benchmarks.harness.decode_limit import Shape
from benchmarks.harness.env import log
from benchmarks.harness.tables import fmt, markdown, write_markdown

FORWARDED = ("device", "prompts", "num_generations", "prompt_length", "per_device_train_batch_size", "learning_rate",
             "beta", "loss_type", "dtype", "seed", "model_dir", "max_tokens_per_batch")


def probe(args, config: str, length: int) -> dict:
    argv = [sys.executable, "-u", os.path.join(os.path.dirname(os.path.abspath(__file__)), "e2e_grpo.py"),
            "--worker", config, "--new_tokens", str(length), "--warmup_steps", "1", "--timed_steps", "1",
            "--random_completions"]
    for key in FORWARDED:
        if getattr(args, key, None) is not None:
            argv += [f"--{key}", str(getattr(args, key))]
    argv += ["--gradient_checkpointing"] if args.gradient_checkpointing else []
    argv += ["--checkpoint_offload"] if args.checkpoint_offload else []
    argv += ["--tiny"] if args.tiny else []
    return runner.launch(argv, f"longest-{config}-{length}", log_dir=args.log_dir, device=args.device,
                         timeout=args.worker_timeout)


def search_one(args, config: str) -> dict:
    log(f"{config}: searching up to {args.search_max} in steps of {args.search_step} ({args.prompts} x "
        f"{args.num_generations} completions, micro-batch {grpo.micro_batch_of(grpo.RUNS[config], args)}, "
        f"{grpo.checkpointing_words(args)})")
    return longest_that_fits(lambda length: probe(args, config, length), name=config, step=args.search_step,
                             smallest=args.search_min, largest=args.search_max)


def search(args, skipped: dict) -> tuple[dict, str]:
    out = {}
    for config in args.configs:
        out[config] = ({"status": "skipped", "reason": skipped[config]} if skipped[config]
                       else search_one(args, config))
    rows = []
    for config, r in out.items():
        if r["status"] == "ok":
            value = "none" if r["longest"] is None else f"{'>= ' if r['capped'] else ''}{r['longest']:,}"
            peaks = [p["peak_gib"] for p in r["probes"] if p["status"] == "ok" and p["peak_gib"] is not None]
            peak = max(peaks) if peaks else None
            rows.append([config, value, fmt(peak, ".1f")])
        else:
            rows.append([config, f"{r['status']}: {r.get('reason') or r.get('error')}", ""])
    title = (f"### GRPO, the longest max_completion_length that trains at {args.prompts} prompts x "
             f"{args.num_generations} completions ({grpo.micro_batch_words(args.configs, args)}, "
             f"{grpo.checkpointing_words(args)}, {args.prompt_length}-token prompts, "
             f"completions of random ids at full length, steps of {args.search_step})")
    return out, title + "\n\n" + markdown(["config", "longest max_completion_length", "peak GiB at it"], rows,
                                          numeric={1, 2})


def fit_one(args, config: str) -> dict:
    """The peak at each --memory_fit length (stopping at the first that does not fit), the
    line through them and where it meets the GPU's memory."""
    log(f"{config}: peak memory at {', '.join(map(str, args.memory_fit))} ({args.prompts} x {args.num_generations} "
        f"completions, micro-batch {grpo.micro_batch_of(grpo.RUNS[config], args)}, {grpo.checkpointing_words(args)})")
    points, probes, total = [], [], None
    for length in sorted(args.memory_fit):
        r = probe(args, config, length)
        probes.append({"length": length, "status": r["status"], "peak_gib": r.get("peak_gib"),
                       "host_pinned_gib": r.get("host_pinned_gib"), "wall_s": r.get("wall_s")})
        log(f"  {length}: {r['status']}" + (f", peak {fmt(r.get('peak_gib'), '.2f')} GiB" if r.get("peak_gib") else "")
            + f" ({fmt(r.get('wall_s'), '.0f')} s, of which training {fmt(r.get('total_step_s'), '.0f')} s timed)")
        if r["status"] != "ok":
            break  # a longer one holds more
        if r.get("peak_gib") is not None:  # None on the CPU
            points.append((length, r["peak_gib"]))
            total = r.get("total_gib") or total
    entry: dict = {"status": "ok", "points": points, "probes": probes, "total_gib": total}
    if probes[-1]["status"] not in ("ok", "OOM"):
        return {**entry, "status": "error", "error": r.get("error")}
    line = memory_line(config, points, total)
    return {**entry, "status": "incomplete"} if line is None else {**entry, **line}


def fit(args, skipped: dict) -> tuple[dict, str]:
    """--memory_fit: every configuration's line, and its predicted longest against TRL's; the
    table is rewritten (--markdown_out) after each configuration, so a run cut short keeps it."""
    out: dict = {}
    for c in args.configs:
        out[c] = {"status": "skipped", "reason": skipped[c]} if skipped[c] else fit_one(args, c)
        write_markdown(args, [fit_table(args, out)])
    return out, fit_table(args, out)


def fit_table(args, out: dict) -> str:
    base = out.get("trl", {}).get("predicted")
    # TRL's longest in any of its configurations here (trl_micro1: one completion a micro-batch).
    best = max((e["predicted"] for c, e in out.items() if grpo.RUNS[c].trainer == "trl" and e.get("predicted")),
               default=None)
    # The policy's KV cache a token (the parameter count plays no part in it).
    import torch

    dtype_bytes = getattr(torch, grpo.WEIGHTS[args.dtype]).itemsize  # the policy's weights, so its KV cache
    kv = Shape.of(model_config(args.tiny), params=0, dtype_bytes=dtype_bytes).kv_bytes_per_token
    rows = []
    for config in args.configs:
        e = out.get(config, {"status": "not run", "probes": []})
        if e["status"] in ("skipped", "error", "not run"):
            rows.append([config, f"{e['status']}: {e.get('reason') or e.get('error')}" if e["status"] != "not run"
                         else "not run"] + [""] * 7)
            continue
        peaks = {p["length"]: (fmt(p["peak_gib"], ".2f") if p["status"] == "ok" else p["status"]) for p in e["probes"]}
        predicted = e.get("predicted")
        pinned = {p["length"]: fmt(p.get("host_pinned_gib"), ".2f") for p in e["probes"] if p["status"] == "ok"}
        rows.append([config, ", ".join(peaks.get(length, "not run") for length in sorted(args.memory_fit)),
                     ", ".join(pinned.get(length, "—") for length in sorted(args.memory_fit)),
                     fmt(e.get("slope_gib_per_1k"), ".3f"), fmt(e.get("max_residual_gib"), ".3f"),
                     f"~{predicted:,}" if predicted else e["status"],
                     f"{predicted / base:.2f}x" if predicted and base else "—",
                     f"{predicted / best:.2f}x" if predicted and best else "—",
                     rollout_kv(args, config, predicted, kv)])
    total = next((e["total_gib"] for e in out.values() if e.get("total_gib")), None)
    title = (f"### GRPO, the longest max_completion_length predicted to train at {args.prompts} prompts x "
             f"{args.num_generations} completions ({grpo.micro_batch_words(args.configs, args)}, "
             f"{grpo.checkpointing_words(args)}, {args.prompt_length}-token prompts, completions of random ids at "
             f"full length): the peak's least-squares line over lengths {', '.join(map(str, sorted(args.memory_fit)))}, "
             f"where it meets {fmt(total, '.1f')} GiB (a prediction, not a run at that length). The rollout's "
             f"KV cache is not in these peaks (the completions are random ids, not generated): the last column "
             f"is what it would hold at the predicted length, {kv:,} bytes a token x (prompt + completion) x "
             f"the rows decoded at once, beside the weights and optimizer state")
    return title + "\n\n" + markdown(
        ["config", "peak GiB at " + ", ".join(map(str, sorted(args.memory_fit))),
         "pinned host GiB at them (peak, offload's)", "GiB per 1k tokens of length", "worst residual GiB",
         "predicted longest max_completion_length", "vs trl", "vs TRL's longest", "rollout KV GiB at it (rows at once)"],
        rows, numeric={3, 4, 5, 6, 7, 8})


def rollout_kv(args, config: str, length: int | None, kv_bytes: int) -> str:
    """The KV cache a generation of `length`-token completions holds in this configuration's
    rollout: its rows decoded at once x (prompt + completion) tokens x `kv_bytes`."""
    rows = grpo.rows_decoded_at_once(grpo.RUNS[config], args)
    if not length:
        return f"— ({rows})"
    return f"{rows * (args.prompt_length + length) * kv_bytes / 2**30:.1f} ({rows})"
