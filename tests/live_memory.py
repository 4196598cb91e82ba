"""LiveBytes: the most bytes alive at once among the tensors ops create inside it (on any device).

A TorchDispatchMode that counts each storage an op returns once, from its creation until it is
freed (a weakref finalizer), and keeps the high-water mark: the working memory of what runs
inside it, as a deterministic bound a test can hold on the CPU. Storages of `existing` tensors
(inputs, parameters: views of them are not new memory) are never counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self, existing=()):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in existing if t is not None}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.skip or key in self.live:
                continue
            self.live[key] = size
            self.now += size
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
