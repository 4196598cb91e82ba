"""One DPO configuration at one length, in its own subprocess (`e2e_dpo.py --worker`)."""

from __future__ import annotations

import os
import sys

from benchmarks.builders.dpo_configs import FIXED, REAL, DPORun
from benchmarks.dpo_modes.memory import snapshot_unsupported
from benchmarks.harness import runner
from benchmarks.harness.env import REPO, log

SCRIPT = str(REPO / "benchmarks" / "e2e_dpo.py")


def run_of(args, name: str) -> DPORun:
    """The configuration `name` in this mode's table."""
    return (REAL if args.real_lengths else FIXED)[name]


def worker_argv(args, config: str, length: int, *, warmup: int | None = None, timed: int | None = None) -> list[str]:
    argv = [sys.executable, "-u", SCRIPT, "--worker", config,
            "--device", args.device, "--lengths", str(length), "--prompt_length", str(args.prompt_length),
            "--pairs", str(args.pairs), "--per_device_train_batch_size", str(args.per_device_train_batch_size),
            "--warmup_steps", str(args.warmup_steps if warmup is None else warmup),
            "--timed_steps", str(args.timed_steps if timed is None else timed),
            "--dtype", args.dtype, "--learning_rate", repr(args.learning_rate), "--beta", repr(args.beta),
            "--seed", str(args.seed), "--model_dir", args.model_dir,
            "--max_tokens_per_batch", str(args.max_tokens_per_batch)]
    if args.real_lengths:
        argv += ["--real_lengths", args.real_lengths]
    if args.fake_oom_above is not None:
        argv += ["--fake_oom_above", str(args.fake_oom_above)]
    if args.trace:
        argv += ["--trace", os.path.abspath(args.trace)]
    for flag in ("tiny", "gradient_checkpointing", "precompute_ref_log_probs", "profile", "memory_snapshot"):
        if getattr(args, flag) and not (flag == "memory_snapshot" and snapshot_unsupported(args, run_of(args, config))):
            argv.append("--" + flag)
    return argv


def launch(args, config: str, length: int, tag: str, **steps) -> dict:
    """Runs `config` at `length` (steps: warmup=, timed= override the settings)."""
    why_not = snapshot_unsupported(args, run_of(args, config)) if args.memory_snapshot else None
    if why_not:
        log(f"  ({config}: no memory snapshot: {why_not})")
    result = runner.launch(worker_argv(args, config, length, **steps), tag, log_dir=args.log_dir,
                           device=args.device, gpu=args.gpu, timeout=args.worker_timeout)
    result.setdefault("config", config)
    result.setdefault("length", length)
    return result
