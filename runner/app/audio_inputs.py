"""What the library (runner/app/api.py) takes as audio, made into what the runner reads: a file's path as it is;
a file's bytes, or a sample array's 16 kHz mono samples, in a private temporary file; samples pushed into a stream
checked and mixed as a file's are (runner/audio.py's load_audio)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from runner.audio import MAX_RATE, MIN_RATE, SAMPLE_RATE, _to_mono
from runner.errors import AudioError

__all__ = ["Audio", "audio_file", "mono_samples"]

# What `audio` may be: a file's path, a file's bytes (any container load_audio reads), or float samples
Audio = str | os.PathLike | bytes | np.ndarray
MAX_CHANNELS = 64  # an array (n, channels) wider than this is taken to be channels-first: refused, not averaged


@contextlib.contextmanager
def audio_file(audio: Audio, sample_rate: int | None, index: int | None = None) -> Iterator[tuple[str, Any, str]]:
    """(a file load_audio reads, the input's source, the name errors give it) for any input: a path as it is;
    bytes, or an array's 16 kHz mono samples as float32 WAV, in a private temporary file removed after."""
    which = "" if index is None else f" {index}"
    if isinstance(audio, str | os.PathLike):
        if sample_rate is not None:
            raise AudioError(f"sample_rate={sample_rate}: only for a sample array; a file says its own rate")
        path = os.fspath(audio)
        yield path, path, path
        return
    if isinstance(audio, bytes | bytearray | memoryview):
        if sample_rate is not None:
            raise AudioError(f"sample_rate={sample_rate}: only for a sample array; encoded bytes say their own rate")
        with _temporary(lambda f: f.write(bytes(audio))) as path:
            yield path, None, f"<bytes{which}>"
        return
    if isinstance(audio, np.ndarray):
        samples = _array_samples(audio, sample_rate, f"<array{which}>")
        with _temporary(lambda f: _write_wav(f, samples)) as path:
            yield path, None, f"<array{which}>"
        return
    raise AudioError(f"audio: a path, bytes of an audio file or a float32 sample array, not {type(audio).__name__}")


def mono_samples(audio: Any, label: str, rate: int = SAMPLE_RATE) -> np.ndarray:
    """Float samples of (n,) or (n, channels) as load_audio gives a file's (runner/audio.py): float32 mono at
    16 kHz (channels averaged, resampled with soxr), NaN and Inf refused; errors name `label`."""
    return _to_mono(label, _float_frames(audio, label), rate)


@contextlib.contextmanager
def _temporary(write: Callable) -> Iterator[str]:
    """A file only this user can read (mkstemp), written by `write(file)`, removed however the block ends."""
    fd, path = tempfile.mkstemp(prefix="runner-audio-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        yield path
    finally:
        os.unlink(path)


def _write_wav(f, samples: np.ndarray) -> None:
    """Float32 WAV: load_audio reads back exactly these samples (16 kHz mono: nothing to mix or resample)."""
    import soundfile as sf

    sf.write(f, samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")


def _array_samples(audio: np.ndarray, sample_rate: int | None, label: str) -> np.ndarray:
    """An array's samples at its `sample_rate`, which must be given, a whole number of Hz and one load_audio
    takes."""
    if sample_rate is None:
        raise AudioError(f"{label}: a sample array needs its sample_rate (e.g. sample_rate=16000)")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | np.integer):
        raise AudioError(f"{label}: sample_rate={sample_rate!r}: a whole number of Hz")
    if not MIN_RATE <= sample_rate <= MAX_RATE:
        raise AudioError(f"{label}: unsupported sample rate {sample_rate} Hz (expected {MIN_RATE} to {MAX_RATE} Hz)")
    return mono_samples(audio, label, int(sample_rate))


def _float_frames(audio: Any, label: str) -> np.ndarray:
    """[frames, channels] float32 from a float array of (n,) or (n, channels); NaN and Inf refused."""
    a = np.asarray(audio)
    if a.dtype.kind != "f":
        raise AudioError(f"{label}: samples must be floats in [-1, 1] (float32), not {a.dtype}")
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2 or a.shape[1] > MAX_CHANNELS:
        raise AudioError(f"{label}: samples of shape {a.shape}; give (n,) mono or (n, channels), channels last")
    if len(a) == 0:
        raise AudioError(f"{label}: no samples")
    if not np.isfinite(a).all():
        raise AudioError(f"{label}: contains NaN or Inf samples")
    return a.astype(np.float32, copy=False)
