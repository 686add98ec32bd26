"""Loading a state dict into one of our models, strictly, with one error that lists everything wrong."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runner.errors import ExportError


def load_state(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    source: str,
    assign: bool = False,
    spell: Callable[[str], str] = str,
) -> None:
    """Strict load with one error listing every missing, unexpected and mis-shaped key, named as the checkpoint
    names them (the HF layout; a model with fused projections converts on the way in; `spell` gives a key's name
    in the file when the loader renamed it). `assign` takes the tensors as they are (dtype, device) into a model
    built on the meta device."""
    to_hf = getattr(model, "to_hf_layout", lambda s: s)
    expected, state = to_hf(model.state_dict()), to_hf(state)
    missing = sorted(spell(k) for k in set(expected) - set(state))
    unexpected = sorted(spell(k) for k in set(state) - set(expected))
    wrong = sorted(
        f"{spell(k)} {list(state[k].shape)} (want {list(expected[k].shape)})"
        for k in set(state) & set(expected)
        if state[k].shape != expected[k].shape
    )
    problems = [
        f"{label}: {', '.join(keys[:8])}{' …' if len(keys) > 8 else ''} ({len(keys)})"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        if keys
    ]
    if problems:
        raise ExportError(f"{source}: checkpoint does not match the config — " + "; ".join(problems))
    state = getattr(model, "from_hf_layout", lambda s: s)(state)
    if assign:
        model.load_state_dict(state, strict=True, assign=True)
    else:
        # floats as float32 (the model's dtype comes later); int4 codes (int32) as they are
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
