"""Model families at run time: what is particular to one family (its tokenizer, prompts and special tokens,
whether its decoder cross-attends to the audio, how long audio is windowed, what it can do). The registry maps a
manifest's `family` to it; the runtime's engine and generation loop are shared. Adding a family: one folder here,
one line in FAMILIES (a test adds one with `register`), its model under runner/models/, its export module under
runner/export/ (one line in runner/export/registry.py) and its eager reference (runner/reference/__init__.py)."""

from __future__ import annotations

import os
from pathlib import Path

from runner.errors import BundleError
from runner.families.base import Capabilities, Family
from runner.families.voxtral import NAME as VOXTRAL
from runner.families.voxtral import VoxtralFamily
from runner.families.voxtral_realtime import NAME as VOXTRAL_REALTIME
from runner.families.voxtral_realtime import RealtimeFamily
from runner.families.whisper import NAME as WHISPER
from runner.families.whisper import WhisperFamily

__all__ = ["FAMILIES", "VOXTRAL", "VOXTRAL_REALTIME", "WHISPER", "Capabilities", "Family", "family_for", "register"]

FAMILIES: dict[str, type] = {}


def register(family: type) -> type:
    """Add a family class (its `name`, `capabilities` and a `from_bundle(bundle_dir, model)` constructor)."""
    FAMILIES[family.name] = family
    return family


register(VoxtralFamily)
register(WhisperFamily)
register(RealtimeFamily)


def family_for(bundle_dir: str | os.PathLike, model: dict) -> Family:
    """The family of a bundle's manifest `model` entry, loaded from the bundle (its tokenizer, its settings)."""
    name = model["family"]  # a field every manifest has (runner/manifest_fields.py)
    family = FAMILIES.get(name)
    if family is None:
        raise BundleError(f"{bundle_dir}: model family {name!r} is not one this runner knows")
    return family.from_bundle(Path(bundle_dir), model)
