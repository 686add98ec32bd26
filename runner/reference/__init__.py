"""Eager references: our models in plain PyTorch with exactly a bundle's weights (`--reference eager`, the bench's
eager peer), and transformers' Voxtral (the bench's hf peers). One entry per family: its eager engine, imported
when first used; a test adds one with `register`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from runner.bundle import Manifest
from runner.errors import BundleError
from runner.families import VOXTRAL, WHISPER

# family -> (bundle_dir, manifest, device) -> its eager model as an Engine
EagerFactory = Callable[[Path, Manifest, "str | None"], object]


def _module(name: str) -> EagerFactory:
    return lambda bundle_dir, manifest, device: importlib.import_module(name).eager_engine(bundle_dir, manifest, device)


EAGER: dict[str, EagerFactory] = {
    VOXTRAL: _module("runner.reference.voxtral"),
    WHISPER: _module("runner.reference.whisper"),
}


def register(family: str, factory: EagerFactory) -> None:
    EAGER[family] = factory


def eager_engine(bundle_dir: str | Path, manifest: Manifest, device: str | None = None):
    """The eager model of the bundle's family, with the bundle's weights, as an Engine."""
    family = manifest.model["family"]
    factory = EAGER.get(family)
    if factory is None:
        raise BundleError(f"{bundle_dir}: no eager reference for model family {family!r}")
    return factory(Path(bundle_dir), manifest, device)
