"""End-to-end DPO on one GPU: fusedalign against TRL, side by side in one run.

Trains, on the same model (a Qwen2.5-0.5B-shaped random init, bf16, saved once and
loaded by path) and the same synthetic preference data, each of:

    ours_fused     fusedalign.DPOTrainer, fused head (the default)
    ours_fused_liger  ours fused, plus Liger's RMSNorm/SwiGLU/RoPE kernels (liger_kernels=True)
    ours_fused_compile  ours fused, decoder layers torch.compile'd (compile_layers=True)
    ours_fused_compile_liger  both of the above
    ours_fused_compile_pertoken  ours_fused_compile with loss_aware_head=False: the per-token
                   head (four logits GEMMs) instead of the loss-aware one (three); every other
                   ours_fused* config uses the loss-aware head, DPOTrainer's default
    ours_unfused   fusedalign.DPOTrainer, fused_head=False (full logits)
    trl            trl.DPOTrainer                           (when `import trl` works)
    trl_liger      trl.DPOTrainer, use_liger_kernel=True    (and liger_kernel imports)

each in its own subprocess (`--worker CONFIG`), so memory peaks, compilation caches and
allocator state never leak from one run into the next. Per length it prints a markdown
table: steady tokens/s, the whole train() tokens/s, peak GPU memory, the first losses,
and speed and memory relative to TRL + Liger; then checks that ours fused, ours unfused
and TRL agree on the first steps (else prints COMPARISON VOID).

What is measured
- tokens per optimizer step = every token in the step's input_ids: 8 pairs x (prompt +
  chosen) + (prompt + rejected) = 16 x max_length (no padding: every sequence is at
  max_length exactly).
- step time: between on_step_begin and on_step_end of a TrainerCallback, each after
  torch.cuda.synchronize(); the median over the steps after warm-up. ("tok/s loop" uses
  the time between successive on_step_end instead, which adds data loading and logging.)
- with --precompute_ref_log_probs, the reference pass is work the run does, so its time
  (timed around the trainers' own precompute method, each after a synchronize) is added
  to the run, amortised over the max_steps it serves: tok/s = tokens per step /
  (median step + precompute / max_steps). "tok/s train()" is max_steps x tokens per step
  over the wall time of train() (plus TRL's precompute, which TRL runs in __init__).
- peak GiB: torch.cuda.max_memory_allocated(), reset just before train().
- first losses (and logps/chosen, logps/rejected) as each trainer logs them
  (logging_steps=1).

How the data reach each trainer (both bypass their text tokenisation, documented here):
rows are random token ids (prompt from the whole vocabulary; chosen from its lower half,
rejected from its upper half, so that a preference exists to learn). Neither trainer
accepts pre-tokenised rows through its constructor (fusedalign's prepare_dpo_dataset
validates text columns; TRL 1.16's _prepare_dataset tokenises text unconditionally), so:
- ours: the trainer is built with train_dataset=None and `trainer.train_dataset` is then
  set to the tokenised Dataset (prompt_ids, chosen_ids, rejected_ids) plus the row `index`
  column that DPOTrainer's tokenisation would have added (precomputed reference
  log-probs are looked up by it);
- TRL: a subclass whose `_prepare_dataset` returns the already tokenised Dataset as is
  (the same three columns, which TRL's own collator consumes).
Both use train_sampling_strategy="sequential", so both see the same rows in the same
order, and max_length equal to the sequence length, so nothing is truncated.

Note on TRL 1.16: its DPOTrainer always scores through its own chunked fused LM head
(`add_fused_lm_head`, a Triton kernel on GPU that scores only completion positions);
`use_liger_kernel=True` adds Liger's RMSNorm/SwiGLU/RoPE kernels (its fused linear
cross-entropy is refused by TRL). So "trl" is not a logits-materialising baseline.

Examples:
    python benchmarks/e2e_dpo.py                                   # GPU, lengths 2048 4096
    python benchmarks/e2e_dpo.py --lengths 2048 --precompute_ref_log_probs
    python benchmarks/e2e_dpo.py --per_device_train_batch_size 4   # 4 x GA 2 = 8 pairs
    python benchmarks/e2e_dpo.py --max_length_search --configs ours_fused trl_liger
    python benchmarks/e2e_dpo.py --memory_fit 8192 16384 --verify_fit --configs ours_fused_liger trl_liger
    python benchmarks/e2e_dpo.py --memory_fit 16384 --memory_snapshot   # what is alive at the peak
    python benchmarks/e2e_dpo.py --device cpu --tiny               # smoke test, < 1 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this working tree's fusedalign, however it is installed

CONFIGS = ("ours_fused", "ours_fused_liger", "ours_fused_compile", "ours_fused_compile_liger",
           "ours_fused_compile_pertoken", "ours_unfused", "trl", "trl_liger")
OURS_LIGER = ("ours_fused_liger", "ours_fused_compile_liger")
CHECKED = ("ours_fused", "ours_fused_compile", "ours_fused_compile_pertoken", "ours_unfused", "trl")  # must agree on the first steps
SEARCH_CONFIGS = ("ours_fused", "trl_liger")
LN2 = math.log(2.0)

# Qwen2.5-0.5B's shape; --tiny shrinks it for a CPU smoke test.
QWEN05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
               intermediate_size=4864, vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, rope_theta=10_000.0, rms_norm_eps=1e-6)


def log(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if present")
    p.add_argument("--tiny", action="store_true", help="a tiny model and short sequences (CPU smoke test)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="sequence lengths (= max_length); default 2048 4096 (--tiny: 64)")
    p.add_argument("--prompt_length", type=int, default=None, help="default 256 (--tiny: 16)")
    p.add_argument("--pairs", type=int, default=8, help="preference pairs per optimizer step")
    p.add_argument("--per_device_train_batch_size", type=int, default=8,
                   help="pairs per micro-batch; gradient accumulation = pairs / this")
    p.add_argument("--warmup_steps", type=int, default=None, help="untimed steps first (>= 1); default 3 (--tiny: 1)")
    p.add_argument("--timed_steps", type=int, default=None, help="default 8 (--tiny: 2)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--precompute_ref_log_probs", action="store_true",
                   help="every trainer precomputes reference log-probs; their time counts")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="weights and autocast; default bf16 (--device cpu --tiny: fp32, as CPU bf16 is slow)")
    p.add_argument("--learning_rate", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                   help=f"default: all of {CONFIGS} (search: {SEARCH_CONFIGS})")
    p.add_argument("--loss_atol", type=float, default=5e-2,
                   help="first losses must agree to this (absolute)")
    p.add_argument("--logps_atol", type=float, default=None,
                   help="logps/chosen and logps/rejected of the first 3 steps (mean over pairs of a "
                        "sequence's summed log-prob) must agree to this, in nats; default 2.0 (--tiny: 0.5)")
    p.add_argument("--recheck", default=None, metavar="RESULTS_JSON",
                   help="no training: print the tables and the agreement check of an earlier run's "
                        "results.json again, with this run's tolerances")
    p.add_argument("--max_length_search", action="store_true",
                   help="with gradient checkpointing, the longest length that fits at --pairs pairs")
    p.add_argument("--search_step", type=int, default=None, help="default 1024 (--tiny: 64)")
    p.add_argument("--memory_fit", type=int, nargs="+", default=None, metavar="LENGTH",
                   help="with gradient checkpointing: peak memory at these lengths (2 steps each), a "
                        "least-squares line through them, and the length where it reaches the GPU's memory "
                        "(a prediction, labelled so; cheaper than --max_length_search at long lengths). It counts "
                        "allocated bytes only, not the CUDA context or fragmentation: on the H200 the prediction "
                        "97,686 did not fit, 94,208 did (docs/benchmarks.md); --verify_fit measures the boundary")
    p.add_argument("--fit_warmup_steps", type=int, default=1,
                   help="with --memory_fit: untimed steps before the one timed step of each probe (default 1; "
                        "2 keeps a step-2 recompile out of the timing)")
    p.add_argument("--verify_fit", action="store_true",
                   help="with --memory_fit: also train at the predicted length (rounded down to --search_step), "
                        "then one --search_step above it if it fit (or below if not), so that the longest length "
                        "is bracketed by a run that fits and one that does not (at most --verify_probes runs)")
    p.add_argument("--verify_probes", type=int, default=3, help="with --verify_fit: the most runs per config")
    p.add_argument("--search_min", type=int, default=0,
                   help="a length known to fit, not probed (skips probes below it); default: none")
    p.add_argument("--search_max", type=int, default=None, help="default 32768 (--tiny: 256)")
    p.add_argument("--profile", action="store_true",
                   help="profile one extra step after the timed ones (not timed) and print its top CUDA kernels")
    p.add_argument("--memory_snapshot", action="store_true",
                   help="record the allocator's history over one extra step (after --profile's, not timed) and "
                        "print what is alive at its memory peak, by allocation site (benchmarks/memory_peak.py)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: also write the profiled step's Chrome trace to "
                        "DIR/trace-CONFIG-LENGTH.json.gz (read it with benchmarks/trace_gaps.py)")
    p.add_argument("--gpu", type=int, default=0, help="which visible GPU the runs use (one at a time)")
    p.add_argument("--worker_timeout", type=int, default=1200, help="seconds per subprocess")
    p.add_argument("--log_dir", default=None, help="worker logs (default: a temporary folder, kept)")
    p.add_argument("--json_out", default=None, help="all results as JSON (default: <log_dir>/results.json)")
    p.add_argument("--model_dir", default=None,
                   help="reuse a model saved by an earlier run (else one is built and deleted at the end)")
    # Internal: one run in this process.
    p.add_argument("--worker", choices=CONFIGS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    # Testing the OOM handling and the search without a GPU: workers above this length fail as OOM.
    p.add_argument("--fake_oom_above", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = args.tiny
    defaults = dict(lengths=[64] if tiny else [2048, 4096], prompt_length=16 if tiny else 256,
                    warmup_steps=1 if tiny else 3, timed_steps=2 if tiny else 8,
                    logps_atol=0.5 if tiny else 2.0, search_step=64 if tiny else 1024,
                    search_max=256 if tiny else 32768)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "fp32" if (tiny and args.device == "cpu") else "bf16"
    if args.pairs % args.per_device_train_batch_size:
        p.error(f"--pairs {args.pairs} is not a multiple of --per_device_train_batch_size "
                f"{args.per_device_train_batch_size}")
    if args.warmup_steps < 1 or args.timed_steps < 1:
        p.error("need --warmup_steps >= 1 (the first step holds start-up costs) and --timed_steps >= 1")
    if args.memory_snapshot and args.device != "cuda":
        p.error("--memory_snapshot records the CUDA allocator: it needs --device cuda")
    if args.trace and not args.profile:
        p.error("--trace needs --profile (it writes the profiled step's trace)")
    if args.max_length_search or args.memory_fit:
        args.gradient_checkpointing = True
    for length in args.lengths:
        if length <= args.prompt_length:
            p.error(f"length {length} leaves no completion after a {args.prompt_length}-token prompt")
    return args


def worker_argv(args: argparse.Namespace, config: str, length: int, result: str, *,
                warmup: int | None = None, timed: int | None = None) -> list[str]:
    argv = [sys.executable, "-u", os.path.abspath(__file__), "--worker", config, "--result", result,
            "--device", args.device, "--lengths", str(length), "--prompt_length", str(args.prompt_length),
            "--pairs", str(args.pairs), "--per_device_train_batch_size", str(args.per_device_train_batch_size),
            "--warmup_steps", str(args.warmup_steps if warmup is None else warmup),
            "--timed_steps", str(args.timed_steps if timed is None else timed),
            "--dtype", args.dtype, "--learning_rate", repr(args.learning_rate), "--beta", repr(args.beta),
            "--seed", str(args.seed), "--model_dir", args.model_dir]
    if args.fake_oom_above is not None:
        argv += ["--fake_oom_above", str(args.fake_oom_above)]
    if args.trace:
        argv += ["--trace", os.path.abspath(args.trace)]
    for flag in ("tiny", "gradient_checkpointing", "precompute_ref_log_probs", "profile", "memory_snapshot"):
        if getattr(args, flag) and not (flag == "memory_snapshot" and snapshot_unsupported(args, config)):
            argv.append("--" + flag)
    return argv


def snapshot_unsupported(args: argparse.Namespace, config: str) -> str | None:
    """Why --memory_snapshot is not recorded for this run (None: it is)."""
    if "compile" in config and args.gradient_checkpointing:
        # Seen on the H200 (torch 2.11, 2026-12-03): with the allocator's history recorded,
        # the checkpoint's recompute of a compiled layer failed in the backward with
        # "SystemError: <built-in method apply of FunctionMeta object> returned NULL".
        return "recording crashed the checkpointed recompute of compiled layers (torch 2.11)"
    return None


# ------------------------------------------------------------------------- environment


def one_gpu(index: int) -> str:
    """CUDA_VISIBLE_DEVICES for a worker: one GPU (several would make Trainer use DataParallel)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
        return devices[index] if index < len(devices) else devices[0]
    return str(index)


