"""What an export starts from: a preset name or a checkpoint directory -> the eager model with its weights, their
source record, the tokenizer file, and the family's exporter. `python -m runner export` asks only this; which
family loads what is the export registry's (runner/export/registry.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.bundle_name import ARTIFACTS, bundle_name
from runner.export import registry
from runner.export.registry import ExportFamily, Loaded, LoadRequest

DEFAULT_PRESET = "tiny"  # the embedded default: its seeded weights need no download


@dataclass(frozen=True)
class ModelToExport:
    """The loaded model, the family entry that exports it, and whether its weights are random."""

    loaded: Loaded
    family: ExportFamily
    random_init: bool = False

    def default_out(self, device: str, dtype: str, quant: str, torch_version: str) -> Path:
        """artifacts/<the bundle's name> (runner/bundle_name.py: the CI artifacts' names too)."""
        x = self.loaded
        return Path(ARTIFACTS) / bundle_name(
            x.name, device, dtype, torch_version, quant=quant, random_init=self.random_init
        )

    def export(self, out: Path, opts, progress=None):
        """The family's exporter on the loaded model: its ExportReport."""
        x = self.loaded
        return self.family.export(x.model, x.source, x.tokenizer, out, opts, progress=progress)


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
    return ModelToExport(family.load(request), family, random_init=random_init and checkpoint is None)
