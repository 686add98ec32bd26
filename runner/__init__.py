"""Voxtral (and Whisper) bundles exported with AOTInductor, and the runner that loads them.

As a library (runner/app/api.py):

    import runner

    with runner.load("artifacts/voxtral-bundle-tiny-cpu-fp32-torch2.13") as model:
        print(model.transcribe("fixtures/audio/speech.wav").text)

`load`, `Model`, `Stream`, `StreamSlots`, `Transcription` and `Delta` are imported on first use: `import runner`
(and the CLI's `--help`) stays free of torch and numpy. Type checkers read their types from __init__.pyi."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = ("Delta", "Model", "Stream", "StreamSlots", "Transcription", "load")
__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    if name in _API:
        # by name, not an import statement: the layer contracts read `runner` as importing no layer (the
        # lower layers import __version__ from it)
        return getattr(importlib.import_module("runner.app.api"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
