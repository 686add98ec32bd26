"""The export registry: what each family's export is, declared once (its presets, how it loads a checkpoint or a
preset, its exporter, the methods its bundle has, the options it takes), so that the shared export code asks the
entry instead of testing a family's name. A family registers with one line in BUILTIN; a test adds one with
`register`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import RunnerError

if TYPE_CHECKING:
    from torch import nn

    from runner.export.checkpoint import ModelSource

# The families this runner exports: each module defines EXPORT, its ExportFamily.
BUILTIN = ("runner.export.voxtral", "runner.export.whisper", "runner.export.voxtral_realtime")


@dataclass(frozen=True)
class LoadRequest:
    """What `export` was asked to start from: a preset (with --random-init and its seed) or a checkpoint."""

    preset: str | None
    checkpoint: Path | None
    random_init: bool = False
    seed: int = 0
    dtype: str = "fp32"
    device: str = "cpu"
    cache_dir: Path | None = None


@dataclass(frozen=True)
class Loaded:
    """A family's loader's answer: the eager model with its weights, their record, and the tokenizer file."""

    name: str  # the preset, or the checkpoint directory's name: names the default --out
    model: nn.Module
    source: ModelSource
    tokenizer: Path


@dataclass(frozen=True)
class Redraw:
    """How a bundle's weights are made again from the manifest's record (runner/export/regenerate.py): drawn from a
    seed (random init) or converted again from a pinned package."""

    random_model: Callable | None  # (preset, seed, dtype, device) -> (model, ModelSource); None: none drawn
    plan_methods: Callable  # (model, ExportOptions) -> list[MethodPlan]: which weights go in which file
    package_model: Callable | None = None  # (the manifest's model.source.package) -> (model, ModelSource)
    weights_filter: Callable | None = None  # (method, fqn) -> kept: as the family's export passes build_bundle


@dataclass(frozen=True)
class ExportFamily:
    name: str  # the manifest's `model.family`
    presets: tuple[str, ...]  # `--preset` names it loads
    load: Callable[[LoadRequest], Loaded]
    export: Callable  # (model, source, tokenizer, out, ExportOptions, progress) -> ExportReport
    methods: tuple[str, ...]  # the methods every bundle of it has (the manifest's `required_methods`)
    claims_checkpoint: Callable[[Path], bool] | None = None  # a checkpoint directory is this family's
    any_checkpoint: bool = False  # loads a checkpoint no other family claims (and says what is wrong with it)
    batching: bool = False  # takes --max-batch > 1 (a batched decode step)
    streams: bool = False  # takes --max-streams (stream slots batched in one step)
    quant_modules: tuple[
        str, ...
    ] = ()  # what --quant int4 / fp8 replaces (fnmatch over module names); empty: no --quant
    redraw: Redraw | None = None  # its weights can be made again from the manifest's record


REGISTERED: dict[str, ExportFamily] = {}


def register(family: ExportFamily) -> ExportFamily:
    REGISTERED[family.name] = family
    return family


def families() -> list[ExportFamily]:
    """Every registered family, the built-in ones first (imported on first use: they import torch)."""
    for module in BUILTIN:
        entry = importlib.import_module(module).EXPORT
        REGISTERED.setdefault(entry.name, entry)
    builtin = [importlib.import_module(m).EXPORT.name for m in BUILTIN]
    return [REGISTERED[n] for n in builtin] + [f for n, f in REGISTERED.items() if n not in builtin]


def family(name: str) -> ExportFamily:
    entry = next((f for f in families() if f.name == name), None)
    if entry is None:
        raise RunnerError(f"model family {name!r}: not one this runner exports")
    return entry


def preset_names() -> tuple[str, ...]:
    return tuple(p for f in families() for p in f.presets)


def for_preset(preset: str) -> ExportFamily:
    entry = next((f for f in families() if preset in f.presets), None)
    if entry is None:
        raise RunnerError(f"--preset {preset}: unknown; choose from {', '.join(preset_names())}")
    return entry


def for_checkpoint(checkpoint: Path) -> ExportFamily:
    """The family that claims the directory, else the one that loads any checkpoint (its loader names what is
    missing)."""
    every = families()
    entry = next((f for f in every if f.claims_checkpoint is not None and f.claims_checkpoint(checkpoint)), None)
    entry = entry or next((f for f in every if f.any_checkpoint), None)
    if entry is None:
        raise RunnerError(f"--checkpoint {checkpoint}: no model family loads it")
    return entry


def taking(option: Callable[[ExportFamily], bool]) -> str:
    """The names of the families that take an option, for an error line."""
    return ", ".join(f.name for f in families() if option(f))
