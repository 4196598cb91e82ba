"""The command line of `benchmarks/e2e_dpo.py` and its defaults."""

from __future__ import annotations

import argparse

from benchmarks.builders.dpo_configs import ALL_NAMES, FIXED, REAL, REAL_DEFAULT, SEARCH_DEFAULT
from benchmarks.builders.lengths import DATASETS


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if present")
    a("--tiny", action="store_true", help="a tiny model and short sequences (CPU smoke test)")
    a("--lengths", type=int, nargs="+", default=None,
      help="sequence lengths (= max_length); default 2048 4096 (--tiny: 64); with --real_lengths the one "
           "max_length, default 2048 (--tiny: 512)")
    a("--prompt_length", type=int, default=None, help="default 256 (--tiny: 16)")
    a("--pairs", type=int, default=None, help="preference pairs per optimizer step; default 8 (--real_lengths: 64)")
    a("--per_device_train_batch_size", type=int, default=None,
      help="pairs per micro-batch; gradient accumulation = pairs / this; default 8 (--tiny --real_lengths: 4)")
    a("--warmup_steps", type=int, default=None, help="untimed steps first (>= 1); default 3 (--tiny: 1)")
    a("--timed_steps", type=int, default=None, help="default 8 (--tiny: 2)")
    a("--gradient_checkpointing", action="store_true")
    a("--precompute_ref_log_probs", action="store_true",
      help="every trainer precomputes reference log-probs; their time counts")
    a("--dtype", choices=["bf16", "fp32"], default=None,
      help="weights and autocast; default bf16 (--device cpu --tiny: fp32, as CPU bf16 is slow)")
    a("--learning_rate", type=float, default=1e-6)
    a("--beta", type=float, default=0.1)
    a("--seed", type=int, default=0)
    a("--configs", nargs="+", choices=ALL_NAMES, default=None,
      help=f"fixed lengths, default all of {tuple(FIXED)}; --real_lengths: {REAL_DEFAULT} (also: trl, trl_grouped); "
           f"search and fit: {SEARCH_DEFAULT}")
    a("--loss_atol", type=float, default=5e-2, help="first losses must agree to this (absolute)")
    a("--logps_atol", type=float, default=None,
      help="logps/chosen and logps/rejected of the first 3 steps (mean over pairs of a sequence's summed "
           "log-prob) must agree to this, in nats; default 2.0 (--tiny: 0.5)")
    a("--recheck", default=None, metavar="RESULTS_JSON",
      help="no training: print the tables and the agreement check of an earlier run's results.json again, "
           "with this run's tolerances")
    a("--real_lengths", choices=sorted(DATASETS), default=None,
      help="preference pairs at that dataset's lengths (log-normal fits, truncated at max_length); reports "
           "pairs/s, unique tokens/s and peak memory")
    a("--max_tokens_per_batch", type=int, default=8192,
      help="with --real_lengths, ours padding-free with a token budget: DPOConfig.max_tokens_per_batch; "
           "its steps hold about pairs / per_device_train_batch_size micro-batches of this many tokens")
    a("--max_length_search", action="store_true",
      help="with gradient checkpointing, the longest length that fits at --pairs pairs")
    a("--search_step", type=int, default=None, help="default 1024 (--tiny: 64)")
    a("--memory_fit", type=int, nargs="+", default=None, metavar="LENGTH",
      help="with gradient checkpointing: peak memory at these lengths (2 steps each), a least-squares line "
           "through them, and the length where it reaches the GPU's memory (a prediction, labelled so). It "
           "counts allocated bytes only, not the CUDA context or fragmentation: on the H200 the prediction "
           "97,686 did not fit, 94,208 did (docs/benchmarks.md); --verify_fit measures the boundary")
    a("--fit_warmup_steps", type=int, default=1,
      help="with --memory_fit: untimed steps before the one timed step of each probe (default 1; 2 keeps a "
           "step-2 recompile out of the timing)")
    a("--verify_fit", action="store_true",
      help="with --memory_fit: also train at the predicted length (rounded down to --search_step), then one "
           "--search_step above it if it fit (or below if not), so that the longest length is bracketed by a "
           "run that fits and one that does not (at most --verify_probes runs)")
    a("--verify_probes", type=int, default=3, help="with --verify_fit: the most runs per config")
    a("--search_min", type=int, default=0,
      help="a length known to fit, not probed (skips probes below it); default: none")
    a("--search_max", type=int, default=None, help="default 32768 (--tiny: 256)")
    a("--profile", action="store_true",
      help="profile one extra step after the timed ones (not timed) and print its top CUDA kernels")
    a("--memory_snapshot", action="store_true",
      help="record the allocator's history over one extra step (after --profile's, not timed) and print what "
           "is alive at its memory peak, by allocation site (benchmarks/memory_peak.py)")
    a("--trace", default=None, metavar="DIR",
      help="with --profile: also write the profiled step's Chrome trace to DIR/trace-CONFIG-LENGTH.json.gz "
           "(read it with benchmarks/trace_gaps.py)")
    a("--gpu", type=int, default=0, help="which visible GPU the runs use (one at a time)")
    a("--worker_timeout", type=int, default=1200, help="seconds per subprocess")
    a("--log_dir", default=None, help="worker logs (default: a temporary folder, kept)")
    a("--json_out", default=None, help="all results as JSON (default: <log_dir>/results.json)")
    a("--markdown_out", default=None, help="also write the printed tables to this file")
    a("--model_dir", default=None,
      help="reuse a model saved by an earlier run (else one is built and deleted at the end)")
    # Internal: one run in this process.
    a("--worker", choices=ALL_NAMES, default=None, help=argparse.SUPPRESS)
    a("--result", default=None, help=argparse.SUPPRESS)
    # Testing the OOM handling and the search without a GPU: workers above this length fail as OOM.
    a("--fake_oom_above", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None, description: str = "End-to-end DPO: fusedalign against TRL") -> argparse.Namespace:
    p = parser(description)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny, real = args.tiny, args.real_lengths is not None
    defaults = dict(lengths=([512] if tiny else [2048]) if real else ([64] if tiny else [2048, 4096]),
                    prompt_length=16 if tiny else 256, pairs=64 if real and not tiny else 8,
                    per_device_train_batch_size=4 if real and tiny else 8,
                    warmup_steps=1 if tiny else 3, timed_steps=2 if tiny else 8,
                    logps_atol=0.5 if tiny else 2.0, search_step=64 if tiny else 1024,
                    search_max=256 if tiny else 32768)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "fp32" if (tiny and args.device == "cpu") else "bf16"
    check(p, args)
    if args.max_length_search or args.memory_fit:
        args.gradient_checkpointing = True
    args.total_steps = total_steps(args)
    return args


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One clear line (argparse's error) for each combination that cannot run."""
    if args.pairs % args.per_device_train_batch_size:
        p.error(f"--pairs {args.pairs} is not a multiple of --per_device_train_batch_size "
                f"{args.per_device_train_batch_size}")
    if args.warmup_steps < 1 or args.timed_steps < 1:
        p.error("need --warmup_steps >= 1 (the first step holds start-up costs) and --timed_steps >= 1")
    if args.memory_snapshot and args.device != "cuda":
        p.error("--memory_snapshot records the CUDA allocator: it needs --device cuda")
    if args.trace and not args.profile:
        p.error("--trace needs --profile (it writes the profiled step's trace)")
    if args.real_lengths:
        if args.max_length_search or args.memory_fit or args.precompute_ref_log_probs:
            p.error("--real_lengths measures throughput: not with --max_length_search, --memory_fit or "
                    "--precompute_ref_log_probs")
        if len(args.lengths) != 1:
            p.error(f"--real_lengths takes one --lengths value (the max_length), got {args.lengths}")
        wrong = [c for c in args.configs or [] if c not in REAL]
        if wrong and not args.worker:
            p.error(f"--real_lengths runs {tuple(REAL)}, not {wrong}")
        return
    wrong = [c for c in args.configs or [] if c not in FIXED]
    if wrong and not args.worker:
        p.error(f"{wrong} run with --real_lengths only; fixed lengths run {tuple(FIXED)}")
    for length in args.lengths:
        if length <= args.prompt_length:
            p.error(f"length {length} leaves no completion after a {args.prompt_length}-token prompt")


def total_steps(args: argparse.Namespace) -> int:
    """Warm-up, timed, then the untimed extra steps: one profiled, one memory-recorded."""
    return args.warmup_steps + args.timed_steps + int(args.profile) + int(args.memory_snapshot)
