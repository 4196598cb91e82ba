"""Builds TRL's or ours DistillationTrainer for one on-policy distillation benchmark configuration.

Both get the same student and teacher (saved once, loaded by path), the same prompts (token
ids drawn from the seed, `prompt_length` each; the text tokenisation is bypassed as for
GRPO: TRL through a subclass whose `_tokenize_prompts` looks the ids up by the row's key,
ours by handing its constructor the `prompt_ids` and `row_index` columns its prompt
tokenisation would have made) and the same arguments under TRL's names:
per_device_train_batch_size, gradient_accumulation_steps (the step's prompts are their
product, one completion each: TRL's generation batch), max_completion_length, temperature,
beta, learning_rate, bf16. `timers("generation")` wraps each trainer's generation call.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from unittest import mock


@dataclass(frozen=True)
class DistillRun:
    """One configuration: which trainer, and its generation path."""

    name: str
    trainer: str                      # "trl" or "ours"
    generation_backend: str = "auto"  # ours: auto (StaticDecode on CUDA), generate or static
    padding_free: bool = False        # ours: each micro-batch's sequences in one packed row (--max_tokens_per_batch)
    about: str = ""


RUNS = {r.name: r for r in (
    DistillRun("trl", "trl", about="trl.DistillationTrainer, transformers generate (dynamic cache, compilation off), "
                                   "no vLLM"),
    DistillRun("ours", "ours", about="fusedalign.trainers.distillation.DistillationTrainer, its default generator "
                                     "(on CUDA: StaticDecode, a static cache and one CUDA graph replay a token)"),
    DistillRun("ours_padding_free", "ours", padding_free=True,
               about="ours with padding_free=True: each micro-batch's prompt + completion sequences in one packed row "
                     "(rows of at most --max_tokens_per_batch tokens when given), no padding"),
    DistillRun("ours_generate", "ours", generation_backend="generate",
               about="ours with generation_backend='generate': transformers' generate, as TRL"),
)}
DEFAULT = ("trl", "ours")


def availability() -> dict[str, str | None]:
    """Why each configuration cannot run here (None: it can)."""
    try:
        import trl

        trainer = getattr(trl, "DistillationTrainer", None)
        trl_reason = None if trainer is not None and hasattr(trainer, "_tokenize_prompts") and hasattr(
            trainer, "_generate_single_turn") else (
            f"trl {trl.__version__} has no DistillationTrainer with _tokenize_prompts and _generate_single_turn "
            "(written against trl 1.16)")
    except Exception as e:  # noqa: BLE001
        trl_reason = f"`import trl` failed: {type(e).__name__}: {e}"
    try:
        from fusedalign.trainers.distillation import DistillationTrainer  # noqa: F401

        ours_reason = None
    except ImportError as e:
        ours_reason = f"fusedalign.trainers.distillation does not import ({e})"
    return {run.name: trl_reason if run.trainer == "trl" else ours_reason for run in RUNS.values()}


def prompts_per_step(s) -> int:
    return s.per_device_train_batch_size * s.gradient_accumulation_steps


def prompt_rows(s, vocab: int) -> list[list[int]]:
    """prompts_per_step x total_steps prompts of prompt_length ids (never id 0, pad/eos)."""
    import numpy as np

    rng = np.random.default_rng([s.seed, 3])
    return rng.integers(1, vocab, size=(prompts_per_step(s) * s.total_steps, s.prompt_length)).tolist()


def distill_args(s, output_dir: str) -> dict:
    """TRL's names, the same values for both trainers."""
    return dict(
        output_dir=output_dir, max_completion_length=s.new_tokens,
        per_device_train_batch_size=s.per_device_train_batch_size,
        gradient_accumulation_steps=s.gradient_accumulation_steps, beta=s.beta, temperature=s.temperature,
        learning_rate=s.learning_rate, max_steps=s.total_steps, bf16=s.dtype == "bf16", seed=s.seed,
        data_seed=s.seed, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=s.gradient_checkpointing, report_to="none", save_strategy="no", eval_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )


