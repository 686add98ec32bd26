"""What an export starts from: a preset name or a checkpoint directory -> the eager model with its weights, their
source record, the tokenizer file, and the family's exporter. `python -m runner export` asks only this; which
family loads what is the export registry's (runner/export/registry.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from runner.export import registry
from runner.export.checkpoint import ModelSource
from runner.export.registry import LoadRequest

DEFAULT_PRESET = "tiny"  # the embedded default: its seeded weights need no download
PRESETS = registry.preset_names()  # the built-in families' (a registered family's are added where it is)


@dataclass(frozen=True)
class ModelToExport:
    name: str  # the preset, or the checkpoint directory's name: names the default --out
    model: nn.Module
    source: ModelSource
    tokenizer: Path
    export: Callable  # the family's exporter: (model, source, tokenizer, out, ExportOptions, progress)
    bundle_prefix: str  # default --out: artifacts/<prefix><name>-<device>-<dtype>


def load(
    preset: str | None,
    checkpoint: Path | None,
    *,
    random_init: bool,
    seed: int,
    dtype: str,
    device: str,
    cache_dir: Path,
) -> ModelToExport:
    if checkpoint is not None and preset is None:
        family = registry.for_checkpoint(checkpoint)
    else:
        preset = preset or DEFAULT_PRESET
        family = registry.for_preset(preset)
    request = LoadRequest(preset, checkpoint, random_init, seed, dtype, device, cache_dir)
    loaded = family.load(request)
    return ModelToExport(
        loaded.name, loaded.model, loaded.source, loaded.tokenizer, family.export, family.bundle_prefix
    )
