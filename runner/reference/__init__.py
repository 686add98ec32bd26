"""Eager references: our models in plain PyTorch with exactly a bundle's weights (`--reference eager`, the bench's
eager peer), and transformers' Voxtral (the bench's hf peers)."""

from __future__ import annotations

from pathlib import Path

from runner.bundle import Manifest
from runner.errors import BundleError
from runner.families import VOXTRAL, WHISPER


def eager_engine(bundle_dir: str | Path, manifest: Manifest, device: str | None = None):
    """The eager model of the bundle's family, with the bundle's weights, as an Engine."""
    family = manifest.model.get("family", VOXTRAL)
    if family == VOXTRAL:
        from runner.reference import voxtral as module
    elif family == WHISPER:
        from runner.reference import whisper as module
    else:
        raise BundleError(f"{bundle_dir}: no eager reference for model family {family!r}")
    return module.eager_engine(Path(bundle_dir), manifest, device)