def build(run: DistillRun, s, output_dir: str, prompts: list[list[int]], tokenizer, callback, timers):
    """The trainer for `run`: student `s.model_dir`, teacher `s.teacher_dir`."""
    if run.trainer == "trl":
        return build_trl(s, output_dir, prompts, tokenizer, callback, timers)
    return build_ours(run, s, output_dir, prompts, tokenizer, callback, timers)


def build_trl(s, output_dir, prompts, tokenizer, callback, timers):
    import trl
    from datasets import Dataset

    class BenchTRLDistillationTrainer(trl.DistillationTrainer):
        def _tokenize_prompts(self, keys):
            return [prompts[int(k)] for k in keys], None, {}  # the rows are token ids already

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            with timers("generation"):
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    load = {"dtype": "bfloat16" if s.dtype == "bf16" else "float32", "device_map": None}
    args = trl.DistillationConfig(**distill_args(s, output_dir), model_init_kwargs=dict(load),
                                  teacher_model_init_kwargs=dict(load), use_cpu=s.device == "cpu")
    dataset = Dataset.from_dict({"prompt": [str(i) for i in range(len(prompts))]})
    return BenchTRLDistillationTrainer(model=s.model_dir, teacher_model=s.teacher_dir, args=args,
                                       train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])


def build_ours(run, s, output_dir, prompts, tokenizer, callback, timers):
    from datasets import Dataset

    from benchmarks.builders.grpo import WEIGHTS, packing_args
    from fusedalign.configs import DistillationConfig
    from fusedalign.generation import GenerationOutput
    from fusedalign.trainers import distillation
    from fusedalign.trainers.rollout_types import Split

    def given_split(dataset, tokenizer, args):
        # The columns its prompt tokenisation makes are already there: prompt_ids, row_index.
        return dataset, None if dataset is None else Split(conversational=False)

    packing = packing_args(s) if run.padding_free else {}
    args = DistillationConfig(**distill_args(s, output_dir), model_init_kwargs={"dtype": WEIGHTS[s.dtype]},
                              generation_backend=run.generation_backend, **packing)
    index = list(range(len(prompts)))
    rows = Dataset.from_dict({"prompt": [str(i) for i in index], "prompt_ids": prompts, "row_index": index})
    with mock.patch.object(distillation, "_prepare_split", given_split):
        trainer = distillation.DistillationTrainer(model=s.model_dir, teacher_model=s.teacher_dir, args=args,
                                                   train_dataset=rows, processing_class=tokenizer,
                                                   callbacks=[callback])
    generate = trainer.generator.generate

    def timed_generate(model, prompt_ids, *a, **kw) -> GenerationOutput:
        with timers("generation"):
            return generate(model, prompt_ids, *a, **kw)

    trainer.generator.generate = timed_generate
    if getattr(s, "log_parts", False):
        record_parts(trainer, os.path.join(output_dir, PARTS_FILE))
    return trainer


PARTS_FILE = "divergence_parts.jsonl"


def record_parts(trainer, path: str) -> None:
    """Appends each training part's divergence sum and scored tokens to `path` (JSON lines)."""
    loss_and_metrics = trainer.loss_and_metrics

    def recorded(model, inputs, mode):
        loss_sum, metrics = loss_and_metrics(model, inputs, mode)
        if mode == "train":
            entry = {"step": trainer.state.global_step + 1, "sum": float(loss_sum.detach().double()),
                     "tokens": int(inputs.loss_mask.sum()), "dtype": str(loss_sum.dtype)}
            with open(path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return loss_sum, metrics

    trainer.loss_and_metrics = recorded


def part_lines(output_dir: str) -> list[str]:
    """`step N: sum/tokens ...` for each step that `record_parts` wrote under `output_dir`."""
    path = os.path.join(output_dir, PARTS_FILE)
    if not os.path.exists(path):
        return []
    steps: dict[int, list[str]] = {}
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            steps.setdefault(e["step"], []).append(f"{e['sum']:.9g}/{e['tokens']} ({e['dtype']})")
    return [f"step {n} parts (divergence sum/tokens): " + ", ".join(parts) for n, parts in sorted(steps.items())]
