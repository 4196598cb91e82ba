"""Generation on one GPU: transformers' ways of sampling completions, side by side.

On the model every benchmark here trains (a Qwen2.5-0.5B-shaped random init, bf16;
builders/model.py), 128-token prompts, 256 sampled new tokens (temperature 1, no top-k
or top-p: TRL's GRPO defaults; end-of-sequence off, so every method produces exactly
batch x 256 tokens), at each batch size:

    dynamic     model.generate with the dynamic cache and compilation off
                (disable_compile=True): what TRL 1.16's GRPOTrainer runs without vLLM
    static      model.generate with cache_implementation="static", decoding compiled
                (generate's own auto-compile; on CUDA only)
    continuous  model.generate_batch (continuous batching, paged attention), where the
                installed transformers has it
    dynamic_eos dynamic with an end-of-sequence id (the vocabulary's last, about never drawn):
                what a trainer runs, generate then reads the finished rows back every token
    ours        fusedalign.generation.StaticDecode as GRPO runs it by default on CUDA: a static
                cache, every token one CUDA graph replay, the same end-of-sequence id; since
                ae1bfaa its attention and sampled draw are the Triton kernels on CUDA
                (decode_kernel="auto"), before that the grouped sdpa
    ours_sdpa   ours with the grouped sdpa (cuDNN's) as the step's attention, the draw in torch
                (StaticDecode(decode_kernel="sdpa"): the default loop before ae1bfaa)
    ours_eager  the same loop without the CUDA graph
    ours_fused  ours drawing each token inside the head, slice by slice of the vocabulary
                (StaticDecode(fused_sampling=True), generation/sampling_head.py)
    ours_compiled  ours with the step compiled by inductor before capture
                   (StaticDecode(compile_step=True); GRPO's --compile_generation)
    ours_triton    ours with each step's grouped attention in fusedalign's Triton kernel
                   (StaticDecode(decode_kernel="triton"), generation/decode_kernel.py; a sampled
                   token is then drawn by generation/draw_kernel.py)
    ours_compiled_triton_fused  the three together: the step compiled, the Triton kernel, the
                   draw inside the head (CUDA only)
    ours_fused_projections  ours (the default kernels) with each layer's q/k/v and gate/up
                   projections as one GEMM each (StaticDecode(fuse_projections=True),
                   generation/fused_projections.py)
    ours_triton_fused_projections  ours_triton and ours_fused_projections together, not compiled
                   (CUDA only; on CUDA the same as ours_fused_projections since ae1bfaa)
    ours_fastest   the fastest step measured (9ef7678 on an H100: compiled, the Triton attention
                   and draw kernels, the draw from the logits) with each layer's q/k/v and gate/up
                   projections as one GEMM each (StaticDecode(fuse_projections=True); CUDA only)

Each method runs in its own subprocess (compilation caches and allocator state never
leak between them). Per batch size: one untimed call (it holds compilation and CUDA
graph capture), then --repeats timed calls, each between two synchronizes; new tokens/s
uses their median; peak GiB is torch.cuda.max_memory_allocated() over the timed calls.

Examples:
    python benchmarks/generation.py                       # batch 64 and 256
    python benchmarks/generation.py --batches 64 --methods dynamic static
    python benchmarks/generation.py --device cpu --tiny   # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.builders import ending  # noqa: E402
from benchmarks.builders.model import build_model  # noqa: E402
from benchmarks.harness.decode_limit import Peaks, Shape, limit_tokens_per_s, peaks_of  # noqa: E402
from benchmarks.harness import runner  # noqa: E402
from benchmarks.harness.env import gpu_info, log, versions, versions_line  # noqa: E402
from benchmarks.harness.tables import fmt, markdown, ratio, write_markdown  # noqa: E402

METHODS = ("dynamic", "dynamic_eos", "static", "continuous", "ours", "ours_sdpa", "ours_eager", "ours_fused",
           "ours_compiled", "ours_triton", "ours_compiled_triton_fused", "ours_fused_projections",
           "ours_triton_fused_projections", "ours_fastest")
TRITON = ("ours_triton", "ours_compiled_triton_fused", "ours_triton_fused_projections", "ours_fastest")  # Triton kernels
PROJECTIONS = ("ours_fused_projections", "ours_triton_fused_projections", "ours_fastest")  # projections fused


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if present")
    p.add_argument("--tiny", action="store_true", help="a tiny model, short prompts and completions (CPU smoke test)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default 64 256 512 (--tiny: 4)")
    p.add_argument("--prompt_length", type=int, default=None, help="default 128 (--tiny: 8)")
    p.add_argument("--new_tokens", type=int, default=None, help="default 256 (--tiny: 8)")
    p.add_argument("--completion_lengths", default="fixed",
                   help="fixed (every row draws --new_tokens; no end-of-sequence) or lognormal:MEDIAN:P95: rows end "
                        "at lengths of that distribution, truncated at --new_tokens (benchmarks/builders/ending.py)")
    p.add_argument("--peak_tb_s", type=float, default=None,
                   help="memory bandwidth for the decode limit (default: the GPU's datasheet value, where known)")
    p.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 TFLOP/s for the decode limit (idem)")
    p.add_argument("--compact_below", type=float, default=0.5,
                   help="ours: StaticDecode's compact_below (the live share of rows at or under which they "
                        "continue as a smaller batch; 0: never)")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per batch size (after one untimed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker_timeout", type=int, default=900)
    p.add_argument("--log_dir", default=None)
    p.add_argument("--json_out", default=None)
    p.add_argument("--markdown_out", default=None, help="also write the table to this file")
    p.add_argument("--model_dir", default=None, help="reuse a saved model")
    p.add_argument("--worker", choices=METHODS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, big, small in (("batches", [64, 256, 512], [4]), ("prompt_length", 128, 8), ("new_tokens", 256, 8)):
        if getattr(args, key) is None:
            setattr(args, key, small if args.tiny else big)
    try:
        args.fit = ending.parse_fit(args.completion_lengths)
    except ValueError as error:
        p.error(str(error))
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def unavailable(method: str, device: str = "cuda") -> str | None:
    if method in TRITON and device != "cuda":
        return "the Triton kernel runs on CUDA only (on the CPU the loop would use the grouped sdpa)"
    if method == "continuous":
        from transformers import GenerationMixin

        if not hasattr(GenerationMixin, "generate_batch"):
            import transformers

            return f"transformers {transformers.__version__} has no generate_batch"
    return None


def generation_config(args, method: str, pad: int, eos: int):
    from transformers import GenerationConfig

    if method.startswith("ours"):
        from fusedalign.generation import StaticDecode

        return StaticDecode(max_new_tokens=args.new_tokens, eos_token_id=eos, pad_token_id=pad, temperature=1.0,
                            top_p=1.0, top_k=0, cuda_graphs=method != "ours_eager",
                            fused_sampling=method in ("ours_fused", "ours_compiled_triton_fused"),
                            compile_step=method in ("ours_compiled", "ours_compiled_triton_fused", "ours_fastest"),
                            decode_kernel="triton" if method in TRITON else "sdpa" if method == "ours_sdpa" else "auto",
                            fuse_projections=method in PROJECTIONS,
                            compact_below=args.compact_below)

    options = dict(max_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, use_cache=True,
                   pad_token_id=pad, eos_token_id=None if args.fit is None else eos, bos_token_id=None)
    if method == "dynamic":
        return GenerationConfig(**options, disable_compile=True)
    if method == "dynamic_eos":
        return GenerationConfig(**{**options, "eos_token_id": eos}, disable_compile=True)
    if method == "static":
        return GenerationConfig(**options, cache_implementation="static")
    return GenerationConfig(**options)


def generate_once(model, method: str, prompts, config, eos: int) -> int:
    """One call; returns the number of new tokens produced (up to and with each row's EOS)."""
    import torch

    if method.startswith("ours"):
        rows = prompts.tolist()
        out = config.generate(model, rows, [(i, 0) for i in range(len(rows))])
        return sum(len(c) for c in out.completion_ids)
    if method == "continuous":
        outputs = model.generate_batch(prompts.tolist(), generation_config=config, progress_bar=False)
        return sum(len(o.generated_tokens) for o in outputs.values())
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=config)
    new = out[:, prompts.shape[1]:]
    ended = (new == eos).int()
    before_eos = (ended.cumsum(-1) - ended) == 0  # tokens up to and with the first EOS
    return int(before_eos.sum())


