"""A method's weights file onto its device, with the host's memory bounded on the way to a GPU.

safetensors maps the whole file and copies each tensor out of the mapping; every page it touched stays in the
process's resident set until the mapping is closed. Loaded in one go, a 7.2 GB decoder file put 7.2 GB of file
pages into the process's peak RSS on the way to the GPU (issue 20: 8.8 GB peak for the 3B bundle, against a
≤ 2 GB target). Onto a GPU the tensors are therefore read in groups of at most GROUP_BYTES, each through its own
mapping, closed before the next: the peak holds one group. On the CPU the tensors are the host memory, so the
file is read in one go.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

GROUP_BYTES = 512 << 20

_ITEMSIZE = {  # safetensors' dtype names: bytes per element
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def load_weights(
    path: Path, device: torch.device, group_bytes: int = GROUP_BYTES, grouped: bool | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at `path`, on `device`; `grouped` (default: off the CPU) reads them
    in groups. Raises what safetensors raises for a malformed file (the caller words it)."""
    if not (device.type != "cpu" if grouped is None else grouped):
        return load_file(str(path), device=str(device))
    out: dict[str, torch.Tensor] = {}
    for names in groups(path, group_bytes):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def groups(path: Path, group_bytes: int) -> list[list[str]]:
    """The file's tensor names in file order, cut into groups of at most `group_bytes` (a larger tensor alone)."""
    out: list[list[str]] = [[]]
    size = 0
    with safe_open(str(path), framework="pt") as f:  # the header only: names, dtypes and shapes
        names = f.offset_keys() if hasattr(f, "offset_keys") else f.keys()
        for name in names:
            s = f.get_slice(name)
            n = math.prod(s.get_shape()) * _ITEMSIZE.get(s.get_dtype(), 8)  # unknown: counted large
            if out[-1] and size + n > group_bytes:
                out.append([])
                size = 0
            out[-1].append(name)
            size += n
    return out
