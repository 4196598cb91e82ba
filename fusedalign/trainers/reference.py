"""The reference policy, a component the DPO, KTO and GRPO trainers hold.

Three modes:
  - a separate frozen model (default: loaded from the policy's path), prepared for the
    running backend by `fusedalign.distributed.prepare_reference_model`;
  - the policy itself with its PEFT adapter disabled (PEFT and no reference model given;
    LoRA on `lm_head` included, since the head runs inside its own module either way);
  - none (DPO's `reference_free`, GRPO with beta = 0): nothing is loaded.

Either way the reference forward goes through the trainer's `token_logprobs`, fused like
the policy's. Beside it, `PrecomputedLogps` optionally holds reference values for every
row of the training and evaluation data, computed in one pass when first needed (inside
the training loop, so that every backend has prepared the models) and keyed by the
row's own token ids: no column is added to the user's dataset, and identical rows share
one value.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from fusedalign.distributed import prepare_reference_model
from fusedalign.models import load_model
from fusedalign.trainers.policy import Policy, disable_dropout, layer_options, model_dtype

ROW_KEY = "row_key"  # [B] int64 content hash of each row, added by collators that are asked for it


def load_reference_model(ref_model: nn.Module | str | None, policy: Policy, args: Any, *, needed: bool) -> nn.Module | None:
    """The separate reference model, or None (adapter-disabled mode, or none needed).

    Runs before the Trainer exists (under ZeRO-3 the arguments make `from_pretrained`
    load it partitioned); `Reference.prepare` makes it usable under the backend after.
    """
    if not needed:
        return None
    if isinstance(ref_model, str):
        ref_model = load_model(ref_model, dtype=model_dtype(args))
    elif ref_model is None and not policy.is_peft:
        path = getattr(args, "ref_model_name_or_path", None) or policy.path
        if path is None:
            raise ValueError("No reference model given and the policy has no path to load a copy from; pass ref_model.")
        # Frozen: in bf16 under --bf16 (autocast runs its matmuls in bf16 anyway; half the memory of
        # float32 weights), else in the policy's own dtype (e.g. `--dtype bfloat16` without `--bf16`).
        ref_model = load_model(path, dtype=model_dtype(args) or getattr(policy.model, "dtype", None))
    if ref_model is not None:
        if getattr(args, "liger_kernels", False):
            from fusedalign.backbone import apply_liger_kernels

            apply_liger_kernels(ref_model)
        layer_options(ref_model, args)
    return ref_model


class Reference:
    """Runs functions of the reference policy, in whichever mode was configured.

    Args:
        model: the separate frozen reference, already prepared for the backend, or None.
        adapter_disabled: with no model, use the policy with its PEFT adapter disabled.
    """

    def __init__(self, model: nn.Module | None, *, adapter_disabled: bool):
        self.model = model
        self.adapter_disabled = adapter_disabled and model is None

    @classmethod
    def prepare(cls, model: nn.Module | None, accelerator: Any, *, policy_is_peft: bool, needed: bool,
                disable_dropout_: bool) -> "Reference":
        """The component for a trainer whose accelerator exists (after `Trainer.__init__`)."""
        if model is not None:
            if disable_dropout_:
                disable_dropout(model)
            model = prepare_reference_model(model, accelerator)
        return cls(model, adapter_disabled=needed and policy_is_peft and model is None)

    @property
    def mode(self) -> str:
        """"model", "adapter_disabled" or "none"."""
        return "model" if self.model is not None else "adapter_disabled" if self.adapter_disabled else "none"

    def run(self, policy: nn.Module, fn: Callable[[nn.Module], Any]) -> Any:
        """`fn(model)` under no_grad with the reference model (or the adapter-disabled policy).

        Raises:
            RuntimeError: in mode "none", or when the policy has no adapter to disable.
        """
        with torch.no_grad():
            if self.model is not None:
                return fn(self.model)
            if self.adapter_disabled:
                # Call the policy as the backend wrapped it, so its hooks fire.
                with _adapter_disabled(policy):
                    return fn(policy)
        raise RuntimeError("Reference.run called, but the trainer has no reference (reference-free).")

    def release(self) -> None:
        """Lets the separate model go (its values are precomputed): it would hold its whole memory."""
        if self.model is not None:
            self.model = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


@contextlib.contextmanager
def _adapter_disabled(policy: nn.Module):
    peft_model = policy
    while not hasattr(peft_model, "disable_adapter") and isinstance(getattr(peft_model, "module", None), nn.Module):
        peft_model = peft_model.module
    if not hasattr(peft_model, "disable_adapter"):
        raise RuntimeError("No reference model and the policy has no PEFT adapter to disable.")
    with peft_model.disable_adapter():
        yield


class PrecomputedLogps:
    """Per-row reference values (`[K]` each) for the rows of some datasets, keyed by row content.

    `build` evaluates `compute(batch) -> [B, K]` on every batch of each loader (sharded
    over ranks) and gathers the results with the batches' `row_key`s, so that every
    rank can look up any row.
    """

    def __init__(self):
        self._values: dict[int, torch.Tensor] = {}
        self.ready = False

    def build(self, loaders: list[tuple[str, DataLoader]], accelerator: Any, compute: Callable[[dict], torch.Tensor]) -> None:
        for name, loader in loaders:
            bar = tqdm(loader, desc=f"Reference log-probs ({name})", disable=not accelerator.is_local_main_process)
            for batch in bar:
                values = compute(batch).detach().float()  # [B, K]
                keys = batch[ROW_KEY].to(values.device)
                values, keys = accelerator.gather_for_metrics((values, keys))
                for key, row in zip(keys.tolist(), values.cpu()):
                    self._values[key] = row
        self.ready = True

    @property
    def table(self) -> torch.Tensor:
        """Every stored row's values, `[rows, K]` (one row per distinct row content)."""
        return torch.stack(list(self._values.values()))

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Values `[B, K]` of the rows with `keys` [B], on the keys' device."""
        try:
            rows = [self._values[key] for key in keys.tolist()]
        except KeyError:
            raise RuntimeError(
                "A batch holds a row whose reference log-probs were not precomputed (precompute_ref_log_probs covers "
                "the trainer's train_dataset and eval_dataset; a dataset given later is not covered)."
            ) from None
        return torch.stack(rows).to(keys.device)


def precompute_reference(trainer: Any, store: PrecomputedLogps, compute: Callable[[dict], torch.Tensor]) -> None:
    """One reference pass over the trainer's training and evaluation data, then the reference is let go."""
    loaders = []
    for name, dataset in (("train", trainer.train_dataset), ("eval", trainer.eval_dataset)):
        if dataset is None:
            continue
        loader = DataLoader(dataset, batch_size=trainer.args.per_device_eval_batch_size,
                            collate_fn=trainer.data_collator, shuffle=False)
        loaders.append((name, trainer.accelerator.prepare(loader)))
    store.build(loaders, trainer.accelerator, compute)
    trainer.reference.release()
