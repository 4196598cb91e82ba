"""One DPO run in this process (`e2e_dpo.py --worker CONFIG`): build, train, measure.

What is measured
- step time: from the Trainer's fetch of the step's micro-batches (where ours runs its
  reference forwards) to on_step_end, each after a synchronize (harness/timing.py);
  "tok/s" uses the median over the timed steps, "tok/s loop" the median time between
  successive step ends (adds logging).
- fixed lengths: tokens per optimizer step = every token in the step's input_ids, 2 x
  pairs x length (no padding: every sequence is at max_length exactly).
- real lengths: pairs/s = the pairs of the timed steps over their total time (steps differ
  in cost, so a median would favour an order); unique tokens/s counts each pair once
  (prompt + chosen + rejected); "backbone tokens" is what the configuration ran through
  the layers (its batches' input_ids, padding included). All three are counted from the
  batches the trainer's collator made, so a token-budget trainer, whose steps hold a
  varying number of pairs, is counted as it ran.
- with --precompute_ref_log_probs, the reference pass (timed around the trainers' own
  precompute method) is work the run does: its time is amortised over the steps it
  serves, tok/s = tokens per step / (median step + precompute / steps).
- peak GiB: torch.cuda.max_memory_allocated(), reset just before train().
"""

from __future__ import annotations

import json
import os
import statistics

from benchmarks.builders import dpo, lengths
from benchmarks.builders.model import model_config
from benchmarks.dpo_modes.launch import run_of
from benchmarks.dpo_modes.memory import log_memory
from benchmarks.harness import runner
from benchmarks.harness.env import log
from benchmarks.harness.profiling import MemoryPeakStep, ProfileStep, format_profile
from benchmarks.harness.timing import Timers, device_sync, steady, step_timer, time_from_batch_fetch


def real_rows(args, run, length: int, vocab: int):
    """Real-length rows, and the order the configurations with a fixed order take them in.

    A token-budget run gets more rows (the same first ones): its steps may hold more pairs
    than --pairs, and its epoch must outlast the steps.

    Returns:
        (rows, order): `order` is the warm-up rows in order, then the timed rows in one
        seeded permutation (the same for every configuration that takes it).
    """
    import math

    import numpy as np

    fits = lengths.DATASETS[args.real_lengths]
    n = args.total_steps * args.pairs
    pairs = lengths.sample_pairs(fits, n, seed=args.seed, max_length=length)
    if run.token_budget:
        per_pair = statistics.mean(p + c + r for p, c, r in zip(pairs["prompt"], pairs["chosen"], pairs["rejected"]))
        more = math.ceil(1.5 * args.max_tokens_per_batch / (args.per_device_train_batch_size * per_pair))
        pairs = lengths.sample_pairs(fits, n * max(2, more), seed=args.seed, max_length=length)
    warm = args.warmup_steps * args.pairs
    rest = np.random.default_rng([args.seed, 2]).permutation(np.arange(warm, n)).tolist()
    return lengths.token_rows(pairs, vocab, args.seed), [*range(warm), *rest]


class CountingCollator:
    """The trainer's collator, counting each micro-batch's pairs, unique tokens (prompt +
    chosen + rejected) and backbone tokens (the batch's input_ids, padding included)."""

    def __init__(self, collate):
        self.collate, self.batches = collate, []

    def __call__(self, examples):
        out = self.collate(examples)
        unique = sum(len(e["prompt_ids"]) + len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in examples)
        self.batches.append((len(examples), unique, int(out["input_ids"].numel())))
        return out


