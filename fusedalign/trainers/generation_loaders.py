"""GenerationLoaders: the data loaders of the on-policy trainers (GRPO, RLOO, distillation).

Each batch the loader yields is a whole generation batch of prompt rows, each prompt repeated
for its completions (`data/grpo.py`'s `GenerationBatchSampler`), sized by the trainer's own
flags: `generation_batch_flags` names them in the sampler's errors (distillation overrides it).
"""

from __future__ import annotations

from datasets import Dataset
from torch.utils.data import DataLoader

from fusedalign.data.grpo import GenerationBatchSampler, collate_rows


class GenerationLoaders:
    """Mixin for a Trainer whose `args` are a GRPOConfig (or one that extends it)."""

    generation_batch_flags = "per_device_train_batch_size or steps_per_generation"  # what sizes a generation batch

    def get_train_dataloader(self):
        args = self.args
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}: training requires a train_dataset.")
        sampler = GenerationBatchSampler(
            len(self.train_dataset), args.num_generations, args.generation_batch_size // args.num_generations,
            args.steps_per_generation * args.num_iterations, seed=args.seed,
            shuffle=args.shuffle_dataset and args.train_sampling_strategy != "sequential",
            batch_flags=self.generation_batch_flags,
        )
        return self._generation_loader(self.train_dataset, sampler, args.per_device_train_batch_size
                                       * args.steps_per_generation)

    def get_eval_dataloader(self, eval_dataset=None):
        args, dataset = self.args, eval_dataset if eval_dataset is not None else self.eval_dataset
        G = args.num_generations_eval or args.num_generations
        batch = args.per_device_eval_batch_size
        sampler = GenerationBatchSampler(len(dataset), G, batch * args.world_size // G, 1, shuffle=False,
                                         batch_flags="per_device_eval_batch_size")
        return self._generation_loader(dataset, sampler, batch)

    def _generation_loader(self, dataset: Dataset, sampler: GenerationBatchSampler, batch_size: int):
        """Whole generation batches only (the sampler yields nothing else). drop_last also tells
        accelerate not to cut a "remainder" it would compute from the dataset's length, which
        the repeated rows make wrong, out of the last batch's metrics."""
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_rows, drop_last=True,
                            num_workers=self.args.dataloader_num_workers)
        return self.accelerator.prepare(loader)
