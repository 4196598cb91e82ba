"""The reference model of DPO and KTO, in its three modes, and precomputed log-probs.

Modes:
  - a separate frozen model (default: loaded from the policy's path), prepared for the
    running backend by `fusedalign.distributed.prepare_reference_model`;
  - the policy itself with its PEFT adapter disabled (PEFT and no reference given);
  - none (`reference_free`): reference log-probs are zeros.

Either way the reference forward goes through `token_logprobs`, fused like the policy.
Precomputed log-probs are computed once per dataset, in a pass over it made when the
first batch needs them (inside the training loop, so the model is already prepared by
every backend), and stored by dataset row index.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from fusedalign.distributed import prepare_reference_model
from fusedalign.trainers.base import disable_dropout



class Reference:
    """Computes reference log-probs for a batch, in whichever mode was configured."""

    def __init__(self, model: nn.Module | None, *, use_adapter_disabled: bool):
        self.model = model
        self.use_adapter_disabled = use_adapter_disabled

    @contextlib.contextmanager
    def _adapter_disabled(self, policy: nn.Module):
        peft_model = policy
        while not hasattr(peft_model, "disable_adapter") and isinstance(getattr(peft_model, "module", None), nn.Module):
            peft_model = peft_model.module
        if not hasattr(peft_model, "disable_adapter"):
            raise RuntimeError("No reference model and the policy has no PEFT adapter to disable.")
        with peft_model.disable_adapter():
            yield

    def run(self, policy: nn.Module, fn: Callable[[nn.Module], Any]) -> Any:
        """Calls `fn(model)` with the reference model, under no_grad."""
        with torch.no_grad():
            if self.model is not None:
                return fn(self.model)
            if self.use_adapter_disabled:
                # Call the policy as the backend wrapped it, so its hooks fire.
                with self._adapter_disabled(policy):
                    return fn(policy)
        raise RuntimeError("Reference.run called in reference-free mode.")


class PrecomputedLogps:
    """Per-row reference values for one dataset, computed in one pass before use.

    `compute(batch) -> Tensor [rows, K]` is evaluated on every batch of the dataset
    (sharded over ranks); results are gathered with their row indices and stored, so
    each rank can look up any row.
    """

    def __init__(self, name: str):
        self.name = name
        self.table: torch.Tensor | None = None

    @property
    def ready(self) -> bool:
        return self.table is not None

    def build(self, dataloader: DataLoader, accelerator: Any, size: int, compute: Callable[[dict], torch.Tensor]) -> None:
        table = None
        filled = torch.zeros(size, dtype=torch.bool)
        bar = tqdm(dataloader, desc=f"Reference log-probs ({self.name})", disable=not accelerator.is_local_main_process)
        for batch in bar:
            values = compute(batch).detach().float()  # [rows, K]
            index = batch["index"].to(values.device)
            values, index = accelerator.gather_for_metrics((values, index))
            values, index = values.cpu(), index.cpu()
            if table is None:
                table = torch.zeros(size, values.shape[-1], dtype=torch.float32)
            table[index] = values
            filled[index] = True
        if table is None or not bool(filled.all()):
            missing = (~filled).nonzero().flatten()[:5].tolist()
            raise RuntimeError(f"Precomputing reference log-probs left rows without a value (e.g. rows {missing}).")
        self.table = table

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        assert self.table is not None
        return self.table[index.cpu()].to(index.device)



class PrecomputedReferenceMixin:
    """For trainers with a reference model: its set-up, and `precompute_ref_log_probs` done once.

    Call `setup_reference` at the end of `__init__` (it needs the Trainer's accelerator).
    """

    def setup_reference(self, ref_model: nn.Module | None, *, is_peft: bool) -> None:
        """Prepares the frozen reference for the backend, or the adapter-disabled mode."""
        if ref_model is not None:
            if self.args.disable_dropout:
                disable_dropout(ref_model)
            ref_model = prepare_reference_model(ref_model, self.accelerator)
        self.ref_model = ref_model
        self.reference = Reference(ref_model, use_adapter_disabled=is_peft and ref_model is None)
        self._precomputed = {"train": PrecomputedLogps("train"), "eval": PrecomputedLogps("eval")}

    def precomputed_reference(
        self, model: nn.Module, index: torch.Tensor, mode: str, compute: Callable[[nn.Module, dict], torch.Tensor]
    ) -> torch.Tensor:
        """Reference values `[B, K]` of the rows `index`, from the one pass over every split.

        Args:
            compute: `compute(model, batch) -> [rows, K]`, the reference values of a batch.
        """
        if not self._precomputed[mode].ready:
            self._precompute_all(model, compute)
        return self._precomputed[mode].lookup(index)

    def _precompute_all(self, model: nn.Module, compute: Callable[[nn.Module, dict], torch.Tensor]) -> None:
        """One reference pass over every split, then the reference model is let go.

        Holding a frozen model only to look values up would cost its whole memory for
        the rest of training, so once every split is cached it is released.
        """
        for mode, dataset in (("train", self.train_dataset), ("eval", self.eval_dataset)):
            if dataset is None or self._precomputed[mode].ready:
                continue
            loader = self.accelerator.prepare(
                DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, collate_fn=self.data_collator, shuffle=False)
            )
            self._precomputed[mode].build(loader, self.accelerator, len(dataset), lambda batch: compute(model, batch))
        if self.ref_model is not None:
            self.ref_model = self.reference.model = None
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