def gpu_info(index: int) -> str:
    """The GPU's name and memory, read in a subprocess so that this process never holds a CUDA context."""
    code = ("import torch; p = torch.cuda.get_device_properties(0); "
            "print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}')")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=one_gpu(index))
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or f"(unknown: {out.stderr.strip().splitlines()[-1:]})"
    except Exception as e:  # noqa: BLE001
        return f"(unknown: {e})"


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "accelerate", "datasets", "trl", "liger-kernel", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def availability(device: str) -> dict[str, str | None]:
    """Why each configuration cannot run here (None: it can)."""
    reasons: dict[str, str | None] = {c: None for c in CONFIGS}
    try:
        import trl

        missing = [m for m in ("_prepare_dataset", "_precompute_ref_logps") if not hasattr(trl.DPOTrainer, m)]
        if missing:
            reasons["trl"] = (f"trl {trl.__version__}'s DPOTrainer lacks {missing}, which this benchmark "
                              "overrides to feed token ids (written against trl 1.16)")
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        reasons["trl"] = f"`import trl` failed: {type(e).__name__}: {e}"
    reasons["trl_liger"] = reasons["trl"]
    liger = None
    if device != "cuda":
        liger = "Liger's kernels are Triton kernels: they need a GPU"
    else:
        try:
            import liger_kernel  # noqa: F401
            from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: F401
        except Exception as e:  # noqa: BLE001
            liger = f"`import liger_kernel` failed: {type(e).__name__}: {e}"
    reasons["trl_liger"] = reasons["trl_liger"] or liger
    for config in OURS_LIGER:
        reasons[config] = liger
    return reasons


