"""What the on-policy benchmarks (e2e_grpo.py, e2e_distill.py) share: one configuration's
worker, which trains and times the steps, and the launch of each configuration in a
subprocess of its own."""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any, Callable

from benchmarks.builders import ending
from benchmarks.harness import runner
from benchmarks.harness.env import log
from benchmarks.harness.profiling import MemoryPeakStep, ProfileStep, format_profile
from benchmarks.harness.step_memory import StepMemory
from benchmarks.harness.tables import write_markdown
from benchmarks.harness.timing import (GenerationSplit, Timers, device_sync, steady, step_timer,
                                       time_from_batch_fetch)


def run_worker(args, name: str, build: Callable[[Any, Timers], Any], completions_per_step: int,
               instrument: Callable[[Any, Any], Callable[[], dict]] | None = None) -> int:
    """Trains configuration `name` and writes its result to `args.result`.

    Args:
        build: (callback, timers) -> the trainer, which calls `timers("generation")` around
            each generation and takes `callback`.
        completions_per_step: for completions/s.
        instrument: (trainer, callback) -> a function giving more result fields after
            training (called once the trainer is built).
    """
    import torch
    from transformers import set_seed

    cuda = args.device == "cuda"
    timers = Timers(device_sync(cuda))
    memory = StepMemory() if cuda else None  # the rest between steps and each step's rise above it
    timed_end = args.warmup_steps + args.timed_steps
    snapshot, profile = step_records(args, cuda, timed_end)
    peak = (lambda: memory.overall() / 2**30) if cuda else (lambda: None)
    with runner.worker_result(args.result, peak) as result:
        result.update(config=name, total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None)
        set_seed(args.seed)
        split = GenerationSplit(timers)
        callback = step_timer(timers.sync, [hook for hook in (split, memory, snapshot, profile) if hook is not None])
        with timers("init"):
            trainer = build(callback, timers)
            more = instrument(trainer, callback) if instrument is not None else dict
            if args.fit is not None:  # on the module whose forward both trainers' generators call
                ending.end_at_lengths(trainer.model, args.fit, trainer.processing_class.eos_token_id, args.new_tokens)
        time_from_batch_fetch(trainer, callback)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        stats = steady(callback.begin, callback.end, args.warmup_steps, args.timed_steps)
        timed = slice(args.warmup_steps, timed_end)
        shares = [g / s for g, s in zip(split.per_step[timed], stats["step_times"])]
        lengths = [e["completions/mean_length"] for e in callback.logs[timed] if "completions/mean_length" in e]
        result.update(stats, status="ok", peak_gib=peak(), host_pinned_gib=host_pinned_gib() if cuda else None,
                      logs=callback.logs, init_s=timers.get("init"),
                      completions_per_s=completions_per_step / stats["median_step_s"],
                      generation_share=statistics.median(shares) if shares and any(shares) else None,
                      mean_completion_length=statistics.mean(lengths) if lengths else None,
                      **(memory.summary(timed) if memory is not None else {}), **more())
        if snapshot is not None:
            result["memory"] = snapshot.result
        if profile is not None:
            result["profile"] = profile.result
    log(json.dumps({k: v for k, v in result.items() if k not in ("logs", "step_times", "memory", "profile")}))
    return 0 if result["status"] in ("ok", "OOM") else 1


def host_pinned_gib() -> float | None:
    """The most pinned host memory torch's host allocator has held in this process, GiB: where
    checkpoint offload (`gradient_checkpointing_kwargs={"offload": True}`) keeps what the layers
    save. The allocator rounds each block up to a power of two (unless PYTORCH_ALLOC_CONF's
    pinned_max_round_threshold_mb says otherwise), and this counts the rounded blocks, as the
    host's memory does. None where this torch does not report it."""
    import torch

    try:
        return torch.cuda.host_memory_stats()["allocated_bytes.peak"] / 2**30
    except Exception:  # noqa: BLE001 (a reading the run can do without must not fail it)
        return None


def step_records(args, cuda: bool, timed_end: int) -> tuple[MemoryPeakStep | None, ProfileStep | None]:
    """The hooks of the steps after the timed ones (neither is timed): --memory_snapshot's
    allocator history over step `timed_end`, then --profile's torch.profiler over the next."""
    snapshot = MemoryPeakStep(timed_end, None) if cuda and getattr(args, "memory_snapshot", False) else None
    profile = (ProfileStep(timed_end + int(snapshot is not None)) if cuda and getattr(args, "profile", False)
               else None)
    return snapshot, profile


