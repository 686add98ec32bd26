"""transformers' separate projections <-> our fused ones: q, k and v as one `qkv_proj`, gate and up as one
`gate_up_proj` (one matmul instead of three and two). A fused tensor's rows are its parts' in order. A fused bias's
key rows are zero and have no tensor in transformers' layout: Whisper-style attention has biases on q and v, never
on k. A model gives the parts' row counts (`Sizes`: fused parameter key, fused module name -> rows per part)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
Sizes = Callable[[str, str], list[int]]


def parts(key: str, sizes: Sizes) -> tuple[str, list[str], list[int]] | None:
    """For a fused parameter's key: its kind (weight, bias), the HF keys of its parts and their row counts."""
    for fused, names in FUSED.items():
        for kind in ("weight", "bias"):
            if key.endswith(f".{fused}.{kind}"):
                stem = key[: -len(f"{fused}.{kind}")] + fused.split(".")[0]
                return kind, [f"{stem}.{n}.{kind}" for n in names], sizes(key, fused)
    return None


def _keyless(kind: str, name: str) -> bool:
    return kind == "bias" and ".k_proj." in name


def to_hf(state: dict[str, torch.Tensor], sizes: Sizes) -> dict[str, torch.Tensor]:
    """Ours (or already transformers' layout) -> transformers' layout, in the same order; the parts are views of
    the fused tensors."""
    out = {}
    for key, value in state.items():
        found = parts(key, sizes)
        if found is None:
            out[key] = value
            continue
        kind, names, rows = found
        out.update((n, part) for n, part in zip(names, value.split(rows), strict=True) if not _keyless(kind, n))
    return out


def from_hf(state: dict[str, torch.Tensor], keys: Iterable[str], sizes: Sizes) -> dict[str, torch.Tensor]:
    """transformers' layout -> ours, for the model's parameter `keys`: each fused tensor the concatenation of its
    parts, zero key bias rows where the checkpoint has none. A key whose parts are not all there is left as it is,
    for the caller's missing/unexpected report."""
    out = dict(state)
    for key in keys:
        found = parts(key, sizes)
        if found is None:
            continue
        kind, names, rows = found
        for n, r in zip(names, rows, strict=True):
            if _keyless(kind, n) and n not in out and names[0] in out:
                out[n] = out[names[0]].new_zeros(r)
        if all(n in out for n in names):
            out[key] = torch.cat([out.pop(n) for n in names])
    return out


def init_random(model: nn.Module, seed: int, std: float) -> None:
    """Deterministic random init of a model with `to_hf_layout`: normal(0, std) matrices, norms at one, biases zero
    (a fused bias's key rows too, which transformers' layout does not show), drawn per tensor of transformers'
    layout (views of the fused ones), so the values do not depend on how we fuse."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
        for name, p in model.to_hf_layout(dict(model.named_parameters())).items():
            if name.endswith("bias"):
                continue
            if p.dim() == 1:  # LayerNorm / RMSNorm scales
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device) * std)
