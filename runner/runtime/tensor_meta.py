"""The delegate's per-slot cache of tensor metadata (sizes, strides, dtype, device, data pointer).

CRITICAL: multimodal models reuse tensors with different shapes across executions (variable-length audio:
the runner slices one static mel buffer, `mel[:n_chunks]`, so the next, shorter chunk arrives with the SAME
data pointer and a NEW shape). A cache keyed by pointer alone hands the kernels stale sizes/strides; in the
seed this was memory corruption and segfaults. So every call compares the whole metadata tuple with the
cached entry and rebuilds the entry on any mismatch. The comparison is a tuple compare; what a hit saves is
the work derived from the metadata (the I/O-spec check, the bound view, on CUDA a captured graph).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TensorMeta:
    data_ptr: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass(slots=True)
class Binding:
    meta: Hashable  # the cache key of the tensor this binding was built for (TensorMeta.of: all of its metadata)
    tensor: torch.Tensor | None  # the tensor handed to the container for this metadata (None: copy per call)


class MetaCache:
    """One Binding per input slot; `bind` returns the cached binding only if its key still matches `t`'s.

    `key` is what is compared on every call: all of the metadata (TensorMeta.of). The seed's key was the data
    pointer alone; a test passes that key to show what it breaks."""

    def __init__(self, key: Callable[[torch.Tensor], Hashable] = TensorMeta.of) -> None:
        self._key = key
        self._slots: dict[int, Binding] = {}
        self.hits = 0
        self.rebuilds = 0

    def bind(self, slot: int, t: torch.Tensor, build: Callable[[torch.Tensor], torch.Tensor | None]) -> Binding:
        """The slot's binding for `t`; on a miss, `build(t)` checks `t` and gives the tensor to hand over."""
        key = self._key(t)
        cached = self._slots.get(slot)
        if cached is not None and cached.meta == key:
            self.hits += 1
            return cached
        self.rebuilds += 1
        binding = Binding(key, build(t))
        self._slots[slot] = binding
        return binding

    def clear(self) -> None:
        self._slots.clear()
