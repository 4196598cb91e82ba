"""End-to-end GRPO on one GPU: TRL 1.16's GRPOTrainer (and ours, once it exists), side by side.

On the model every benchmark here trains (a Qwen2.5-0.5B-shaped random init, bf16,
saved once and loaded by path), each configuration of builders/grpo.py trains
--prompts prompts x --num_generations completions of at most --new_tokens tokens a
step (default 64 x 8 x 256, prompts of 128 tokens), without vLLM: TRL then samples with
transformers' generate, its compilation disabled. The reward is deterministic (a
function of the completion's token ids, builders/grpo.py). Each configuration runs in
its own subprocess.

Reported per configuration: completions/s (completions a step over the median timed
step), the share of the step spent generating (the time inside the trainer's generate
call, after a synchronize) and training (the rest: scoring, log-probs, backward,
optimizer), the mean completion length the trainer logged, the backbone's tokens per unique
token and its forwards a step outside generation (policy, old-policy and reference passes;
a micro-batch over the token budget runs one per part), and peak memory, split into what is
allocated when the first timed step starts ("at rest": weights, optimizer state, a
reference) and the largest rise of a timed step above its start ("step":
`harness/step_memory.py`).

Examples:
    python benchmarks/e2e_grpo.py                                   # GPU: trl and ours
    python benchmarks/e2e_grpo.py --warmup_steps 1 --timed_steps 2  # a short run
    python benchmarks/e2e_grpo.py --device cpu --tiny               # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import grpo_longest  # noqa: E402
from benchmarks.builders import ending, grpo  # noqa: E402
from benchmarks.builders.model import build_model, model_config  # noqa: E402
from benchmarks.harness import rollout  # noqa: E402
from benchmarks.harness.env import gpu_info, log, versions, versions_line  # noqa: E402
from benchmarks.harness.tables import fmt, markdown, ratio, write_markdown  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if present")
    a("--tiny", action="store_true", help="a tiny model, few short completions (CPU smoke test)")
    a("--configs", nargs="+", choices=list(grpo.RUNS), default=None, help=f"default: {grpo.DEFAULT}")
    a("--prompts", type=int, default=None, help="prompts per optimizer step; default 64 (--tiny: 4)")
    a("--num_generations", type=int, default=None, help="completions per prompt; default 8 (--tiny: 4)")
    a("--new_tokens", type=int, default=None, help="max_completion_length; default 256 (--tiny: 8)")
    a("--prompt_length", type=int, default=None, help="default 128 (--tiny: 8)")
    a("--completion_lengths", default="fixed",
      help="fixed (the random model about never ends a completion: every one runs to --new_tokens) or "
           "lognormal:MEDIAN:P95: completions end at lengths of that distribution, truncated at --new_tokens, for "
           "TRL's sampler and ours alike (benchmarks/builders/ending.py)")
    a("--per_device_train_batch_size", type=int, default=None,
      help="completions per micro-batch; accumulation = prompts x num_generations / this; default 64 (--tiny: 8)")
    a("--warmup_steps", type=int, default=None, help="default 2 (--tiny: 1)")
    a("--timed_steps", type=int, default=None, help="default 4 (--tiny: 2)")
    a("--gradient_checkpointing", action="store_true", help="both trainers (TRL 1.16's GRPO default; off here "
      "unless asked, or in --longest_search)")
    a("--checkpoint_offload", action="store_true",
      help="gradient checkpointing with the checkpointed layers' inputs in pinned host memory (transformers' "
           "gradient_checkpointing_kwargs={\"offload\": true}, from 5.17), both trainers; implies "
           "--gradient_checkpointing")
    a("--random_completions", action="store_true",
      help="replace generation by random ids, every completion --new_tokens long (both trainers; for memory)")
    a("--max_tokens_per_batch", type=int, default=None,
      help="ours' token budget, for the packed configurations (0: --prompt_length + --new_tokens, one completion's "
           "row, the smallest that trains: what --longest_search wants); default: none, one row a micro-batch")
    a("--longest_search", action="store_true",
      help="the longest max_completion_length each configuration trains at (benchmarks/grpo_longest.py); "
           "defaults then: 8 prompts x 8 completions, micro-batch 8, gradient checkpointing, random completions")
    a("--memory_fit", type=int, nargs="+", default=None, metavar="LENGTH",
      help="with --longest_search: instead of searching, the peak at each of these max_completion_lengths, the "
           "least-squares line through them and the length where it meets the GPU's memory (a prediction: where "
           "a probe near the boundary would take longer than a benchmark command may run)")
    a("--search_step", type=int, default=1024)
    a("--search_min", type=int, default=0)
    a("--search_max", type=int, default=65536)
    a("--learning_rate", type=float, default=1e-6)
    a("--beta", type=float, default=0.0, help="KL coefficient (TRL's default 0: no reference model)")
    a("--loss_type", default="dapo", help="TRL's default")
    a("--dtype", choices=["bf16", "fp32"], default=None, help="default bf16 (--device cpu: fp32)")
    a("--seed", type=int, default=0)
    a("--worker_timeout", type=int, default=1200)
    a("--log_dir", default=None)
    a("--json_out", default=None)
    a("--markdown_out", default=None, help="also write the table to this file")
    a("--model_dir", default=None, help="reuse a saved model")
    a("--worker", choices=list(grpo.RUNS), default=None, help=argparse.SUPPRESS)
    a("--result", default=None, help=argparse.SUPPRESS)
    rollout.add_step_record_flags(p)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.memory_fit and not args.longest_search:
        p.error("--memory_fit replaces --longest_search's search: give both")
    if args.memory_fit and len(set(args.memory_fit)) < 2:
        p.error(f"--memory_fit: a line needs two or more different lengths, got {args.memory_fit}")
    if args.longest_search:
        args.gradient_checkpointing = args.random_completions = True
    if args.checkpoint_offload:
        args.gradient_checkpointing = True
        why = grpo.offload_unavailable(args.device)
        if why:
            p.error(f"--checkpoint_offload: {why}")
    search = args.longest_search
    for key, big, small in (("prompts", 8 if search else 64, 4), ("num_generations", 8, 4), ("new_tokens", 256, 8),
                            ("prompt_length", 128, 8), ("per_device_train_batch_size", 8 if search else 64, 8),
                            ("warmup_steps", 2, 1), ("timed_steps", 4, 2)):
        if getattr(args, key) is None:
            setattr(args, key, small if args.tiny else big)
    if args.dtype is None:
        args.dtype = "fp32" if args.device == "cpu" else "bf16"
    if (args.prompts * args.num_generations) % args.per_device_train_batch_size:
        p.error(f"--prompts x --num_generations ({args.prompts * args.num_generations}) is not a multiple of "
                f"--per_device_train_batch_size {args.per_device_train_batch_size}")
    if args.warmup_steps < 1 or args.timed_steps < 1:
        p.error("need --warmup_steps >= 1 and --timed_steps >= 1")
    rollout.check_step_records(p, args)
    try:
        args.fit = ending.parse_fit(args.completion_lengths)
    except ValueError as error:
        p.error(str(error))
    return args


class BackboneTokens:
    """A StepTimer hook and the model's forward pre-hook: the tokens the backbone was given in each
    step's forwards other than generation (policy, old-policy and reference passes; padding and
    repeated prompts included), to set against the step's unique tokens."""

    def __init__(self):
        self.total, self.at_begin, self.per_step = 0, 0, []
        self.calls, self.calls_at_begin, self.calls_per_step = 0, 0, []

    def count(self, module, args, kwargs) -> None:
        if ending.decoding(kwargs):
            return  # a generation forward
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.total += ids.numel()
            self.calls += 1

    def begin(self, step: int) -> None:
        self.at_begin, self.calls_at_begin = self.total, self.calls

    def end(self, step: int, seconds: float) -> None:
        self.per_step.append(self.total - self.at_begin)
        self.calls_per_step.append(self.calls - self.calls_at_begin)