def model_config(args: argparse.Namespace):
    from transformers import Qwen2Config

    shape = TINY if args.tiny else QWEN05B
    longest = max(max(args.lengths), args.search_max if args.max_length_search else 0, 4096,
                  max(args.memory_fit or [0]) * 16)
    return Qwen2Config(
        **shape, tie_word_embeddings=True, max_position_embeddings=max(32768, longest),
        hidden_act="silu", attention_dropout=0.0, use_sliding_window=False, use_cache=False,
        pad_token_id=0, bos_token_id=None, eos_token_id=0,
    )


def build_model(args: argparse.Namespace, path: str) -> None:
    """The random model every run starts from: seeded, bf16, saved once."""
    import torch
    from transformers import AutoModelForCausalLM

    from fusedalign.models import load_tokenizer

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(model_config(args), dtype=torch.float32)
    model.to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    model.save_pretrained(path)
    load_tokenizer("builtin:tiny-qwen2").save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    log(f"model: {type(model).__name__} {n / 1e6:.1f}M parameters, {args.dtype}, saved to {path}")


# ------------------------------------------------------------------------------ worker


def synthetic_rows(args: argparse.Namespace, length: int, vocab: int) -> dict[str, list]:
    """(warmup + timed) x pairs rows of token ids, the same for every configuration.

    Prompt ids come from the whole vocabulary, chosen ids from its lower half and rejected
    ids from its upper half (id 0, the pad/eos token, is never drawn).
    """
    import numpy as np

    rows = total_steps(args) * args.pairs
    rng = np.random.default_rng([args.seed, length])
    completion = length - args.prompt_length
    half = vocab // 2
    prompt = rng.integers(1, vocab, size=(rows, args.prompt_length))
    chosen = rng.integers(1, half, size=(rows, completion))
    rejected = rng.integers(half, vocab, size=(rows, completion))
    return {"prompt_ids": prompt.tolist(), "chosen_ids": chosen.tolist(), "rejected_ids": rejected.tolist()}


def total_steps(args: argparse.Namespace) -> int:
    """Warm-up, timed, then the untimed extra steps: one profiled, one memory-recorded."""
    return args.warmup_steps + args.timed_steps + int(args.profile) + int(args.memory_snapshot)


