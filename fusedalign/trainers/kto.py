"""KTOTrainer: batch -> labels -> log-probs (fused or not) -> KTO loss -> metrics.

Every forward KTO makes goes through `token_logprobs` (fused by default): the policy on
the completions (with gradient), the policy on the KL pairs (no gradient: z0 is
detached, as in TRL), and the reference on both, in one forward of the completion rows
and the KL rows stacked. The policy's KL rows get their own no-grad forward rather than
riding along with the completions: stacked, they would keep activations and cost
backward work for outputs that are detached anyway.

The KL reference point z0 (KTO paper, Eq. 7):

- Pairs. Row i's mismatched pair is (prompt i, completion of row sigma(i)), sigma one
  cycle through a random order of the dataset fixed by `seed`, so sigma(i) != i. The
  pair is fixed per row at preparation (a `kl_completion_ids` column), as TRL fixes
  its pairs when it builds its KL dataset; it does not depend on how rows are
  shuffled, batched or split over ranks and accumulation steps, which is what lets
  `precompute_ref_log_probs` store the reference log-prob of each row's KL pair, and
  lets a run be split any way without changing z0. (Where prompts repeat, as in
  unpaired data made from pairs, a row meets its own prompt with probability about
  repeats / rows.)
- Estimate. z0 = max(0, mean over every pair of the optimizer step of
  log pi(y'|x) - log pi_ref(y'|x)): all micro-batches of the gradient accumulation and
  all ranks, summed, reduced, then clamped (`kl_sums` -> reduce -> `kl_from_sums`).
  It is computed before the step's first loss forward, when the step's micro-batches
  are collected (`get_batch_samples`). TRL estimates per micro-batch; over the step the
  estimate is larger-sample and the same however the global batch is split, so
  2 x b equals 1 x 2b, and 2 ranks equal 1 process, exactly. In evaluation each batch
  (all ranks) is its own step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from datasets import Dataset, concatenate_datasets
from torch import nn
from transformers.utils import logging

from fusedalign.configs import KTOConfig
from fusedalign.data import DataError, KTOCollator, position_labels, prepare_kto_dataset, unpair_preference_dataset
from fusedalign.head import IGNORE_INDEX
from fusedalign.losses import check_kto_args, kl_from_sums, kl_sums, kto_losses, kto_metrics
from fusedalign.trainers.base import FusedAlignTrainer, Metrics
from fusedalign.trainers.common import prepare_models, tokenize_split
from fusedalign.trainers.reference import PrecomputedReferenceMixin

logger = logging.get_logger(__name__)

_ROW_KEYS = ("input_ids", "attention_mask", "completion_mask")


# ------------------------------------------------------------------ data


def kl_partners(num_rows: int, seed: int) -> list[int]:
    """sigma: row i's KL completion is row sigma[i]'s; one cycle through a seeded random order."""
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    partner = [0] * num_rows
    for k, row in enumerate(order):
        partner[row] = order[(k + 1) % num_rows]
    return partner


def add_kl_pairs(dataset: Dataset, seed: int, split: str) -> Dataset:
    """Adds `kl_completion_ids`: the completion each row's prompt is mismatched with."""
    if len(dataset) < 2:
        raise DataError(
            f"{split} split has {len(dataset)} row: KTO's KL estimate pairs each prompt with another row's "
            "completion, so it needs at least 2 rows (or loss_type='apo_zero_unpaired', which has no KL term)."
        )
    partners = dataset.select(kl_partners(len(dataset), seed)).select_columns(["completion_ids"])
    partners = partners.rename_column("completion_ids", "kl_completion_ids").flatten_indices()
    return concatenate_datasets([dataset, partners], axis=1)