def tokens_per_unique(args, backbone: BackboneTokens, logs: list[dict]) -> float | None:
    """Median over the timed steps of backbone tokens / unique tokens (each prompt once, every
    completion token once)."""
    timed = slice(args.warmup_steps, args.warmup_steps + args.timed_steps)
    ratios = []
    for tokens, entry in zip(backbone.per_step[timed], logs[timed]):
        mean = entry.get("completions/mean_length")
        if mean is not None and tokens:
            ratios.append(tokens / (args.prompts * (args.prompt_length + args.num_generations * mean)))
    return statistics.median(ratios) if ratios else None


def run_worker(args) -> int:
    from fusedalign.models import load_tokenizer

    run = grpo.RUNS[args.worker]
    grpo.apply_micro_batch(run, args)
    vocab = model_config(args.tiny).vocab_size

    def build(callback, timers):
        return grpo.build(run, args, rollout.worker_dir(args, run.name), grpo.prompt_rows(args, vocab),
                          load_tokenizer("builtin:tiny-qwen2"), callback, timers, vocab)

    def instrument(trainer, callback):
        backbone = BackboneTokens()
        trainer.model.register_forward_pre_hook(backbone.count, with_kwargs=True)
        callback.hooks.append(backbone)
        def more() -> dict:
            timed = backbone.calls_per_step[args.warmup_steps:args.warmup_steps + args.timed_steps]
            return {"tokens_per_unique": tokens_per_unique(args, backbone, callback.logs),
                    "forwards_per_step": statistics.median(timed) if timed else None}

        return more

    return rollout.run_worker(args, run.name, build, args.prompts * args.num_generations, instrument)