def make_callback(sync, profile_step: int | None = None, trace: str | None = None, *,
                  snapshot_step: int | None = None, tokens: int | None = None):
    """Times every step; with `snapshot_step`, records the allocator's history over that
    step (0-based) and keeps what is alive at its peak (memory_peak.peak_breakdown, per
    `tokens`); with `profile_step`, profiles that step (0-based) with torch.profiler
    (and with `trace`, a path ending in .json.gz, writes its Chrome trace there)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin: list[float] = []
            self.end: list[float] = []
            self.logs: list[dict] = []
            self.profiler = None
            self.profile: dict | None = None
            self.memory: dict | None = None
            self.baseline: int | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            if snapshot_step is not None and len(self.begin) == snapshot_step:
                import torch

                torch.cuda.memory._record_memory_history(max_entries=5_000_000, stacks="python")
                self.baseline = torch.cuda.memory_allocated()
            if profile_step is not None and len(self.begin) == profile_step:
                import torch.profiler as tp

                self.profiler = tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA])
                self.profiler.start()
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.end.append(time.perf_counter())
            if self.baseline is not None:
                import torch

                from benchmarks.memory_peak import peak_breakdown

                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                self.memory = peak_breakdown(snap["device_traces"][torch.cuda.current_device()], self.baseline, tokens)
                self.baseline = None
            if self.profiler is not None:
                self.profiler.stop()
                self.profile = summarise_profile(self.profiler, self.end[-1] - self.begin[-1])
                if trace:
                    write_trace(self.profiler, trace)
                    self.profile["trace"] = trace
                self.profiler = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logs.append({"step": state.global_step, **{k: float(v) for k, v in logs.items()
                                                                  if isinstance(v, (int, float))}})

    return StepTimer()


# Kernel kinds of a profiled step, by name (first match wins): what any implementation of
# the same computation must run (GEMMs, attention) against what differs between them.
KERNEL_KINDS = (
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce")),
    ("head element-wise", ("chunk_kernel", "logprob")),
    ("compiled element-wise (inductor)", ("triton_poi", "triton_per", "triton_red", "triton_tem")),
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("optimizer and clipping", ("adam", "multi_tensor", "foreach", "lpnorm")),
    ("Liger layer kernels", ("rms_norm", "swiglu", "rope", "liger")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return "other (copies, casts, reductions, eager element-wise)"


def summarise_profile(prof, step_s: float) -> dict:
    """The profiled step's top CUDA kernels, their time by kind, and how busy the GPU was."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]  # kernels, not the ops launching them
    kernels = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in events
                      if e.self_device_time_total > 0), key=lambda x: -x[1])
    busy = sum(ms for _, ms, _ in kernels)
    kinds: dict[str, float] = {}
    for name, ms, _ in kernels:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    return {"step_ms": step_s * 1e3, "gpu_busy_ms": busy,
            "by_kind": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": k[:110], "ms": round(ms, 3), "calls": c} for k, ms, c in kernels[:40]]}


def write_trace(prof, path: str) -> None:
    import gzip

    os.makedirs(os.path.dirname(path), exist_ok=True)
    raw = path[: -len(".gz")]
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)


def common_training_args(args: argparse.Namespace, length: int, output_dir: str) -> dict:
    return dict(
        output_dir=output_dir, max_length=length, bf16=args.dtype == "bf16",
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.pairs // args.per_device_train_batch_size,
        gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        max_steps=total_steps(args), learning_rate=args.learning_rate,
        beta=args.beta, loss_type=["sigmoid"], lr_scheduler_type="linear",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed, data_seed=args.seed,
        train_sampling_strategy="sequential", disable_dropout=True,
        report_to="none", save_strategy="no", eval_strategy="no", logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, use_cpu=args.device == "cpu",
    )


def build_ours(args, config: str, length: int, output_dir: str, rows: dict, tokenizer, callback, timer):
    from datasets import Dataset

    from fusedalign.configs import DPOConfig
    from fusedalign.trainers.dpo import DPOTrainer

    class BenchDPOTrainer(DPOTrainer):
        def _precompute_all(self, model, compute):
            with timer("precompute"):
                return super()._precompute_all(model, compute)

    kwargs = common_training_args(args, length, output_dir)
    if args.device == "cpu":
        kwargs.pop("use_cpu")  # fusedalign switches to the CPU itself when there is no accelerator
    training_args = DPOConfig(
        **kwargs, fused_head=config.startswith("ours_fused"), liger_kernels=config in OURS_LIGER,
        compile_layers="compile" in config, max_prompt_length=None,
        loss_aware_head=not config.endswith("_pertoken"),
    )
    trainer = BenchDPOTrainer(model=args.model_dir, args=training_args, train_dataset=None,
                              processing_class=tokenizer, callbacks=[callback])
    # prepare_dpo_dataset takes text only; these rows are already token ids (see the module doc).
    dataset = Dataset.from_dict(rows)
    trainer.train_dataset = dataset.add_column("index", list(range(len(dataset))))
    return trainer


