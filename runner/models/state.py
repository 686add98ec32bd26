"""Building one of our models without weights, and loading a state dict into it strictly, with one error that lists
everything wrong."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

import torch
from torch import nn

from runner.errors import ExportError

M = TypeVar("M", bound=nn.Module)
# what the layers we use call from reset_parameters(): each draws or fills a tensor in place and returns it
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_")


class HFLayoutModel(Protocol):
    """One of our models: its state dict to and from the checkpoint's (HF) layout (fused projections split)."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def to_hf_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    def from_hf_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


def empty_model(build: Callable[[], M]) -> M:
    """build() on the meta device with no initial weights drawn: the weights come next (a checkpoint, a bundle,
    init_weights). Drawing them would be wasted, and on the meta device it makes torch import its compiler stack
    (meta normal_ runs through torch._refs, which imports torch._dynamo)."""
    with torch.device("meta"), _no_init():
        return build()


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def load_state(
    model: HFLayoutModel,
    state: dict[str, torch.Tensor],
    source: str,
    assign: bool = False,
    spell: Callable[[str], str] = str,
) -> None:
    """Strict load with one error listing every missing, unexpected and mis-shaped key, named as the checkpoint
    names them (the HF layout; a model with fused projections converts on the way in; `spell` gives a key's name
    in the file when the loader renamed it). `assign` takes the tensors as they are (dtype, device) into a model
    built on the meta device."""
    expected, state = model.to_hf_layout(model.state_dict()), model.to_hf_layout(state)
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
    state = model.from_hf_layout(state)
    if assign:
        model.load_state_dict(state, strict=True, assign=True)
    else:
        # floats as float32 (the model's dtype comes later); int4 codes (int32) as they are
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