@dataclass
class KLPairCollator:
    """`KTOCollator` rows, plus `kl_input_ids/kl_attention_mask/kl_completion_mask` [B, T']
    (prompt i + completion sigma(i)) when the rows carry `kl_completion_ids`."""

    pad_token_id: int

    def __call__(self, features: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        collate = KTOCollator(self.pad_token_id, kl=False)
        batch = collate(features)
        if "kl_completion_ids" in features[0]:
            kl = collate([{**f, "completion_ids": f["kl_completion_ids"]} for f in features])
            batch.update({f"kl_{key}": kl[key] for key in _ROW_KEYS})
        return batch


def _stack_rows(batch: dict[str, torch.Tensor], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Completion rows then KL rows as one [2B, T] batch, right-padded to a common length."""
    length = max(batch["input_ids"].shape[1], batch["kl_input_ids"].shape[1])
    pad = {"input_ids": pad_token_id, "attention_mask": 0, "completion_mask": 0}
    return {
        key: torch.cat([F.pad(batch[p + key], (0, length - batch[p + key].shape[1]), value=pad[key]) for p in ("", "kl_")])
        for key in _ROW_KEYS
    }


def _unpaired(dataset: Dataset, unpair: bool, split: str) -> Dataset:
    if not {"chosen", "rejected"} <= set(dataset.column_names):
        return dataset
    if not unpair:
        raise DataError(
            f"{split} split is paired preference data (columns {sorted(dataset.column_names)}); KTO trains on "
            "unpaired data (prompt, completion, label). Set unpair_preference=True (CLI: --unpair_preference true) "
            "to train on each pair as one desirable and one undesirable example."
        )
    return unpair_preference_dataset(dataset)


# ------------------------------------------------------------------ checks


def check_kl_batch(args: KTOConfig) -> None:
    """z0 is a mean over the mismatched pairs of a step: at least 2 examples per optimizer step.

    (TRL asks for a per-device batch >= 2 because it pairs within the micro-batch, where a
    batch of 1 pairs a row with itself; here pairs are fixed per row, so accumulating
    per-device batches of 1 is fine, but a step of one example would set z0 from one sample.)
    """
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    if args.uses_kl and per_step < 2:
        raise ValueError(
            "KTO (loss_type='kto') estimates its KL reference point as a mean over the mismatched prompt/completion "
            f"pairs of each optimizer step, which needs at least 2 examples per step; got per_device_train_batch_size="
            f"{args.per_device_train_batch_size} x gradient_accumulation_steps={args.gradient_accumulation_steps} x "
            f"{args.world_size} process(es) = {per_step}. Use per_device_train_batch_size >= 2 (or accumulate "
            "several micro-batches); loss_type='apo_zero_unpaired' has no KL term."
        )


def warn_on_class_balance(labels: Sequence[bool], args: KTOConfig) -> None:
    """Warns when one class is absent, or the weights are off KTO's guidance for unbalanced data."""
    n_d = int(sum(bool(x) for x in labels))
    n_u = len(labels) - n_d
    ratio_name = "(desirable_weight * n_desirable) / (undesirable_weight * n_undesirable)"
    guidance = f"{ratio_name} in [1, 4/3]"
    if n_d == 0 or n_u == 0:
        present, absent = ("desirable", "undesirable") if n_u == 0 else ("undesirable", "desirable")
        logger.warning(
            "KTO: the training data has only %s examples (%d) and no %s ones, so only the %s loss term trains. "
            "KTO's guidance for desirable_weight/undesirable_weight, %s, cannot be met with one class: add %s "
            "examples (paired preference data: unpair_preference=True).",
            present, n_d + n_u, absent, present, guidance, absent,
        )
        return
    ratio = args.desirable_weight * n_d / max(args.undesirable_weight * n_u, 1e-12)
    if not 1.0 <= ratio <= 4 / 3:
        d_lo = args.undesirable_weight * n_u / n_d
        u_hi = args.desirable_weight * n_d / n_u
        logger.warning(
            "KTO: %d desirable and %d undesirable examples with desirable_weight=%g, undesirable_weight=%g give "
            "%s = %.3g, outside KTO's guidance %s. Set EITHER desirable_weight in [%.3g, %.3g] OR "
            "undesirable_weight in [%.3g, %.3g].",
            n_d, n_u, args.desirable_weight, args.undesirable_weight, ratio_name, ratio, guidance,
            d_lo, d_lo * 4 / 3, u_hi * 3 / 4, u_hi,
        )


# ------------------------------------------------------------------ trainer


class KTOTrainer(PrecomputedReferenceMixin, FusedAlignTrainer):
    """Kahneman-Tversky Optimization with the fused output head.

    Args:
        model: A causal LM or a name/path (`builtin:tiny-qwen2`, a directory, a hub id).
        ref_model: A frozen reference model or name/path. Default: loaded from the
            policy's path (or `args.ref_model_name_or_path`); with `peft_config` and none
            given, the policy with its adapter disabled. KTO always needs a reference.
        args: KTOConfig.
        train_dataset, eval_dataset: Unpaired preference data (prompt/completion/label,
            standard or conversational), untokenised; paired preference data with
            `args.unpair_preference`.
        processing_class: The tokenizer; default: loaded from the model's path.
        peft_config: A peft LoraConfig to train an adapter instead of the full model.
    """

    sum_metrics = frozenset({"count/desirable", "count/undesirable"})

    def __init__(
        self,
        model: nn.Module | str,
        ref_model: nn.Module | str | None = None,
        args: KTOConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
    ):
        args = args or KTOConfig()
        check_kto_args(args.loss_type, beta=args.beta, desirable_weight=args.desirable_weight,
                       undesirable_weight=args.undesirable_weight)
        check_kl_batch(args)
        models = prepare_models(model, ref_model, args, processing_class, peft_config, reference=True)
        tokenizer = models.tokenizer
        train_dataset = self._prepare_split(train_dataset, tokenizer, args, "train")
        eval_dataset = self._prepare_split(eval_dataset, tokenizer, args, "eval")
        if train_dataset is not None:
            warn_on_class_balance(train_dataset["label"], args)
        super().__init__(
            model=models.model, args=args, data_collator=KLPairCollator(tokenizer.pad_token_id),
            train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer, callbacks=callbacks,
        )
        self.setup_reference(models.ref_model, is_peft=models.is_peft)

    @staticmethod
    def _prepare_split(dataset: Dataset | None, tokenizer: Any, args: KTOConfig, split: str) -> Dataset | None:
        if dataset is None:
            return None
        dataset = tokenize_split(
            prepare_kto_dataset, _unpaired(dataset, args.unpair_preference, split), tokenizer, split,
            max_length=args.max_length, max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length, truncation_mode=args.truncation_mode,
        )
        return add_kl_pairs(dataset, args.seed, split) if args.uses_kl else dataset

    # ------------------------------------------------------------------ counting

    @staticmethod
    def _labels(inputs: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
        return position_labels(inputs[prefix + "input_ids"], inputs[prefix + "completion_mask"])  # [B, T]

    def count_items(self, inputs: dict[str, Any]) -> torch.Tensor:
        """Examples with at least one completion token."""
        return (self._labels(inputs) != IGNORE_INDEX).any(-1).sum()

    # ------------------------------------------------------------------ reference and z0

    def _sequence_logps(self, model: nn.Module, rows: dict[str, torch.Tensor], prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Summed completion log-probs [B] of `rows` (keys with `prefix`), and their labels [B, T]."""
        labels = self._labels(rows, prefix)
        model_inputs = {"input_ids": rows[prefix + "input_ids"], "attention_mask": rows[prefix + "attention_mask"]}
        return self.token_logprobs(model, model_inputs, labels).logps.sum(-1), labels

    def _pair_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [B] of each row's completion and of its KL pair (zeros without KL), one forward."""
        rows = batch["input_ids"].shape[0]
        if not self.args.uses_kl:
            logps = self._sequence_logps(model, batch)[0]
            return logps, torch.zeros_like(logps)
        logps = self._sequence_logps(model, _stack_rows(batch, self.data_collator.pad_token_id))[0]  # [2B]
        return logps[:rows], logps[rows:]

    def _reference_rows(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Reference log-probs of a batch, `[B, 2]`: completion, KL pair (for precomputing)."""
        return torch.stack(self.reference.run(model, lambda m: self._pair_logps(m, batch)), dim=-1)

    def _reference_logps(self, model: nn.Module, batch: dict[str, torch.Tensor], mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.args.precompute_ref_log_probs:
            values = self.precomputed_reference(model, batch["index"], mode, self._reference_rows)  # [B, 2]
            return values[:, 0], values[:, 1]
        return self.reference.run(model, lambda m: self._pair_logps(m, batch))

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        batch_samples, total = super().get_batch_samples(epoch_iterator, num_batches, device)
        if batch_samples:
            self.model_wrapped.train()
            self._add_reference_and_kl(self.model_wrapped, batch_samples, "train")
        return batch_samples, total

    def _add_reference_and_kl(self, model: nn.Module, batches: list[dict[str, Any]], mode: str) -> None:
        """Adds `ref_logps` [B] to each micro-batch of one step, and the step's z0 as `kl` [].

        z0 sums the KL pairs of every micro-batch here and of every rank, then clamps.
        """
        sums = torch.zeros(2, device=self.accelerator.device)  # sum and count of KL log-ratios
        with torch.no_grad(), self.compute_loss_context_manager():
            for batch in batches:
                batch["ref_logps"], ref_kl = self._reference_logps(model, batch, mode)
                if self.args.uses_kl:
                    policy_kl, kl_labels = self._sequence_logps(model, batch, prefix="kl_")
                    scored = (kl_labels != IGNORE_INDEX).any(-1)
                    sums += torch.stack(kl_sums(policy_kl[scored], ref_kl.to(policy_kl)[scored])).to(sums.device)
        z0 = torch.zeros((), device=self.accelerator.device)
        if self.args.uses_kl:
            sums = self.accelerator.reduce(sums, reduction="sum")
            z0 = kl_from_sums(sums[0], sums[1])
        for batch in batches:
            batch["kl"] = z0

    # ------------------------------------------------------------------ loss

    def loss_and_metrics(self, model: nn.Module, inputs: dict[str, Any], mode: str) -> tuple[torch.Tensor, Metrics]:
        if "kl" not in inputs:  # evaluation, or a call outside the training loop: the batch is its own step
            self._add_reference_and_kl(model, [inputs], mode)
        args = self.args
        seq, labels = self._sequence_logps(model, inputs)  # [B], with gradient
        valid = (labels != IGNORE_INDEX).any(-1)  # [B]
        result = kto_losses(
            seq, inputs["ref_logps"].to(seq), inputs["kl"], inputs["label"].bool(), beta=args.beta,
            desirable_weight=args.desirable_weight, undesirable_weight=args.undesirable_weight, loss_type=args.loss_type,
        )
        # Examples with nothing to score contribute zero but stay in the graph.
        loss_sum = (result.losses * valid).sum()
        if mode == "eval":
            return loss_sum, self._per_example_metrics(result.rewards, seq.detach(), result.desirable, valid, inputs["kl"])
        return loss_sum, self._metrics(result.rewards, seq.detach(), result.desirable, valid, inputs["kl"])

    @staticmethod
    def _metrics(rewards, seq, desirable, valid, z0) -> Metrics:
        stats = kto_metrics(rewards[valid], seq[valid], desirable[valid])
        n_d, n_u = stats.num_desirable, stats.num_undesirable
        one = torch.ones(())
        return {
            "rewards/chosen": (stats.chosen_rewards, n_d),
            "rewards/rejected": (stats.rejected_rewards, n_u),
            "logps/chosen": (stats.chosen_logps, n_d),
            "logps/rejected": (stats.rejected_logps, n_u),
            "kl": (z0.detach().float() * (n_d + n_u), n_d + n_u),
            "count/desirable": (n_d, one),  # per-step totals (sum_metrics)
            "count/undesirable": (n_u, one),
        }

    @staticmethod
    def _per_example_metrics(rewards, seq, desirable, valid, z0) -> Metrics:
        """The same sums, per example ([B]), so evaluation drops rows repeated across ranks."""
        d = (desirable.bool() & valid).double()
        u = (~desirable.bool() & valid).double()
        r, lp = rewards.detach().double(), seq.double()
        return {
            "rewards/chosen": (r * d, d),
            "rewards/rejected": (r * u, u),
            "logps/chosen": (lp * d, d),
            "logps/rejected": (lp * u, u),
            "kl": (z0.detach().double() * (d + u), d + u),
            "count/desirable": (d, torch.zeros_like(d)),  # totals (sum_metrics)
            "count/undesirable": (u, torch.zeros_like(u)),
        }

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        sums = self._metric_sums["train" if self.model.training else "eval"]
        chosen, rejected = sums.get("rewards/chosen"), sums.get("rewards/rejected")
        if chosen and rejected and chosen[1] > 0 and rejected[1] > 0:
            prefix = "" if self.model.training else "eval_"
            logs[prefix + "rewards/margins"] = chosen[0] / chosen[1] - rejected[0] / rejected[1]
        super().log(logs, start_time)