def build_trl(args, config: str, length: int, output_dir: str, rows: dict, tokenizer, callback, timer):
    import trl
    from datasets import Dataset

    class BenchTRLDPOTrainer(trl.DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            # TRL 1.16 tokenises text unconditionally; these rows are already token ids.
            return dataset

        def _precompute_ref_logps(self, dataset, name, batch_size):
            with timer("precompute"):
                return super()._precompute_ref_logps(dataset, name, batch_size)

    kwargs = common_training_args(args, length, output_dir)
    # As ours: load in the training dtype on the CPU, then the Trainer moves it.
    kwargs["model_init_kwargs"] = {"dtype": "bfloat16" if args.dtype == "bf16" else "float32", "device_map": None}
    kwargs["truncation_mode"] = "keep_start"
    if config == "trl_liger":
        kwargs["use_liger_kernel"] = True
    training_args = trl.DPOConfig(**kwargs)
    return BenchTRLDPOTrainer(model=args.model_dir, args=training_args, train_dataset=Dataset.from_dict(rows),
                              processing_class=tokenizer, callbacks=[callback])


def run_worker(args: argparse.Namespace) -> int:
    import contextlib

    import torch

    config, length = args.worker, args.lengths[0]
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result: dict = {"config": config, "length": length, "status": "error"}
    timings: dict[str, float] = {}

    @contextlib.contextmanager
    def timer(name):
        sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync()
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0

    def write() -> None:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)

    def peak() -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    try:
        from transformers import set_seed

        from fusedalign.models import load_tokenizer

        set_seed(args.seed)
        tokenizer = load_tokenizer("builtin:tiny-qwen2")
        vocab = model_config(args).vocab_size
        rows = synthetic_rows(args, length, vocab)
        trace = os.path.join(args.trace, f"trace-{config}-{length}.json.gz") if args.trace else None
        timed_end = args.warmup_steps + args.timed_steps
        callback = make_callback(sync, timed_end if args.profile else None, trace,
                                 snapshot_step=timed_end + int(args.profile) if args.memory_snapshot else None,
                                 tokens=2 * args.pairs * length)
        output_dir = os.path.join(os.path.dirname(os.path.abspath(args.result)), f"out-{config}-{length}")
        build = build_ours if config.startswith("ours") else build_trl
        with timer("init"):
            trainer = build(args, config, length, output_dir, rows, tokenizer, callback, timer)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with timer("train"):
            if args.fake_oom_above is not None and length > args.fake_oom_above:
                raise torch.cuda.OutOfMemoryError(f"fake OOM above {args.fake_oom_above} (--fake_oom_above)")
            trainer.train()
        steps = total_steps(args)
        tokens_per_step = 2 * args.pairs * length
        if len(callback.begin) != steps or len(callback.end) != steps:
            raise RuntimeError(f"expected {steps} steps, timed {len(callback.begin)} begins / {len(callback.end)} ends")
        w, timed_end = args.warmup_steps, args.warmup_steps + args.timed_steps  # the profiled step is not timed
        step_times = [e - b for b, e in zip(callback.begin[w:timed_end], callback.end[w:timed_end])]
        loop_times = [callback.end[i] - callback.end[i - 1] for i in range(w, timed_end)]
        median = statistics.median(step_times)
        precompute = timings.get("precompute", 0.0)
        if args.precompute_ref_log_probs and precompute == 0.0:
            raise RuntimeError("--precompute_ref_log_probs was given but no precompute pass was timed")
        # TRL precomputes in __init__, ours inside train() (in its first step); count it once.
        train_wall = timings["train"] + (precompute if config.startswith("trl") else 0.0)
        result.update(
            status="ok", steps=steps, tokens_per_step=tokens_per_step,
            step_times=step_times, median_step_s=median,
            tokens_per_s=tokens_per_step / (median + precompute / steps),
            tokens_per_s_loop=tokens_per_step / (statistics.median(loop_times) + precompute / steps),
            tokens_per_s_train=steps * tokens_per_step / train_wall,
            precompute_s=precompute, train_s=timings["train"], init_s=timings["init"],
            peak_gib=peak(), reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
            total_gib=torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
            logs=callback.logs, profile=callback.profile, memory=callback.memory,
        )
    except torch.cuda.OutOfMemoryError as e:
        result.update(status="OOM", peak_gib=peak(), error=(str(e).splitlines() or ["OutOfMemoryError"])[0][:300])
        traceback.print_exc()
    except Exception as e:  # noqa: BLE001 - reported in the table, with the log's path
        oom = "out of memory" in str(e).lower()
        result.update(status="OOM" if oom else "error", peak_gib=peak(),
                      error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        traceback.print_exc()
    write()
    log(json.dumps({k: v for k, v in result.items() if k not in ("logs", "step_times", "profile", "memory")}))
    log_memory(config, length, result)
    if result.get("profile"):
        prof = result["profile"]
        log(f"profile of one step: {prof['step_ms']:.1f} ms wall, GPU kernels {prof['gpu_busy_ms']:.1f} ms")
        for row in prof["top"]:
            log(f"  {row['ms']:9.3f} ms {row['calls']:6d}x  {row['kernel']}")
    return 0 if result["status"] in ("ok", "OOM") else 1


# ------------------------------------------------------------------------------ parent


def launch(args: argparse.Namespace, config: str, length: int, tag: str, **steps) -> dict:
    result_path = os.path.join(args.log_dir, f"{tag}.json")
    log_path = os.path.join(args.log_dir, f"{tag}.log")
    why_not = snapshot_unsupported(args, config) if args.memory_snapshot else None
    if why_not:
        log(f"  ({config}: no memory snapshot: {why_not})")
    if os.path.exists(result_path):
        os.remove(result_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = one_gpu(args.gpu)
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        try:
            proc = subprocess.run(worker_argv(args, config, length, result_path, **steps), stdout=out,
                                  stderr=subprocess.STDOUT, env=env, timeout=args.worker_timeout, cwd=REPO)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    else:
        text = Path(log_path).read_text(errors="replace")
        oom = "OutOfMemoryError" in text or "out of memory" in text.lower()
        result = {"config": config, "length": length, "status": "OOM" if oom else "error",
                  "error": f"worker ended (rc={rc}) without a result"}
    result.update(log=log_path, wall_s=wall)
    if result["status"] == "error":
        tail = Path(log_path).read_text(errors="replace").splitlines()[-25:]
        log(f"  !! {config} at {length}: {result.get('error')} (rc={rc}); log {log_path}; its tail:")
        for line in tail:
            log("     | " + line)
    return result


def log_memory(config: str, length: int, result: dict) -> None:
    """With --memory_snapshot: what was alive at the recorded step's peak."""
    if result.get("memory"):
        from benchmarks.memory_peak import format_breakdown

        log(f"\n  memory at the peak of the recorded step, {config} at length {length}:\n"
            + "\n".join("    " + line for line in format_breakdown(result["memory"]).splitlines()) + "\n")


def fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def first(result: dict, key: str, n: int = 3) -> list[float]:
    return [entry[key] for entry in result.get("logs", [])[:n] if key in entry]


def table(length: int, results: dict[str, dict], skipped: dict[str, str | None], args) -> str:
    base_name = next((c for c in ("trl_liger", "trl") if results.get(c, {}).get("status") == "ok"), None)
    base = results.get(base_name) if base_name else None
    label = {"trl_liger": "TRL+Liger", "trl": "TRL"}.get(base_name, "TRL+Liger")
    lines = [
        f"### length {length} ({args.pairs} pairs/step = {2 * args.pairs * length} tokens, "
        f"micro-batch {args.per_device_train_batch_size} x GA {args.pairs // args.per_device_train_batch_size}"
        f"{', gradient checkpointing' if args.gradient_checkpointing else ''}"
        f"{', precomputed reference' if args.precompute_ref_log_probs else ''})",
        "",
        f"| config | tok/s | tok/s loop | tok/s train() | peak GiB | first losses | speed vs {label} "
        f"| memory vs {label} |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for config in CONFIGS:
        if config not in results:
            if config in args.configs:
                lines.append(f"| {config} | skipped: {skipped.get(config)} | | | | | | |")
            continue
        r = results[config]
        if r["status"] != "ok":
            what = "OOM" if r["status"] == "OOM" else f"error ({r.get('error', '')[:80]})"
            lines.append(f"| {config} | {what} | | | {fmt(r.get('peak_gib'), '.1f')} | | | |")
            continue
        losses = ", ".join(f"{x:.4f}" for x in first(r, "loss"))
        speed = memory = "—"
        if base is not None:
            speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"
            if r.get("peak_gib") and base.get("peak_gib"):
                memory = f"{r['peak_gib'] / base['peak_gib']:.2f}x"
        lines.append(f"| {config} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_loop']:,.0f} | "
                     f"{r['tokens_per_s_train']:,.0f} | {fmt(r.get('peak_gib'), '.1f')} | {losses} | {speed} | {memory} |")
    return "\n".join(lines)


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
    present = [c for c in CHECKED if ran(c)]
    stand_in = None
    if not ran("trl") and ran("trl_liger"):
        stand_in = "trl_liger"
        present.append(stand_in)
    log(f"\nAgreement at length {length} ({', '.join(present) or 'no runs'}; loss within "
        f"{args.loss_atol:g}, logps within {args.logps_atol:g} nats, first 3 steps):")
    if stand_in:
        log("  (trl did not run: trl_liger stands in for it, on the logps only. Its losses are shown, not "
            "checked: TRL applies Liger's kernels to the policy but not to the reference model, so policy and "
            "reference differ by kernel rounding from step 1 and its first loss is not ln 2)")
    missing = [c for c in CHECKED if c in args.configs and not ran(c)]
    if len(present) < 2:
        log("  COMPARISON INCOMPLETE: fewer than two of the checked trainers ran"
            + (f" (did not run: {missing})" if missing else ""))
        return "incomplete"
    ok = True
    for key, atol, n in (("loss", args.loss_atol, 3), ("logps/chosen", args.logps_atol, 3),
                         ("logps/rejected", args.logps_atol, 3)):
        series = {c: first(results[c], key, n) for c in present}
        for c in present:
            log(f"  {key:15s} {c:13s} " + ", ".join(f"{x:.4f}" for x in series[c]))
        ref = series[present[0]]
        for c in present[1:]:
            if c == stand_in and key == "loss":
                continue
            if len(series[c]) != len(ref) or not ref:
                log(f"  !! {key}: {c} logged {len(series[c])} values, {present[0]} {len(ref)}")
                ok = False
                continue
            worst = max(abs(a - b) for a, b in zip(series[c], ref))
            if worst > atol:
                log(f"  !! {key}: {c} differs from {present[0]} by {worst:.4g} > {atol:g}")
                ok = False
    # TRL + Liger runs other backbone kernels: shown, not required to match.
    liger = results.get("trl_liger", {})
    if liger.get("status") == "ok" and not stand_in:
        for key in ("loss", "logps/chosen", "logps/rejected"):
            d = max((abs(a - b) for a, b in zip(first(liger, key), first(results[present[0]], key))), default=0.0)
            log(f"  (trl_liger's first {key} differ from {present[0]}'s by at most {d:.4g}; not part of the check)")
    moved = max((abs(x - LN2) for c in present for x in first(results[c], "loss")), default=0.0)
    if moved < 5 * args.loss_atol:
        log(f"  note: the first losses move at most {moved:.2g} from ln 2, so the loss check is weak here "
            f"(the weights hardly change in a few steps at lr {args.learning_rate:g}, less so in bf16); "
            "the logps check carries it.")
    if not ok:
        log("\n" + "!" * 78 + f"\n!!  COMPARISON VOID at length {length}: the trainers do not compute the same "
            "loss on the same tokens\n" + "!" * 78)
        return "void"
    if missing:
        log(f"  agree, but incomplete: {missing} did not run")
        return "incomplete"
    log("  agree")
    return "agree"


def targets(length: int, results: dict[str, dict]) -> None:
    base = results.get("trl_liger", {})
    if base.get("status") != "ok":
        return
    for config in CONFIGS:
        ours = results.get(config, {})
        if not config.startswith("ours_fused") or ours.get("status") != "ok":
            continue
        speed = ours["tokens_per_s"] / base["tokens_per_s"]
        line = (f"Targets at {length} (issue 6), {config}: speed {speed:.2f}x TRL+Liger "
                f"(>= 1.3: {'met' if speed >= 1.3 else 'NOT met'})")
        if ours.get("peak_gib") and base.get("peak_gib"):
            mem = ours["peak_gib"] / base["peak_gib"]
            line += f"; memory {mem:.2f}x (<= 0.8: {'met' if mem <= 0.8 else 'NOT met'})"
        log(line)


def benchmark(args, skipped) -> dict:
    all_results: dict = {}
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
                prof = r["profile"]
                log(f"  {config} profile (one extra step): {prof['step_ms']:.1f} ms wall, GPU kernels "
                    f"{prof['gpu_busy_ms']:.1f} ms; by kind: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in prof.get("by_kind", {}).items()) + "; top kernels:")
                for row in prof["top"][:25]:
                    log(f"    {row['ms']:9.3f} ms {row['calls']:6d}x  {row['kernel']}")
        log("\n" + table(length, results, skipped, args) + "\n")
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
    return all_results


def search(args, skipped) -> dict:
    """Binary search over multiples of search_step for the longest length that fits (2 steps)."""
    out = {}
    for config in args.configs:
        if skipped[config]:
            log(f"\n{config}: skipped: {skipped[config]}")
            out[config] = {"status": "skipped", "reason": skipped[config]}
            continue
        step = args.search_step
        lo = args.search_min // step  # the largest multiple of step known to fit (0: none)
        hi = args.search_max // step + 1  # known not to fit (one past the range)
        probes = []
        log(f"\n{config}: searching {max(lo, 1) * step}..{args.search_max} in steps of {step} "
            f"({args.pairs} pairs, micro-batch {args.per_device_train_batch_size}, gradient checkpointing)")
        error = None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            length = mid * step
            if length <= args.prompt_length:
                lo = mid
                continue
            r = launch(args, config, length, f"search-{config}-{length}", warmup=1, timed=1)
            probes.append({"length": length, "status": r["status"], "peak_gib": r.get("peak_gib"),
                           "tokens_per_s": r.get("tokens_per_s")})
            log(f"  {length}: {r['status']}" + (f", peak {fmt(r.get('peak_gib'), '.1f')} GiB" if r.get("peak_gib") else ""))
            if r["status"] == "ok":
                lo = mid
            elif r["status"] == "OOM":
                hi = mid
            else:
                error = r.get("error")
                break
        if error:
            out[config] = {"status": "error", "error": error, "probes": probes}
            log(f"  {config}: search stopped by an error: {error}")
            continue
        longest = lo * step if lo > 0 else None
        capped = hi > args.search_max // step
        out[config] = {"status": "ok", "longest": longest, "capped": capped, "probes": probes}
        log(f"  {config}: longest that fits: "
            + ("none" if longest is None else f"{'>= ' if capped else ''}{longest}"))
    log("\n| config | longest length at %d pairs (gradient checkpointing) |\n|---|---|" % args.pairs)
    for config, r in out.items():
        if r["status"] == "ok":
            value = "none" if r["longest"] is None else f"{'>= ' if r['capped'] else ''}{r['longest']}"
        else:
            value = r["status"] + (f": {r.get('reason') or r.get('error')}")
        log(f"| {config} | {value} |")
    return out


def memory_fit(args, skipped) -> dict:
    """Peak memory against length, a line through it, and where the line meets the GPU's memory."""
    out = {}
    for config in args.configs:
        if skipped[config]:
            out[config] = {"status": "skipped", "reason": skipped[config]}
            continue
        points, total, breakdowns = [], None, {}
        for length in args.memory_fit:
            r = launch(args, config, length, f"fit-{config}-{length}", warmup=args.fit_warmup_steps, timed=1)
            log(f"  {config} at {length}: {r['status']}" + (f", peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") else ""))
            log_memory(config, length, r)
            if r["status"] == "ok" and r.get("peak_gib") is not None:  # None on the CPU
                points.append((length, r["peak_gib"]))
                breakdowns[length] = r.get("memory")
                total = r.get("total_gib") or total
        entry: dict = {"status": "ok", "points": points, "total_gib": total, "memory": breakdowns}
        if len(points) >= 2 and total:
            n = len(points)
            mx = sum(x for x, _ in points) / n
            my = sum(y for _, y in points) / n
            slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
            intercept = my - slope * mx
            worst = max(abs(intercept + slope * x - y) for x, y in points)
            predicted = int((total - intercept) / slope)
            entry.update(slope_gib_per_1k=slope * 1024, intercept_gib=intercept, max_residual_gib=worst,
                         predicted=predicted)
            log(f"  {config}: peak = {intercept:.2f} GiB + {slope * 1024:.3f} GiB per 1k tokens of length "
                f"(worst residual {worst:.2f} GiB); reaches {total:.1f} GiB at length ~{predicted}")
            if args.verify_fit:
                entry["verified"] = verify_boundary(args, config, predicted // args.search_step * args.search_step)
        else:
            entry["status"] = "incomplete"
        out[config] = entry
    log("\n| config | peak GiB at " + ", ".join(str(x) for x in args.memory_fit)
        + " | GiB per 1k tokens of length | predicted longest length | checked |\n|---|---|---:|---:|---|")
    for config, e in out.items():
        if e["status"] == "skipped":
            log(f"| {config} | skipped: {e['reason']} | | | |")
            continue
        peaks = ", ".join(f"{y:.1f}" for _, y in e["points"])
        checked = e.get("verified")
        if checked:
            checked = "; ".join(f"{p['length']}: {p['status']}" for p in checked["probes"]) + (
                f" -> longest that fits: {checked['longest_fit']}"
                + (f" (OOM at {checked['shortest_oom']})" if checked["shortest_oom"] else " (no OOM probed)")
                if checked["longest_fit"] else "")
        else:
            checked = "not run"
        log(f"| {config} | {peaks} | {fmt(e.get('slope_gib_per_1k'), '.3f')} | "
            f"{fmt(e.get('predicted'), 'd')} (prediction) | {checked} |")
    return out


def verify_boundary(args, config: str, start: int) -> dict:
    """Runs at `start`, then walks by --search_step (up after a fit, down after an OOM) until
    a length that fits and the next one that does not are both measured, or --verify_probes
    runs are spent. Returns the probes and the bracket (longest fit, shortest OOM)."""
    probes: list[dict] = []
    length, fits, ooms = start, [], []
    while len(probes) < args.verify_probes and length > args.prompt_length:
        r = launch(args, config, length, f"verify-{config}-{length}", warmup=args.fit_warmup_steps, timed=1)
        probes.append({"length": length, "status": r["status"], "peak_gib": r.get("peak_gib"),
                       "tokens_per_s": r.get("tokens_per_s")})
        log(f"  {config} at {length}{' (the prediction, rounded down)' if length == start else ''}: {r['status']}"
            + (f", peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") else ""))
        if r["status"] == "ok":
            fits.append(length)
        elif r["status"] == "OOM":
            ooms.append(length)
        else:
            break
        longest, shortest_oom = max(fits, default=None), min(ooms, default=None)
        if longest is not None and shortest_oom is not None and shortest_oom - longest <= args.search_step:
            break
        length = length + args.search_step if r["status"] == "ok" else length - args.search_step
    return {"probes": probes, "longest_fit": max(fits, default=None), "shortest_oom": min(ooms, default=None)}


def recheck(args) -> int:
    """The tables, agreement check and targets of an earlier run, with this run's tolerances."""
    with open(args.recheck) as f:
        saved = json.load(f)
    old = argparse.Namespace(**saved["settings"])
    old.loss_atol, old.logps_atol = args.loss_atol, args.logps_atol
    log(f"recheck of {args.recheck} (argv: {' '.join(saved.get('argv', []))}); tolerances: loss {old.loss_atol:g}, "
        f"logps {old.logps_atol:g} nats")
    verdicts = {}
    for length, results in saved["results"].items():
        if not length.isdigit():
            log(f"{length}: nothing to recheck (not a throughput run)")
            continue
        log("\n" + table(int(length), results, saved.get("skipped", {}), old) + "\n")
        verdicts[length] = check_agreement(int(length), results, old)
        targets(int(length), results)
    return 0 if all(v != "void" for v in verdicts.values()) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.recheck:
        return recheck(args)

    import torch

    v = versions()
    log("versions: " + ", ".join(f"{k} {v[k] or '(not installed)'}" for k in v) + f"; python {sys.version.split()[0]}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            log("error: --device cuda but torch.cuda.is_available() is False (use --device cpu --tiny)")
            return 2
        log(f"device: {gpu_info(args.gpu)} (CUDA_VISIBLE_DEVICES for the runs: {one_gpu(args.gpu)})")
    else:
        log("device: cpu" + ("" if args.tiny else " (without --tiny this will be very slow)"))
    skipped = availability(args.device)
    if args.configs is None:
        args.configs = list(SEARCH_CONFIGS if (args.max_length_search or args.memory_fit) else CONFIGS)
        if args.max_length_search and skipped["trl_liger"] and not skipped["trl"]:
            log(f"trl_liger cannot run ({skipped['trl_liger']}); the search uses trl instead")
            args.configs = ["ours_fused", "trl"]
    for config in args.configs:
        if skipped[config]:
            log(f"{config}: will be skipped: {skipped[config]}")

    args.log_dir = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="e2e_dpo-"))
    os.makedirs(args.log_dir, exist_ok=True)
    log(f"worker logs: {args.log_dir}")
    own_model = args.model_dir is None
    if own_model:
        args.model_dir = tempfile.mkdtemp(prefix="e2e_dpo-model-")
        t0 = time.perf_counter()
        build_model(args, args.model_dir)
        log(f"(built in {time.perf_counter() - t0:.0f} s)")
    else:
        args.model_dir = os.path.abspath(args.model_dir)
        log(f"model: reusing {args.model_dir}")
    log(f"settings: lengths {args.lengths}, prompt {args.prompt_length}, {args.pairs} pairs/step "
        f"(micro-batch {args.per_device_train_batch_size}), steps {args.warmup_steps} warm-up + "
        f"{args.timed_steps} timed, lr {args.learning_rate:g}, beta {args.beta:g}, sigmoid loss, {args.dtype}, "
        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, precomputed reference "
        f"{'on' if args.precompute_ref_log_probs else 'off'}, seed {args.seed}")

    try:
        if args.memory_fit:
            results = {"memory_fit": memory_fit(args, skipped)}
        elif args.max_length_search:
            results = {"max_length_search": search(args, skipped)}
        else:
            results = benchmark(args, skipped)
    finally:
        if own_model:
            shutil.rmtree(args.model_dir, ignore_errors=True)
    json_out = args.json_out or os.path.join(args.log_dir, "results.json")
    with open(json_out, "w") as f:
        json.dump({"versions": v, "argv": sys.argv, "settings": {k: getattr(args, k) for k in vars(args)},
                   "skipped": skipped, "results": results}, f, indent=1, default=str)
    log(f"\nresults: {json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
