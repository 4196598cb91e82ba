"""Samplers for real lengths: micro-batches by token budget, and length-grouped padded batches.

**Token budget** (`TokenBudgetBatchSampler`, for padding-free rows): whole examples (a DPO
pair, a KTO example with its KL partner) are packed into micro-batches of at most
`max_tokens` tokens, so memory is flat whatever the lengths, and the number of examples
in a micro-batch varies. Under several processes every rank must run the same number of
micro-batches per optimizer step, or the ranks' collectives (DDP's reducer, ZeRO's
reduce-scatter, FSDP2's all-gathers) pair up with different steps and hang. The guarantee
comes from accelerate's sharding of a batch sampler: `accelerator.prepare` wraps it in
`BatchSamplerShard`, which deals the micro-batches round-robin (micro-batch j to rank
j mod W; with no `batch_size` on the sampler, batches of any size are fine) and, when their
number is not a multiple of W, repeats micro-batches from the start of the epoch to even
the ranks out (`even_batches=True`), which would count those examples twice. This sampler
makes the number a multiple of W itself (splitting its fullest micro-batches), so every
rank gets exactly len / W micro-batches, none repeated; the Trainer then takes
`gradient_accumulation_steps` of them per optimizer step on every rank (its last step of an
epoch takes the same remainder everywhere), and optimizer step s holds the micro-batches
s·K .. (s+1)·K - 1 of the sampler's order (K = accumulation × W). The examples of a step
vary in number; the trainer's global normaliser counts them (all micro-batches, all ranks),
so the loss stays the mean over the step's examples. Needs `split_batches=False`
(accelerate's default; True asks for a fixed batch size and raises).

The micro-batches are planned once (deterministically from `seed`), and each epoch
shuffles their order, so `len` is the same every epoch, as the Trainer's step count needs;
which examples share a micro-batch does not change any gradient, only which share a step
does, and that changes every epoch.

**Length-grouped** (`LengthGroupedSampler`, for padded batches): a seeded permutation cut
into groups of `group_batches` batches, each group sorted by length and cut into
batches, then the batches shuffled: rows of similar length are padded together, and the
order of lengths over an epoch stays random. Sharded by accelerate as the Trainer's own
samplers are (batch j of `batch_size` consecutive indices to rank j mod W).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

from .formats import DataError


def _permutation(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def plan_micro_batches(tokens: Sequence[int], max_tokens: int, order: Sequence[int],
                       open_batches: int = 8) -> list[list[int]]:
    """Packs examples, in `order`, into micro-batches of at most `max_tokens` tokens.

    Each example goes to the first of the last `open_batches` micro-batches it fits in (a
    new one if none), so the plan is a function of the order alone, packs densely, and
    keeps the order's mixing of lengths.

    Raises:
        DataError: an example longer than the budget alone (naming it).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_batch must be a positive number of tokens, got {max_tokens}")
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = int(tokens[i])
        if n > max_tokens:
            raise DataError(
                f"row {i}: {n} tokens in a packed row, over max_tokens_per_batch={max_tokens}; raise the budget "
                "or truncate further (max_length)"
            )
        first = max(0, len(batches) - open_batches)
        at = next((b for b in range(first, len(batches)) if loads[b] + n <= max_tokens), None)
        if at is None:
            batches.append([])
            loads.append(0)
            at = len(batches) - 1
        batches[at].append(i)
        loads[at] += n
    return batches


def split_to_multiple(batches: list[list[int]], tokens: Sequence[int], multiple: int) -> list[list[int]]:
    """Splits the micro-batches with the most tokens in two until their number is a multiple of `multiple`.

    Raises:
        DataError: fewer examples than `multiple` (some rank would get none).
    """
    batches = [list(b) for b in batches]
    while len(batches) % multiple:
        splittable = [j for j, b in enumerate(batches) if len(b) > 1]
        if not splittable:
            raise DataError(
                f"{sum(len(b) for b in batches)} example(s) cannot fill a micro-batch on each of {multiple} "
                "processes; use more data or fewer processes"
            )
        j = max(splittable, key=lambda j: (sum(tokens[i] for i in batches[j]), -j))
        half = len(batches[j]) // 2
        batches[j:j + 1] = [batches[j][:half], batches[j][half:]]
    return batches


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Micro-batches of whole examples under a token budget, as many on every rank (module docstring).

    Args:
        tokens: tokens of each example in its packed row (`dpo_row_tokens`, `kto_row_tokens`).
        max_tokens: the budget of one micro-batch (`max_tokens_per_batch`).
        num_processes: the ranks the micro-batches are dealt to (accelerate's num_processes).
        seed: fixes the plan and each epoch's order.
        shuffle: False keeps the dataset order (plan and epochs alike).
        open_batches: how many recent micro-batches an example may still join.
    """

    def __init__(self, tokens: Sequence[int], max_tokens: int, *, num_processes: int = 1, seed: int = 0,
                 shuffle: bool = True, open_batches: int = 8):
        self.tokens = [int(n) for n in tokens]
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0
        order = _permutation(len(self.tokens), seed) if shuffle else range(len(self.tokens))
        plan = plan_micro_batches(self.tokens, max_tokens, order, open_batches)
        self.batches = split_to_multiple(plan, self.tokens, num_processes)

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer at each epoch (through accelerate's BatchSamplerShard)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        n = len(self.batches)
        order = _permutation(n, self.seed + 1 + self.epoch) if self.shuffle else range(n)
        for j in order:
            yield list(self.batches[j])


class LengthGroupedSampler(Sampler[int]):
    """Indices in batches of similar lengths, for padded micro-batches (module docstring).

    Args:
        lengths: the padded length of each example (DPO: prompt + the longer completion).
        batch_size: the per-device micro-batch the DataLoader cuts the indices into.
        seed: fixes each epoch's order (with the epoch).
        group_batches: how many batches are sorted together.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, seed: int = 0, group_batches: int = 50):
        if batch_size < 1 or group_batches < 1:
            raise ValueError(f"batch_size and group_batches must be >= 1, got {batch_size} and {group_batches}")
        self.lengths = [int(n) for n in lengths]
        self.batch_size, self.seed, self.group_batches, self.epoch = batch_size, seed, group_batches, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def batches(self) -> list[list[int]]:
        """This epoch's batches, in order (the last may be short)."""
        order = _permutation(len(self.lengths), self.seed + self.epoch)
        size = self.batch_size * self.group_batches
        batches = []
        for start in range(0, len(order), size):
            group = sorted(order[start:start + size], key=lambda i: -self.lengths[i])  # stable: ties keep the order
            batches += [group[j:j + self.batch_size] for j in range(0, len(group), self.batch_size)]
        # Only the very last batch can be short; it stays last so every other one is whole
        # when the DataLoader cuts the indices into batch_size again.
        full, tail = (batches[:-1], batches[-1:]) if batches and len(batches[-1]) < self.batch_size else (batches, [])
        shuffled = _permutation(len(full), self.seed + self.epoch + 1)
        return [full[j] for j in shuffled] + tail

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches():
            yield from batch


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]], rows_per_example: int = 1) -> int:
    """Tokens that padded batches process: each batch padded to its longest example."""
    return sum(rows_per_example * len(b) * max(lengths[i] for i in b) for b in batches if b)
