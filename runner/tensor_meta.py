"""The delegate's per-slot cache of tensor metadata (sizes, strides, dtype, device, data pointer).

CRITICAL: multimodal models reuse tensors with different shapes across executions (variable-length audio:
the runner slices one static mel buffer, `mel[:n_chunks]`, so the next, shorter chunk arrives with the SAME
data pointer and a NEW shape). A cache keyed by pointer alone hands the kernels stale sizes/strides; in the
seed this was memory corruption and segfaults. So every call compares the whole metadata tuple with the
cached entry and rebuilds the entry on any mismatch. The comparison is a tuple compare; what a hit saves is
the work derived from the metadata (the I/O-spec check, the bound view, on CUDA a captured graph).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Private switch for the regression test that proves validation matters: with it off, the cache behaves
# like the seed's (pointer-keyed) and the variable-length test must fail. Never turn it off elsewhere.
_VALIDATE = True


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
    meta: TensorMeta
    tensor: torch.Tensor | None  # the tensor handed to the container for this metadata (None: copy per call)
    extra: Any = None  # derived work a caller may attach (e.g. a CUDA graph for these shapes)


class MetaCache:
    """One Binding per input slot; `bind` returns the cached binding only if it still describes `t`."""

    def __init__(self) -> None:
        self._slots: dict[int, Binding] = {}
        self.hits = 0
        self.rebuilds = 0

    def bind(self, slot: int, t: torch.Tensor, build: Callable[[torch.Tensor], Binding]) -> Binding:
        cached = self._slots.get(slot)
        if cached is not None:
            if _VALIDATE:
                fresh = cached.meta == TensorMeta.of(t)
            else:
                fresh = cached.meta.data_ptr == t.data_ptr()  # the seed's bug, kept only for the test
            if fresh:
                self.hits += 1
                return cached
        self.rebuilds += 1
        binding = build(t)
        self._slots[slot] = binding
        return binding

    def clear(self) -> None:
        self._slots.clear()
