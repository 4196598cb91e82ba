"""End-to-end on-policy distillation on one GPU: TRL 1.16's DistillationTrainer and ours, side by side.

The student is the model every benchmark here trains (a Qwen2.5-0.5B-shaped random init,
bf16), the teacher a Qwen2.5-1.5B-shaped one (the same vocabulary and tokenizer), both saved
once and loaded by path. Each optimizer step samples one completion for each of
per_device_train_batch_size x gradient_accumulation_steps prompts (TRL's generation batch;
default 8 x 8) of --prompt_length random tokens, at most --new_tokens long, with lengths
drawn from --completion_lengths (default lognormal:300:1500: benchmarks/builders/ending.py's
hook on the student, the model whose forward both trainers' generators call; `fixed`: every
completion runs to --new_tokens); the teacher scores them and the student learns the
generalised JSD (--beta, TRL's default 1: reverse KL). TRL samples with transformers'
generate (no vLLM), its compilation disabled. Each configuration runs in its own subprocess
(builders/distill.py).

Reported per configuration: completions/s (completions a step over the median timed step),
the share of the step spent generating (the time inside the trainer's generation call,
after a synchronize) and training (the rest: both models' forwards, the divergence, the
backward, the optimizer), the mean completion length the trainer logged, peak memory, and
both against TRL's. The peak is split (`harness/step_memory.py`): "at rest" is what is
allocated when the first timed step starts (weights, optimizer state, the teacher: alike for
both trainers), "step" the largest rise of a timed step above its own start (gradients,
activations, the divergence's blocks, the generation's cache: where they differ). After the
table, every configuration's divergence at each step.

Examples:
    python benchmarks/e2e_distill.py                                    # GPU: trl and ours
    python benchmarks/e2e_distill.py --configs ours ours_generate trl --timed_steps 3
    python benchmarks/e2e_distill.py --configs ours ours_padding_free trl --max_tokens_per_batch 4096
    python benchmarks/e2e_distill.py --device cpu --tiny                # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.builders import distill, ending  # noqa: E402
from benchmarks.builders.model import build_model, model_config  # noqa: E402
from benchmarks.harness import agreement, rollout  # noqa: E402
from benchmarks.harness.env import gpu_info, log, versions, versions_line  # noqa: E402
from benchmarks.harness.tables import fmt, markdown, ratio, write_markdown  # noqa: E402

# Passed on to each worker as --KEY VALUE.
FORWARDED = ("device", "per_device_train_batch_size", "gradient_accumulation_steps", "new_tokens", "prompt_length",
             "completion_lengths", "warmup_steps", "timed_steps", "learning_rate", "beta", "temperature", "dtype",
             "seed", "model_dir", "teacher_dir", "max_tokens_per_batch")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if present")
    a("--tiny", action="store_true", help="tiny models, few short completions (CPU smoke test)")
    a("--configs", nargs="+", choices=list(distill.RUNS), default=None, help=f"default: {distill.DEFAULT}")
    a("--per_device_train_batch_size", type=int, default=None, help="completions per micro-batch; default 8 (--tiny: 2)")
    a("--gradient_accumulation_steps", type=int, default=None,
      help="micro-batches per optimizer step (prompts a step = this x the micro-batch); default 8 (--tiny: 2)")
    a("--new_tokens", "--max_completion_length", dest="new_tokens", type=int, default=None,
      help="max_completion_length; default 2048 (--tiny: 16)")
    a("--prompt_length", type=int, default=None, help="default 128 (--tiny: 8)")
    a("--completion_lengths", default=None,
      help="lognormal:MEDIAN:P95 (completions end at lengths of that distribution, truncated at --new_tokens, for "
           "TRL's sampler and ours alike: benchmarks/builders/ending.py) or fixed (every one runs to --new_tokens); "
           "default lognormal:300:1500 (--tiny: lognormal:4:12)")
    a("--max_tokens_per_batch", type=int, default=None,
      help="ours_padding_free's token budget (0: --prompt_length + --new_tokens, one sequence's row, the smallest "
           "that trains); default: none, each micro-batch one packed row")
    a("--warmup_steps", type=int, default=1)
    a("--timed_steps", type=int, default=2)
    a("--gradient_checkpointing", action="store_true", help="both trainers (TRL 1.16's default; off here unless asked)")
    a("--log_parts", action="store_true",
      help="ours: each micro-batch part's divergence sum and token count, by step, after the table (a host read "
           "each part: for looking into the loss, not for timing)")
    a("--learning_rate", type=float, default=1e-6, help="TRL's default")
    a("--beta", type=float, default=1.0, help="the divergence: 0 forward KL, 0.5 JSD, 1 reverse KL (TRL's default)")
    a("--temperature", type=float, default=1.0, help="sampling and loss temperature (TRL's default)")
    a("--loss_atol", type=float, default=None,
      help="first-step loss agreement of trl and ours_generate; default 1e-4 (bf16: 2e-2)")
    a("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 (--device cpu: fp32)")
    a("--seed", type=int, default=0)
    a("--worker_timeout", type=int, default=1200)
    a("--log_dir", default=None)
    a("--json_out", default=None)
    a("--markdown_out", default=None, help="also write the table to this file")
    a("--model_dir", default=None, help="reuse a saved student")
    a("--teacher_dir", default=None, help="reuse a saved teacher")
    a("--worker", choices=list(distill.RUNS), default=None, help=argparse.SUPPRESS)
    a("--result", default=None, help=argparse.SUPPRESS)
    rollout.add_step_record_flags(p)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, big, small in (("per_device_train_batch_size", 8, 2), ("gradient_accumulation_steps", 8, 2),
                            ("new_tokens", 2048, 16), ("prompt_length", 128, 8),
                            ("completion_lengths", "lognormal:300:1500", "lognormal:4:12")):
        if getattr(args, key) is None:
            setattr(args, key, small if args.tiny else big)
    if args.dtype is None:
        args.dtype = "fp32" if args.device == "cpu" else "bf16"
    if args.loss_atol is None:
        args.loss_atol = 2e-2 if args.dtype == "bf16" else 1e-4
    if args.warmup_steps < 1 or args.timed_steps < 1:
        p.error("need --warmup_steps >= 1 and --timed_steps >= 1")
    if not 0.0 <= args.beta <= 1.0:
        p.error(f"--beta must be in [0, 1]; got {args.beta}")
    rollout.check_step_records(p, args)
    try:
        args.fit = ending.parse_fit(args.completion_lengths)
    except ValueError as error:
        p.error(str(error))
    return args


def run_worker(args) -> int:
    from fusedalign.models import load_tokenizer

    run = distill.RUNS[args.worker]

    def build(callback, timers):
        return distill.build(run, args, rollout.worker_dir(args, run.name),
                             distill.prompt_rows(args, model_config(args.tiny).vocab_size),
                             load_tokenizer("builtin:tiny-qwen2"), callback, timers)

    return rollout.run_worker(args, run.name, build, distill.prompts_per_step(args))


def table(args, results: dict) -> str:
    base = results.get("trl") if results.get("trl", {}).get("status") == "ok" else None
    columns = ["config", "completions/s", "s a step", "generation %", "training %", "mean completion tokens",
               "peak GiB", "at rest GiB", "step GiB", "vs trl", "peak vs trl", "step vs trl"]
    rows = []
    for name in args.configs:
        r = results.get(name, {"status": "not run", "reason": "not run"})
        if r.get("status") != "ok":
            reason = r.get("reason") or f"{r['status']}: {r.get('error', '')[:80]}"
            rows.append([name, reason] + [""] * (len(columns) - 2))
            continue
        share = r.get("generation_share")
        rows.append([name, f"{r['completions_per_s']:,.2f}", f"{r['median_step_s']:.2f}",
                     fmt(None if share is None else 100 * share, ".0f"),
                     fmt(None if share is None else 100 * (1 - share), ".0f"),
                     fmt(r.get("mean_completion_length"), ".0f"), fmt(r.get("peak_gib"), ".1f"),
                     fmt(r.get("resident_gib"), ".1f"), fmt(r.get("step_gib"), ".1f"),
                     ratio(r["completions_per_s"], base["completions_per_s"]) if base else "—",
                     ratio(r.get("peak_gib"), base.get("peak_gib")) if base else "—",
                     ratio(r.get("step_gib"), base.get("step_gib")) if base else "—"])
    title = (f"### On-policy distillation, {distill.prompts_per_step(args)} prompts x 1 completion of <= "
             f"{args.new_tokens} tokens a step ({args.prompt_length}-token prompts, completion lengths "
             f"{args.completion_lengths}, micro-batch {args.per_device_train_batch_size} x "
             f"{args.gradient_accumulation_steps}, beta {args.beta:g}, "
             f"{'gradient checkpointing' if args.gradient_checkpointing else 'no gradient checkpointing'}"
             + (", ours_padding_free in rows of " + (f"at most {args.max_tokens_per_batch} tokens"
                                                     if args.max_tokens_per_batch else "one sequence")
                if "ours_padding_free" in args.configs and args.max_tokens_per_batch is not None else "")
             + f", {args.timed_steps} timed steps after {args.warmup_steps})")
    return title + "\n\n" + markdown(columns, rows, numeric=set(range(1, len(columns))))


def first_step(args, results: dict) -> tuple[str, list[str]]:
    """The first step's loss and completion length of every run, trl and ours_generate held to agree.

    Both sample with transformers' generate from the same seeded generator, over the same
    prompts in the same order (TRL's sampler, which ours keeps), so their first step trains on
    the same completions and must log the same divergence; a difference there is a different
    loss, or a sampler that drew differently. `ours` on CUDA samples with StaticDecode, whose
    draws differ: it is shown, not held to it, and so is `ours_padding_free` (StaticDecode too).
    """
    names = [n for n in ("trl", "ours_generate", "ours", "ours_padding_free") if n in args.configs]
    shown = ("ours", "ours_padding_free")
    checks = [agreement.Check("completions/mean_length", 0.0, steps=1, skip=shown),
              agreement.Check("loss", args.loss_atol, steps=1, skip=shown)]
    out = agreement.compare(results, names, checks)
    worst = ", ".join(f"{k} {v:.3g}" for k, v in out.worst.items())
    return out.verdict + (f" (largest difference: {worst})" if worst else ""), out.lines


def build_models(args) -> list[str]:
    """Builds the student and teacher that were not given; returns the directories it made."""
    made = []
    for key, shape, seed in (("model_dir", "0.5b", args.seed), ("teacher_dir", "1.5b", args.seed + 1)):
        if getattr(args, key) is None:
            setattr(args, key, tempfile.mkdtemp(prefix=f"e2e_distill-{shape}-"))
            made.append(getattr(args, key))
            log(f"{key}: " + build_model(getattr(args, key), tiny=args.tiny, dtype=args.dtype, seed=seed, shape=shape))
    return made


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    log("versions: " + versions_line(versions()))
    log(f"device: {gpu_info(0) if args.device == 'cuda' else 'cpu'}")
    args.configs = args.configs or list(distill.DEFAULT)
    skipped = distill.availability()
    args.log_dir = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="e2e_distill-"))
    os.makedirs(args.log_dir, exist_ok=True)
    made = build_models(args)
    flags = rollout.forwarded(args, FORWARDED, ("gradient_checkpointing", "tiny", "memory_snapshot", "profile",
                                                "log_parts"))
    try:
        results = rollout.launch_all(args, __file__, "distill", skipped, flags, table)
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
    text = table(args, results)
    log("\n" + text + "\n")
    verdict, lines = first_step(args, results)
    log(f"first step (trl and ours_generate train on the same completions): {verdict}")
    for line in lines:
        log("  " + line)
    snapshots = rollout.step_records_text(results)
    by_step = []
    for name in args.configs:
        losses = [e["loss"] for e in results.get(name, {}).get("logs") or [] if "loss" in e]
        if losses:
            by_step.append(f"loss by step, {name}: " + ", ".join(f"{x:.8g}" for x in losses))
        by_step += [f"  {name}: {line}" for line in distill.part_lines(rollout.output_dir(args.log_dir, name))]
    for line in by_step:
        log(line)
    with open(args.json_out or os.path.join(args.log_dir, "results.json"), "w") as f:
        json.dump({"versions": versions(), "argv": sys.argv, "settings": {k: getattr(args, k) for k in vars(args)},
                   "skipped": skipped, "first_step": verdict, "results": results}, f, indent=1, default=str)
    write_markdown(args, [text] + snapshots + (["```\n" + "\n".join(by_step) + "\n```"] if by_step else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
