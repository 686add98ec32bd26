"""torch dtypes by the names manifests write ("bfloat16", "float32", "int64": torch's own, without "torch.")."""

from __future__ import annotations

import torch

from runner.errors import BundleError


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a manifest names; BundleError for a name that is not one."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BundleError(f"unknown dtype {name!r} in the manifest")
    return dtype