def run_worker(args) -> int:
    import torch
    from transformers import set_seed

    from fusedalign.models import load_tokenizer

    run, length = run_of(args, args.worker), args.lengths[0]
    cuda = args.device == "cuda"
    timers = Timers(device_sync(cuda))
    peak = (lambda: torch.cuda.max_memory_allocated() / 2**30) if cuda else (lambda: None)
    with runner.worker_result(args.result, peak) as result:
        result.update(config=run.name, length=length)
        set_seed(args.seed)
        tokenizer = load_tokenizer("builtin:tiny-qwen2")
        vocab = model_config(args.tiny).vocab_size
        order = grouped_after = None
        if args.real_lengths:
            rows, fixed = real_rows(args, run, length, vocab)
            if run.order == "grouped":
                grouped_after = args.warmup_steps * args.pairs
            else:
                order = fixed
        else:
            rows = dpo.synthetic_rows(args, length, vocab)
        timed_end = args.warmup_steps + args.timed_steps
        hooks = []
        if args.profile:
            trace = os.path.join(args.trace, f"trace-{run.name}-{length}.json.gz") if args.trace else None
            hooks.append(ProfileStep(timed_end, trace))
        if args.memory_snapshot:
            hooks.append(MemoryPeakStep(timed_end + int(args.profile), 2 * args.pairs * length))
        callback = step_timer(timers.sync, hooks)
        output_dir = os.path.join(os.path.dirname(os.path.abspath(args.result)), f"out-{run.name}-{length}")
        with timers("init"):
            trainer = dpo.build(run, args, length, output_dir, rows, tokenizer, callback, timers,
                                order=order, grouped_after=grouped_after)
        time_from_batch_fetch(trainer, callback)
        counter = CountingCollator(trainer.data_collator)
        trainer.data_collator = counter
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with timers("train"):
            if args.fake_oom_above is not None and length > args.fake_oom_above:
                raise torch.cuda.OutOfMemoryError(f"fake OOM above {args.fake_oom_above} (--fake_oom_above)")
            trainer.train()
        stats = steady(callback.begin, callback.end, args.warmup_steps, args.timed_steps)
        result.update(stats, steps=args.total_steps, init_s=timers.get("init"), train_s=timers.get("train"),
                      peak_gib=peak(), logs=callback.logs,
                      reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
                      total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None)
        for hook in hooks:
            result["profile" if isinstance(hook, ProfileStep) else "memory"] = hook.result
        if args.real_lengths:
            result.update(real_measures(args, counter.batches, trainer.args.gradient_accumulation_steps, stats))
        else:
            result.update(fixed_measures(args, run, length, stats, timers))
        result["status"] = "ok"
    log(json.dumps({k: v for k, v in result.items() if k not in ("logs", "step_times", "profile", "memory")}))
    log_memory(run.name, length, result)
    if result.get("profile"):
        log("\n".join(format_profile(result["profile"], top=40)))
    return 0 if result["status"] in ("ok", "OOM") else 1


def fixed_measures(args, run, length: int, stats: dict, timers: Timers) -> dict:
    tokens_per_step = 2 * args.pairs * length
    precompute = timers.get("precompute")
    if args.precompute_ref_log_probs and precompute == 0.0:
        raise RuntimeError("--precompute_ref_log_probs was given but no precompute pass was timed")
    steps = args.total_steps
    # TRL precomputes in __init__, ours inside train() (in its first step); count it once.
    train_wall = timers.get("train") + (precompute if run.is_trl else 0.0)
    return dict(tokens_per_step=tokens_per_step, precompute_s=precompute,
                tokens_per_s=tokens_per_step / (stats["median_step_s"] + precompute / steps),
                tokens_per_s_loop=tokens_per_step / (stats["median_loop_s"] + precompute / steps),
                tokens_per_s_train=steps * tokens_per_step / train_wall)


def real_measures(args, batches: list[tuple[int, int, int]], accumulation: int, stats: dict) -> dict:
    """Pairs and tokens of the timed steps (micro-batches [warmup, warmup + timed) x accumulation)."""
    timed = batches[args.warmup_steps * accumulation:(args.warmup_steps + args.timed_steps) * accumulation]
    if len(timed) != args.timed_steps * accumulation:
        raise RuntimeError(f"collated {len(batches)} micro-batches, fewer than the {args.total_steps} x "
                           f"{accumulation} the steps take")
    seconds = stats["total_step_s"]
    pairs, unique, work = (sum(b[i] for b in timed) for i in range(3))
    return dict(pairs_per_s=pairs / seconds, unique_tokens_per_s=unique / seconds, tokens_per_s=unique / seconds,
                timed_pairs=pairs, pairs_per_step=pairs / args.timed_steps, unique_tokens=unique,
                backbone_tokens=work, mean_step_s=seconds / args.timed_steps)
