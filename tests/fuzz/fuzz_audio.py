"""atheris: the audio loader (runner.audio.load_audio) on fuzzed files. Only AudioError may escape, and what it
returns must be float32 mono finite samples; anything else is a crash atheris reports with its input.

    python tests/fuzz/fuzz_audio.py -max_total_time=300 [CORPUS_DIR]     (nox -s fuzz)

The corpus is seeded with small valid WAV (PCM, float, 24-bit 6-channel, mu-law, IMA ADPCM), FLAC, Ogg and
AIFF files; the first input byte picks the file suffix (libsndfile also sniffs the content).
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path

import atheris
import numpy as np
import soundfile as sf

with atheris.instrument_imports():
    from runner.audio import load_audio
    from runner.errors import AudioError

SUFFIXES = (".wav", ".flac", ".ogg", ".aiff", ".mp3", "")


def seeds() -> dict[str, bytes]:
    def enc(fmt, subtype, channels=1, sr=16000, n=800):
        x = (0.25 * np.sin(2 * np.pi * 440 * np.arange(n) / sr)).astype(np.float32)
        buf = io.BytesIO()
        sf.write(buf, np.tile(x[:, None], (1, channels)), sr, format=fmt, subtype=subtype)
        return buf.getvalue()

    return {
        "pcm16.wav": b"\0" + enc("WAV", "PCM_16"),
        "float.wav": b"\0" + enc("WAV", "FLOAT", channels=2),
        "pcm24_6ch.wav": b"\0" + enc("WAV", "PCM_24", channels=6),
        "ulaw.wav": b"\0" + enc("WAV", "ULAW", sr=8000),
        "ima.wav": b"\0" + enc("WAV", "IMA_ADPCM"),
        "tone.flac": b"\1" + enc("FLAC", "PCM_16", sr=44100),
        "tone.ogg": b"\2" + enc("OGG", "VORBIS", n=4000),
        "tone.aiff": b"\3" + enc("AIFF", "PCM_16"),
    }


WORK = Path(tempfile.mkdtemp(prefix="fuzz-audio-"))


def target(data: bytes) -> None:
    if not data:
        return
    path = WORK / f"input{SUFFIXES[data[0] % len(SUFFIXES)]}"
    path.write_bytes(data[1:])
    try:
        wave = load_audio(path)
    except AudioError:
        return
    assert wave.dtype == np.float32 and wave.ndim == 1 and len(wave) > 0, (wave.dtype, wave.shape)
    assert np.isfinite(wave).all()


def main() -> None:
    argv = list(sys.argv)
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    if corpus:
        Path(corpus[0]).mkdir(parents=True, exist_ok=True)
        for name, data in seeds().items():
            if not (Path(corpus[0]) / name).exists():
                (Path(corpus[0]) / name).write_bytes(data)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    atheris.Setup(argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
