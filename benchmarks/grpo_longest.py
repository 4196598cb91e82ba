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
"""

from __future__ import annotations

import os
import sys

from benchmarks.builders import grpo
from benchmarks.harness import runner
from benchmarks.harness.bisect import longest_that_fits
from benchmarks.harness.env import log
from benchmarks.harness.tables import fmt, markdown

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
        f"{args.num_generations} completions, micro-batch {args.per_device_train_batch_size}, "
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
             f"{args.num_generations} completions (micro-batch {args.per_device_train_batch_size}, "
             f"{grpo.checkpointing_words(args)}, {args.prompt_length}-token prompts, "
             f"completions of random ids at full length, steps of {args.search_step})")
    return out, title + "\n\n" + markdown(["config", "longest max_completion_length", "peak GiB at it"], rows,
                                          numeric={1, 2})
