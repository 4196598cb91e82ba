"""Builds ours or TRL's DPOTrainer for one configuration (`dpo_configs.DPORun`).

How the data reach each trainer: the rows are token ids already (`prompt_ids`,
`chosen_ids`, `rejected_ids`), so both trainers' text tokenisation is bypassed:
- ours: when fusedalign's DPO data layer accepts a tokenised dataset (columns used as
  is, nothing added), it is given to the constructor; until then the trainer is built
  with train_dataset=None and `trainer.train_dataset` is set afterwards to the rows plus
  the row `index` column that its tokenisation adds (precomputed reference log-probs are
  looked up by it);
- TRL 1.16: a subclass whose `_prepare_dataset` returns the tokenised rows as they are
  (TRL tokenises text unconditionally); its own collator consumes those three columns.

Row order: with `order` given (a list of row indices, one epoch), both trainers take
the rows in exactly that order; `grouped_after=W` keeps the first W rows in order and
lets the Trainer's own `train_sampling_strategy` (TRL: "group_by_length", reading a
`length` column, which is why remove_unused_columns is off there) order the rest.

Note on TRL 1.16: its DPOTrainer always scores through its own chunked fused LM head
(`add_fused_lm_head`); `use_liger_kernel=True` adds Liger's RMSNorm/SwiGLU/RoPE kernels
(its fused linear cross-entropy is refused by TRL). So "trl" is not a
logits-materialising baseline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.builders.dpo_configs import DPORun


def ours_config_fields() -> set[str]:
    from fusedalign.configs import DPOConfig

    return {f.name for f in dataclasses.fields(DPOConfig)}


def availability(runs: list[DPORun], device: str) -> dict[str, str | None]:
    """Why each configuration cannot run here (None: it can)."""
    trl_reason = liger_reason = None
    try:
        import trl

        missing = [m for m in ("_prepare_dataset", "_precompute_ref_logps") if not hasattr(trl.DPOTrainer, m)]
        if missing:
            trl_reason = (f"trl {trl.__version__}'s DPOTrainer lacks {missing}, which this benchmark "
                          "overrides to feed token ids (written against trl 1.16)")
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        trl_reason = f"`import trl` failed: {type(e).__name__}: {e}"
    if device != "cuda":
        liger_reason = "Liger's kernels are Triton kernels: they need a GPU"
    else:
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance  # noqa: F401
        except Exception as e:  # noqa: BLE001
            liger_reason = f"`import liger_kernel` failed: {type(e).__name__}: {e}"
    fields = ours_config_fields()
    reasons: dict[str, str | None] = {}
    for run in runs:
        why = trl_reason if run.is_trl else None
        why = why or (liger_reason if run.liger_layers else None)
        wanted = [f for f, on in (("padding_free", run.padding_free), ("share_prompt", run.share_prompt),
                                  ("max_tokens_per_batch", run.token_budget)) if on]
        if not why and wanted and not set(wanted) <= fields:
            why = f"fusedalign's DPOConfig has no {', '.join(f for f in wanted if f not in fields)} yet"
        if not why and run.attn == "flex_attention" and device != "cuda":
            why = "flex attention's backward runs on CUDA only (PyTorch raises on the CPU)"
        reasons[run.name] = why
    return reasons


def accepts_token_ids(tokenizer, rows: dict[str, list]) -> bool:
    """Whether fusedalign's DPO data path takes tokenised rows as they are: their first row
    goes through it and must come back unchanged, with no column added."""
    from datasets import Dataset

    from fusedalign.data import DataError

    one = Dataset.from_dict({k: v[:1] for k, v in rows.items()})
    try:
        try:
            from fusedalign.data.splits import prepare_split
        except ImportError:  # before the trainer took tokenised splits
            from fusedalign.data import prepare_dpo_dataset

            out, _ = prepare_dpo_dataset(one, tokenizer, max_prompt_length=None, max_length=None)
        else:
            out = prepare_split("dpo", one, tokenizer, "train", max_prompt_length=None, max_length=None,
                                truncation_mode="keep_end")
    except (DataError, TypeError, ValueError):
        return False
    return sorted(out.column_names) == sorted(one.column_names) and out[0] == one[0]


def time_precompute(trainer, timers) -> None:
    """Times ours' reference precompute pass: the store's `build` (DPOTrainer since the
    reference became a component) or the older `_precompute_all`."""
    store = getattr(trainer, "reference_store", None)
    if store is not None:
        build = store.build

        def timed_build(*a, **kw):
            with timers("precompute"):
                return build(*a, **kw)

        store.build = timed_build
    elif hasattr(trainer, "_precompute_all"):
        precompute = trainer._precompute_all

        def timed_precompute(*a, **kw):
            with timers("precompute"):
                return precompute(*a, **kw)

        trainer._precompute_all = timed_precompute


def training_args(s, length: int, output_dir: str) -> dict[str, Any]:
    """The arguments both trainers share (TRL's names and meanings).

    Args:
        s: the benchmark's settings (pairs, per_device_train_batch_size, dtype, ...).
        length: max_length; the rows are built so that nothing is truncated.
    """
    return dict(
        output_dir=output_dir, max_length=length, bf16=s.dtype == "bf16",
        per_device_train_batch_size=s.per_device_train_batch_size,
        per_device_eval_batch_size=s.per_device_train_batch_size,
        gradient_accumulation_steps=s.pairs // s.per_device_train_batch_size,
        gradient_checkpointing=s.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if s.gradient_checkpointing else None,
        precompute_ref_log_probs=s.precompute_ref_log_probs,
        max_steps=s.total_steps, learning_rate=s.learning_rate,
        beta=s.beta, loss_type=["sigmoid"], lr_scheduler_type="linear",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=s.seed, data_seed=s.seed,
        train_sampling_strategy="sequential", disable_dropout=True,
        report_to="none", save_strategy="no", eval_strategy="no", logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, use_cpu=s.device == "cpu",
    )


def with_order(trainer_class, order: list[int] | None, grouped_after: int | None):
    """`trainer_class` whose training sampler yields `order`, or (grouped_after=W) the
    first W rows in order and then the rest as the Trainer's own sampler orders them."""
    if order is None and grouped_after is None:
        return trainer_class
    from torch.utils.data import Sampler

    class FixedOrder(Sampler):
        def __init__(self, indices):
            self.indices = [int(i) for i in indices]

        def __iter__(self):
            return iter(self.indices)

        def __len__(self):
            return len(self.indices)

    class Ordered(trainer_class):
        def _get_train_sampler(self, train_dataset=None):
            dataset = train_dataset if train_dataset is not None else self.train_dataset
            if order is not None:
                sampler = FixedOrder(order)
            else:
                rest = super()._get_train_sampler(dataset.select(range(grouped_after, len(dataset))))
                sampler = FixedOrder([*range(grouped_after), *(grouped_after + int(i) for i in rest)])
            return sampler

    Ordered.__name__ = f"Ordered{trainer_class.__name__}"
    return Ordered


def build(run: DPORun, s, length: int, output_dir: str, rows: dict, tokenizer, callback, timers, *,
          order: list[int] | None = None, grouped_after: int | None = None):
    """The trainer for `run`, ready to `train()`; `timers("precompute")` wraps the
    reference precompute pass (its time counts in the run)."""
    builder = build_trl if run.is_trl else build_ours
    return builder(run, s, length, output_dir, rows, tokenizer, callback, timers, order, grouped_after)


def build_ours(run: DPORun, s, length, output_dir, rows, tokenizer, callback, timers, order, grouped_after):
    from datasets import Dataset

    from fusedalign.configs import DPOConfig
    from fusedalign.data import DataError
    from fusedalign.trainers.dpo import DPOTrainer

    kwargs = training_args(s, length, output_dir)
    if s.device == "cpu":
        kwargs.pop("use_cpu")  # fusedalign switches to the CPU itself when there is no accelerator
    for flag in ("padding_free", "share_prompt"):
        if getattr(run, flag):
            kwargs[flag] = True
    if run.token_budget:
        kwargs["max_tokens_per_batch"] = s.max_tokens_per_batch
        order = grouped_after = None  # the trainer's own token-budget micro-batches, in dataset order
    model, ref_model = s.model_dir, None  # None: the trainer loads the reference from the policy's path
    if run.attn:  # the policy and the reference load with this attention implementation
        from fusedalign.models import load_model

        dtype = "bfloat16" if s.dtype == "bf16" else "float32"
        model, ref_model = (load_model(s.model_dir, dtype=dtype, attn_implementation=run.attn) for _ in range(2))
    if run.pad_to_multiple_of:
        kwargs["pad_to_multiple_of"] = run.pad_to_multiple_of
    args = DPOConfig(**kwargs, fused_head=run.fused_head, liger_kernels=run.liger_layers,
                     compile_layers=run.compile_layers, max_prompt_length=None, loss_aware_head=run.loss_aware_head)
    cls = with_order(DPOTrainer, order, grouped_after)
    dataset = Dataset.from_dict(rows)
    trainer = None
    if accepts_token_ids(tokenizer, rows):
        try:
            trainer = cls(model=model, ref_model=ref_model, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[callback])
        except DataError:
            pass  # the data layer takes token ids but the trainer does not yet: the workaround below
    if trainer is None:
        trainer = cls(model=model, ref_model=ref_model, args=args, train_dataset=None, processing_class=tokenizer,
                      callbacks=[callback])
        trainer.train_dataset = dataset.add_column("index", list(range(len(dataset))))
    time_precompute(trainer, timers)
    return trainer


def build_trl(run: DPORun, s, length, output_dir, rows, tokenizer, callback, timers, order, grouped_after):
    import trl
    from datasets import Dataset

    class BenchTRLDPOTrainer(trl.DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # TRL 1.16 tokenises text unconditionally; these rows are token ids already

        def _precompute_ref_logps(self, dataset, name, batch_size):
            with timers("precompute"):
                return super()._precompute_ref_logps(dataset, name, batch_size)

    kwargs = training_args(s, length, output_dir)
    # As ours: load in the training dtype on the CPU, then the Trainer moves it.
    kwargs["model_init_kwargs"] = {"dtype": "bfloat16" if s.dtype == "bf16" else "float32", "device_map": None}
    kwargs["truncation_mode"] = "keep_start"
    kwargs["use_liger_kernel"] = run.liger_layers
    dataset = Dataset.from_dict(rows)
    if run.order == "grouped" and grouped_after is not None:
        # transformers' LengthGroupedSampler reads `length`; TRL's signature columns would drop it first.
        kwargs.update(train_sampling_strategy="group_by_length", remove_unused_columns=False)
        dataset = dataset.add_column("length", [len(p) + max(len(c), len(r)) for p, c, r in zip(
            rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"])])
    cls = with_order(BenchTRLDPOTrainer, order, grouped_after)
    return cls(model=s.model_dir, args=trl.DPOConfig(**kwargs), train_dataset=dataset,
               processing_class=tokenizer, callbacks=[callback])


def synthetic_rows(s, length: int, vocab: int) -> dict[str, list]:
    """total_steps x pairs rows at exactly `length` tokens, the same for every configuration.

    Prompt ids come from the whole vocabulary, chosen ids from its lower half and rejected
    ids from its upper half (id 0, the pad/eos token, is never drawn).
    """
    import numpy as np

    n = s.total_steps * s.pairs
    rng = np.random.default_rng([s.seed, length])
    completion = length - s.prompt_length
    half = vocab // 2
    prompt = rng.integers(1, vocab, size=(n, s.prompt_length))
    chosen = rng.integers(1, half, size=(n, completion))
    rejected = rng.integers(half, vocab, size=(n, completion))
    return {"prompt_ids": prompt.tolist(), "chosen_ids": chosen.tolist(), "rejected_ids": rejected.tolist()}