def table(args, results: dict) -> str:
    base = results.get("trl") if results.get("trl", {}).get("status") == "ok" else None
    rows = []
    for name in args.configs:
        r = results.get(name, {"status": "not run", "reason": "not run"})
        if r.get("status") != "ok":
            rows.append([name, r.get("reason") or f"{r['status']}: {r.get('error', '')[:80]}"] + [""] * 11)
            continue
        share = r.get("generation_share")
        rows.append([name, f"{r['completions_per_s']:,.1f}", f"{r['median_step_s']:.2f}",
                     fmt(None if share is None else 100 * share, ".0f"),
                     fmt(None if share is None else 100 * (1 - share), ".0f"),
                     fmt(r.get("mean_completion_length"), ".0f"), fmt(r.get("tokens_per_unique"), ".2f"),
                     fmt(r.get("forwards_per_step"), ".0f"), fmt(r.get("peak_gib"), ".1f"),
                     fmt(r.get("resident_gib"), ".1f"), fmt(r.get("step_gib"), ".1f"),
                     ratio(r["completions_per_s"], base["completions_per_s"]) if base else "—",
                     ratio(r.get("peak_gib"), base.get("peak_gib")) if base else "—"])
    title = (f"### GRPO, {args.prompts} prompts x {args.num_generations} completions x <= {args.new_tokens} new "
             f"tokens a step ({args.prompt_length}-token prompts, completion lengths {args.completion_lengths}, "
             f"{grpo.micro_batch_words(args.configs, args)}, "
             f"{grpo.checkpointing_words(args)}, {args.timed_steps} timed steps after {args.warmup_steps})")
    columns = ["config", "completions/s", "s a step", "generation %", "training %", "mean completion tokens",
               "backbone tokens per unique token", "training forwards a step", "peak GiB", "at rest GiB", "step GiB",
               "vs trl", "peak vs trl"]
    return title + "\n\n" + markdown(columns, rows, numeric=set(range(1, len(columns))))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    log("versions: " + versions_line(versions()))
    log(f"device: {gpu_info(0) if args.device == 'cuda' else 'cpu'}")
    args.configs = args.configs or list(grpo.DEFAULT)
    skipped = grpo.availability(args.device)
    args.log_dir = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="e2e_grpo-"))
    os.makedirs(args.log_dir, exist_ok=True)
    own_model = args.model_dir is None
    if own_model:
        args.model_dir = tempfile.mkdtemp(prefix="e2e_grpo-model-")
        log("model: " + build_model(args.model_dir, tiny=args.tiny, dtype=args.dtype, seed=args.seed))
    if args.longest_search:
        try:
            found, text = (grpo_longest.fit(args, skipped) if args.memory_fit else grpo_longest.search(args, skipped))
        finally:
            if own_model:
                shutil.rmtree(args.model_dir, ignore_errors=True)
        log("\n" + text + "\n")
        with open(args.json_out or os.path.join(args.log_dir, "longest.json"), "w") as f:
            json.dump({"versions": versions(), "argv": sys.argv, "results": found}, f, indent=1, default=str)
        write_markdown(args, [text])
        return 0
    flags = rollout.forwarded(args, ("device", "prompts", "num_generations", "new_tokens", "prompt_length",
                                     "per_device_train_batch_size", "warmup_steps", "timed_steps", "learning_rate",
                                     "beta", "loss_type", "dtype", "seed", "model_dir", "completion_lengths",
                                     "max_tokens_per_batch"),
                              ("gradient_checkpointing", "checkpoint_offload", "random_completions", "tiny",
                               "memory_snapshot", "profile"))
    try:
        results = rollout.launch_all(args, __file__, "grpo", skipped, flags, table)
    finally:
        if own_model:
            shutil.rmtree(args.model_dir, ignore_errors=True)
    text = table(args, results)
    log("\n" + text + "\n")
    snapshots = rollout.step_records_text(results)
    with open(args.json_out or os.path.join(args.log_dir, "results.json"), "w") as f:
        json.dump({"versions": versions(), "argv": sys.argv, "settings": {k: getattr(args, k) for k in vars(args)},
                   "skipped": skipped, "results": results}, f, indent=1, default=str)
    write_markdown(args, [text] + snapshots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