def add_step_record_flags(parser) -> None:
    """`--memory_snapshot`: what is alive at the peak of one more step after the timed ones;
    `--profile`: where the GPU time of one more step goes."""
    parser.add_argument("--memory_snapshot", action="store_true",
                        help="record the CUDA allocator's history over one more step after the timed ones and "
                             "list what is alive at its peak, by the line that allocated it (GPU only)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step after the timed ones (and after --memory_snapshot's) with "
                             "torch.profiler: its wall time against the GPU's busy time, its CUDA kernels by kind "
                             "and the top kernels (GPU only)")


def check_step_records(parser, args) -> None:
    """Refuses --memory_snapshot and --profile off CUDA, and makes room for their steps."""
    for flag, what in (("memory_snapshot", "records the CUDA allocator's history"),
                       ("profile", "lists the step's CUDA kernels")):
        if getattr(args, flag) and args.device != "cuda":
            parser.error(f"--{flag} {what}: it needs --device cuda")
    args.total_steps = args.warmup_steps + args.timed_steps + int(args.memory_snapshot) + int(args.profile)


def memory_snapshots(results: dict[str, dict]) -> list[str]:
    """With --memory_snapshot: each configuration's breakdown of its recorded step's peak, as
    markdown (logged too)."""
    from benchmarks.memory_peak import format_breakdown

    texts = []
    for name, r in results.items():
        if r.get("memory"):
            texts.append(f"#### memory at the peak of the recorded step, {name}\n\n{format_breakdown(r['memory'])}")
            log("\n" + texts[-1] + "\n")
    return texts


def profiles(results: dict[str, dict], top: int = 25) -> list[str]:
    """With --profile: each configuration's profiled step (wall against GPU busy time, kernels
    by kind, the top kernels), as markdown (logged too)."""
    texts = []
    for name, r in results.items():
        if r.get("profile"):
            lines = format_profile(r["profile"], top)
            texts.append(f"#### the profiled step, {name}\n\n```\n" + "\n".join(lines) + "\n```")
            log("\n" + texts[-1] + "\n")
    return texts


def step_records_text(results: dict[str, dict]) -> list[str]:
    """What the steps after the timed ones recorded, each configuration's: --memory_snapshot's
    breakdowns, then --profile's profiles."""
    return memory_snapshots(results) + profiles(results)


def worker_dir(args, name: str) -> str:
    """The output directory of configuration `name`'s trainer, beside its result file."""
    return output_dir(os.path.dirname(os.path.abspath(args.result)), name)


def output_dir(log_dir: str, name: str) -> str:
    """Configuration `name`'s trainer output directory in `log_dir` (where `launch_all` puts its result)."""
    return os.path.join(log_dir, f"out-{name}")


def launch_all(args, script: str, tag: str, skipped: dict[str, str | None], worker_flags: list[str],
               table: Callable[[Any, dict], str]) -> dict[str, dict]:
    """Runs `script --worker NAME *worker_flags` for each of `args.configs` not `skipped`, one
    subprocess each, rewriting the markdown table after each; returns the results by name."""
    results: dict[str, dict] = {}
    for name in args.configs:
        if skipped[name]:
            log(f"{name}: skipped: {skipped[name]}")
            results[name] = {"status": "skipped", "reason": f"skipped: {skipped[name]}"}
            continue
        log(f"{name}: running ...")
        argv = [sys.executable, "-u", os.path.abspath(script), "--worker", name] + worker_flags
        results[name] = runner.launch(argv, f"{tag}-{name}", log_dir=args.log_dir, device=args.device,
                                      timeout=args.worker_timeout)
        write_markdown(args, [table(args, results)])
    return results


def forwarded(args, keys: tuple[str, ...], switches: tuple[str, ...] = ()) -> list[str]:
    """`--KEY VALUE` for each of `keys` that is set, and `--SWITCH` for each switch that is on."""
    flags = []
    for key in keys:
        if getattr(args, key) is not None:
            flags += [f"--{key}", str(getattr(args, key))]
    return flags + [f"--{s}" for s in switches if getattr(args, s)]
