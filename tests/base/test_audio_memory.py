"""load_audio's memory on long files: a 2 GB stereo float WAV peaked past 4.6 GiB (the whole file as float32, then
its float64 mix-down, then the resampled copy). Decoded, mixed and resampled block by block, the peak is the 16 kHz
mono output plus a few blocks, whatever the file's channels and rate.

The files are sparse (a header, then a data chunk of zeros the file system does not store): tmp_path holds a few
bytes however long they are. The peak is numpy's allocations under tracemalloc, in a fresh interpreter."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from runner.audio import SAMPLE_RATE

ROOT = Path(__file__).resolve().parents[2]
CONSTANT = 32 << 20  # bytes beyond the output: a few blocks of samples in flight, soxr's buffers
PEAK = """
import json, sys, tracemalloc
import numpy, soundfile, soxr
from runner.audio import load_audio
tracemalloc.start()
wave = load_audio(sys.argv[1])
print(json.dumps({"samples": len(wave), "peak": tracemalloc.get_traced_memory()[1], "max": float(abs(wave).max())}))
"""


def sparse_float_wav(path: Path, seconds: float, rate: int, channels: int) -> int:
    """A float32 WAV of `seconds` of silence whose data the file system does not store; its data size in bytes."""
    frames = int(seconds * rate)
    size = frames * channels * 4
    fmt = struct.pack("<HHIIHH", 3, channels, rate, rate * channels * 4, channels * 4, 32)
    header = b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + size) + b"WAVE"
    header += b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", size)
    path.write_bytes(header)
    os.truncate(path, len(header) + size)
    return size


def peak_of(path: Path) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", PEAK, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    "rate, channels", [(48000, 2), (SAMPLE_RATE, 2), (44100, 1)], ids=["48k-stereo", "16k-stereo", "44k-mono"]
)
def test_a_long_float_wav_peaks_at_its_16k_mono_output_not_its_raw_size(tmp_path, rate, channels):
    path = tmp_path / "long.wav"
    raw = sparse_float_wav(path, 540.0, rate, channels)  # 9 minutes: 207 MB at 48 kHz stereo
    got = peak_of(path)
    output = got["samples"] * 4
    assert abs(got["samples"] - 540.0 * SAMPLE_RATE) <= 1 and got["max"] == 0.0
    assert got["peak"] < 1.5 * output + CONSTANT, f"peak {got['peak'] / 2**20:.0f} MiB for a {raw / 2**20:.0f} MiB file"
