"""End-to-end DPO on one GPU: fusedalign against TRL, side by side in one run.

Trains, on the same model (a Qwen2.5-0.5B-shaped random init, bf16, saved once and
loaded by path; builders/model.py) and the same preference data, each configuration of
builders/dpo_configs.py (a table of named options: trainer, fused head, Liger layer
kernels, compiled layers, loss-aware or per-token head, padding-free, shared prompt):

    ours_fused     fusedalign.DPOTrainer, fused head (loss-aware, the default)
    ours_fused_liger  ours fused, plus Liger's RMSNorm/SwiGLU/RoPE kernels (liger_kernels=True)
    ours_fused_compile  ours fused, decoder layers torch.compile'd (compile_layers=True)
    ours_fused_compile_liger  both of the above
    ours_fused_compile_pertoken  ours_fused_compile with loss_aware_head=False (four logits GEMMs, not three)
    ours_unfused   fusedalign.DPOTrainer, fused_head=False (full logits)
    trl            trl.DPOTrainer                           (when `import trl` works)
    trl_liger      trl.DPOTrainer, use_liger_kernel=True    (and liger_kernel imports)

each in its own subprocess (`--worker CONFIG`), so memory peaks, compilation caches and
allocator state never leak from one run into the next. Per length it prints a markdown
table: steady tokens/s, the whole train() tokens/s, peak GPU memory, the first losses,
and speed and memory relative to TRL + Liger; then checks that ours fused, ours unfused
and TRL agree on the first steps (else prints COMPARISON VOID). What is measured, and
how the token ids reach each trainer: dpo_modes/worker.py and builders/dpo.py.

--real_lengths DATASET trains pairs at a real dataset's lengths instead (configurations
trl_liger, trl_liger_grouped, ours_fused_compile, ours_padding_free, ours_shared_prompt;
pairs/s; dpo_modes/real_lengths.py). The other modes: dpo_modes/__init__.py.

Examples:
    python benchmarks/e2e_dpo.py                                   # GPU, lengths 2048 4096
    python benchmarks/e2e_dpo.py --lengths 2048 --precompute_ref_log_probs
    python benchmarks/e2e_dpo.py --per_device_train_batch_size 4   # 4 x GA 2 = 8 pairs
    python benchmarks/e2e_dpo.py --max_length_search --configs ours_fused trl_liger
    python benchmarks/e2e_dpo.py --memory_fit 8192 16384 --verify_fit --configs ours_fused_liger trl_liger
    python benchmarks/e2e_dpo.py --memory_fit 16384 --memory_snapshot   # what is alive at the peak
    python benchmarks/e2e_dpo.py --real_lengths ultrafeedback      # 64 pairs a step, max_length 2048
    python benchmarks/e2e_dpo.py --device cpu --tiny               # smoke test, < 1 min
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and this tree's fusedalign

from benchmarks.builders.dpo import availability  # noqa: E402
from benchmarks.builders.dpo_configs import FIXED, REAL, REAL_DEFAULT, SEARCH_DEFAULT  # noqa: E402
from benchmarks.builders.model import build_model  # noqa: E402
from benchmarks.dpo_modes import compare, fit, real_lengths, recheck, search  # noqa: E402
from benchmarks.dpo_modes.args import parse_args  # noqa: E402
from benchmarks.harness.env import gpu_info, log, one_gpu, versions, versions_line  # noqa: E402
from benchmarks.harness.tables import write_markdown  # noqa: E402


def default_configs(args, skipped: dict) -> list[str]:
    if args.real_lengths:
        return list(REAL_DEFAULT)
    if not (args.max_length_search or args.memory_fit):
        return list(FIXED)
    if args.max_length_search and skipped["trl_liger"] and not skipped["trl"]:
        log(f"trl_liger cannot run ({skipped['trl_liger']}); the search uses trl instead")
        return ["ours_fused", "trl"]
    return list(SEARCH_DEFAULT)


def longest(args) -> int:
    return max(max(args.lengths), args.search_max if args.max_length_search else 0, 4096,
               max(args.memory_fit or [0]) * 16)


def run_mode(args, skipped) -> tuple[dict, list[str]]:
    if args.real_lengths:
        return real_lengths.real_lengths(args, skipped)
    if args.memory_fit:
        out, tables = fit.memory_fit(args, skipped)
        return {"memory_fit": out}, tables
    if args.max_length_search:
        out, tables = search.search(args, skipped)
        return {"max_length_search": out}, tables
    return compare.benchmark(args, skipped)


def main(argv=None) -> int:
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    if args.worker:
        from benchmarks.dpo_modes.worker import run_worker

        return run_worker(args)
    if args.recheck:
        return recheck.recheck(args)
    import torch

    found = versions()
    log("versions: " + versions_line(found))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            log("error: --device cuda but torch.cuda.is_available() is False (use --device cpu --tiny)")
            return 2
        log(f"device: {gpu_info(args.gpu)} (CUDA_VISIBLE_DEVICES for the runs: {one_gpu(args.gpu)})")
    else:
        log("device: cpu" + ("" if args.tiny else " (without --tiny this will be very slow)"))
    table = REAL if args.real_lengths else FIXED
    skipped = availability(list(table.values()), args.device)
    args.configs = args.configs or default_configs(args, skipped)
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
        log("model: " + build_model(args.model_dir, tiny=args.tiny, dtype=args.dtype, seed=args.seed,
                                    longest=longest(args)))
        log(f"(built in {time.perf_counter() - t0:.0f} s)")
    else:
        args.model_dir = os.path.abspath(args.model_dir)
        log(f"model: reusing {args.model_dir}")
    log(f"settings: lengths {args.lengths}, prompt {args.prompt_length}, {args.pairs} pairs/step "
        f"(micro-batch {args.per_device_train_batch_size}), steps {args.warmup_steps} warm-up + "
        f"{args.timed_steps} timed, lr {args.learning_rate:g}, beta {args.beta:g}, sigmoid loss, {args.dtype}, "
        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, precomputed reference "
        f"{'on' if args.precompute_ref_log_probs else 'off'}, seed {args.seed}"
        + (f", real lengths {args.real_lengths}" if args.real_lengths else ""))
    try:
        results, tables = run_mode(args, skipped)
    finally:
        if own_model:
            shutil.rmtree(args.model_dir, ignore_errors=True)
    json_out = args.json_out or os.path.join(args.log_dir, "results.json")
    with open(json_out, "w") as f:
        json.dump({"versions": found, "argv": sys.argv, "settings": {k: getattr(args, k) for k in vars(args)},
                   "skipped": skipped, "results": results}, f, indent=1, default=str)
    write_markdown(args, tables)
    log(f"\nresults: {json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