def run_worker(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with runner.worker_result(args.result) as result:
        result.update(method=args.worker, batches={})
        torch.manual_seed(args.seed)
        dtype = torch.bfloat16 if cuda else torch.float32
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(args.device).eval()
        vocab = model.config.vocab_size
        eos = vocab - 1
        config = generation_config(args, args.worker, pad=0, eos=eos)
        if args.fit is not None:
            ending.end_at_lengths(model, args.fit, eos, args.new_tokens)
        shape = Shape.of(model.config, sum(p.numel() for p in model.parameters()), dtype.itemsize)
        result.update(shape=dataclasses.asdict(shape), gpu=torch.cuda.get_device_name() if cuda else "cpu")
        for batch in args.batches:
            gen = torch.Generator().manual_seed(args.seed + batch)
            prompts = torch.randint(1, vocab, (batch, args.prompt_length), generator=gen).to(args.device)
            t0 = time.perf_counter()
            generate_once(model, args.worker, prompts, config, eos)  # compilation, graph capture, autotuning
            sync()
            first = time.perf_counter() - t0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times, produced = [], []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                produced.append(generate_once(model, args.worker, prompts, config, eos))
                sync()
                times.append(time.perf_counter() - t0)
            median = statistics.median(times)
            result["batches"][str(batch)] = dict(
                times_s=times, first_call_s=first, new_tokens=produced, expected=batch * args.new_tokens,
                tokens_per_s=statistics.median(produced) / median,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                last_call=getattr(config, "last_call", None))  # ours: how StaticDecode's last call ran
            log(f"{args.worker} batch {batch}: {statistics.median(produced) / median:,.0f} new tokens/s "
                f"(first call {first:.1f} s)")
        result["status"] = "ok"
    return 0 if result["status"] == "ok" else 1


def decode_limit(args, results: dict, batch: int) -> float | None:
    """The decode limit (tokens/s) of this shape, batch and length distribution on the GPU the runs saw."""
    ran = next((r for r in results.values() if r.get("status") == "ok" and r.get("shape")), None)
    if ran is None:
        return None
    peaks = peaks_of(ran["gpu"])
    if args.peak_tb_s or args.peak_tflops:
        if not (args.peak_tb_s and args.peak_tflops):
            return None
        peaks = Peaks(ran["gpu"], args.peak_tb_s, args.peak_tflops)
    if peaks is None:
        return None
    return limit_tokens_per_s(Shape(**ran["shape"]), peaks, args.prompt_length,
                              ending.expected_live_rows(args.fit, batch, args.new_tokens))


def table(args, results: dict) -> str:
    rows = []
    # The ratios' base: generate as TRL runs it (dynamic_eos) where it ran, else plain dynamic.
    base_method = next((m for m in ("dynamic_eos", "dynamic") if results.get(m, {}).get("status") == "ok"), "dynamic")
    for batch in args.batches:
        base = results.get(base_method, {}).get("batches", {}).get(str(batch))
        limit = decode_limit(args, results, batch)
        for method in args.methods:
            r = results.get(method, {"status": "not run", "reason": "not run"})
            if r.get("status") != "ok":
                rows.append([str(batch), method, r.get("reason") or f"{r.get('status')}: {r.get('error', '')[:80]}",
                             "", "", "", "", "", ""])
                continue
            b = r["batches"][str(batch)]
            short = ("" if args.fit is not None or min(b["new_tokens"]) == b["expected"]
                     else f" (only {min(b['new_tokens'])} tokens)")
            rows.append([str(batch), method, f"{b['tokens_per_s']:,.0f}{short}",
                         f"{statistics.median(b['new_tokens']) / batch:.0f}", fmt(b["peak_gib"], ".1f"),
                         f"{statistics.median(b['times_s']):.2f}", f"{b['first_call_s']:.1f}",
                         ratio(b["tokens_per_s"], base["tokens_per_s"]) if base else "—",
                         f"{100 * b['tokens_per_s'] / limit:.1f}%" if limit else "—"])
        if limit:
            rows.append([str(batch), "decode limit", f"{limit:,.0f}", "", "", "", "", "", "100%"])
    lengths = ("every row exactly that many" if args.fit is None else
               f"lengths log-normal, median {args.fit.median:g}, p95 {args.fit.p95:g}, mean "
               f"{ending.expected_length(args.fit, args.new_tokens):.0f} after truncation")
    title = (f"### generation, {args.prompt_length}-token prompts, at most {args.new_tokens} sampled new tokens "
             f"({lengths}; ours compacting at {args.compact_below:g} of the rows live; median of {args.repeats})")
    columns = ["batch", "method", "new tokens/s", "tokens a row", "peak GiB", "s a call", "first call s",
               f"vs {base_method}", "of the decode limit"]
    return title + "\n\n" + markdown(columns, rows, numeric={0, 2, 3, 4, 5, 6, 7, 8})


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    log("versions: " + versions_line(versions(("torch", "transformers", "triton"))))
    log(f"device: {gpu_info(0) if args.device == 'cuda' else 'cpu'}")
    args.log_dir = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="generation-"))
    os.makedirs(args.log_dir, exist_ok=True)
    own_model = args.model_dir is None
    if own_model:
        args.model_dir = tempfile.mkdtemp(prefix="generation-model-")
        log("model: " + build_model(args.model_dir, tiny=args.tiny, dtype="bf16" if args.device == "cuda" else "fp32",
                                    seed=args.seed))
    results = {}
    try:
        for method in args.methods:
            why = unavailable(method, args.device)
            if why:
                log(f"{method}: skipped: {why}")
                results[method] = {"status": "skipped", "reason": f"skipped: {why}"}
                continue
            argv = [sys.executable, "-u", os.path.abspath(__file__), "--worker", method, "--device", args.device,
                    "--model_dir", args.model_dir, "--batches", *map(str, args.batches), "--prompt_length",
                    str(args.prompt_length), "--new_tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                    "--completion_lengths", args.completion_lengths, "--compact_below", str(args.compact_below),
                    "--seed", str(args.seed)] + (["--tiny"] if args.tiny else [])
            log(f"{method}: running ...")
            results[method] = runner.launch(argv, f"generation-{method}", log_dir=args.log_dir, device=args.device,
                                            timeout=args.worker_timeout)
            write_markdown(args, [table(args, results)])
    finally:
        if own_model:
            shutil.rmtree(args.model_dir, ignore_errors=True)
    text = table(args, results)
    log("\n" + text + "\n")
    with open(args.json_out or os.path.join(args.log_dir, "results.json"), "w") as f:
        json.dump({"versions": versions(), "argv": sys.argv, "results": results}, f, indent=1, default=str)
    write_markdown(args, [text])
    return 0


if __name__ == "__main__":
    sys.exit(main())
