"""Property tests (hypothesis) for the two parsers that read untrusted bytes: the audio loader and the bundle
manifest. The property: the result is valid, or the error is ours (AudioError / BundleError, a RunnerError the
CLI prints as one line); nothing else escapes. test_bundle.py holds the manifest's structural properties
(arbitrary JSON, mutated real manifests through verify_bundle); here the manifest gets raw bytes and byte-level
mutations. The long runs are atheris scripts: tests/fuzz/ (`nox -s fuzz`)."""

from __future__ import annotations

import io
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.audio import SAMPLE_RATE, load_audio
from runner.bundle import MANIFEST_NAME, Manifest, read_manifest
from runner.errors import AudioError, BundleError

SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)


def _encoded(fmt: str, subtype: str | None, channels: int = 1, sr: int = SAMPLE_RATE, n: int = 800) -> bytes:
    t = np.arange(n) / sr
    x = (0.25 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    x = np.tile(x[:, None], (1, channels))
    buf = io.BytesIO()
    sf.write(buf, x, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


# small valid files of the formats people send: the seeds every mutation starts from
SEEDS = {
    "pcm16.wav": _encoded("WAV", "PCM_16"),
    "float.wav": _encoded("WAV", "FLOAT", channels=2),
    "pcm24_6ch.wav": _encoded("WAV", "PCM_24", channels=6),
    "ulaw.wav": _encoded("WAV", "ULAW", sr=8000),
    "imaadpcm.wav": _encoded("WAV", "IMA_ADPCM"),
    "tone.flac": _encoded("FLAC", "PCM_16", sr=44100),
    "tone.ogg": _encoded("OGG", "VORBIS", n=4000),
    "tone.aiff": _encoded("AIFF", "PCM_16"),
}


def check_load(path: Path) -> None:
    """The property: float32 mono finite samples, or AudioError."""
    try:
        wave = load_audio(path)
    except AudioError as e:
        assert str(path) in str(e) and "\n" not in str(e), str(e)
        return
    assert isinstance(wave, np.ndarray) and wave.dtype == np.float32 and wave.ndim == 1 and len(wave) > 0
    assert np.isfinite(wave).all()


@pytest.fixture
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def test_every_seed_loads(scratch):
    for name, data in SEEDS.items():
        (scratch / name).write_bytes(data)
        assert len(load_audio(scratch / name)) > 0, name


@SETTINGS
@given(data=st.binary(max_size=4096), suffix=st.sampled_from([".wav", ".flac", ".ogg", ".mp3", ".aiff", ""]))
def test_arbitrary_bytes(scratch, data, suffix):
    path = scratch / f"x{suffix}"
    path.write_bytes(data)
    check_load(path)


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(1, 255)),
    st.tuples(st.just("set"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 16), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 16), st.integers(1, 64)),
    st.tuples(
        st.just("u32"), st.integers(0, 96), st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0x10000, 44100 * 1000])
    ),
)


def mutate(data: bytes, mutations) -> bytes:
    b = bytearray(data)
    for kind, pos, val in mutations:
        if not b:
            break
        i = pos % len(b)
        if kind == "flip":
            b[i] ^= val
        elif kind == "set":
            b[i] = val
        elif kind == "truncate":
            del b[i:]
        elif kind == "insert":
            b.insert(i, val)
        elif kind == "delete":
            del b[i : i + val]
        elif kind == "u32" and pos + 4 <= len(b):  # header fields: sizes, rates, counts
            b[pos : pos + 4] = struct.pack("<I", val)
    return bytes(b)


@SETTINGS
@given(seed=st.sampled_from(sorted(SEEDS)), mutations=st.lists(_mutation, min_size=1, max_size=4))
def test_mutated_audio_files(scratch, seed, mutations):
    path = scratch / f"m_{seed}"
    path.write_bytes(mutate(SEEDS[seed], mutations))
    check_load(path)


@SETTINGS
@given(
    tag=st.sampled_from([1, 2, 3, 6, 7, 0x11, 0x31, 0x55, 0xFFFE, 0, 0x1234]),
    channels=st.sampled_from([0, 1, 2, 6, 255, 1024, 65535]),
    rate=st.sampled_from([0, 1, 8000, 16000, 96000, 384000, 0x7FFFFFFF, 0xFFFFFFFF]),
    bits=st.sampled_from([0, 1, 8, 12, 16, 24, 32, 64, 65535]),
    declared=st.sampled_from([0, 2, 100, 3200, 0xFFFFFFFF, 0x7FFFFFFF]),
    present=st.integers(0, 3300),
)
def test_wav_headers(scratch, tag, channels, rate, bits, declared, present):
    """Hand-made RIFF/WAVE headers with every field at its edge, and more or fewer data bytes than declared."""
    block = max(1, channels * bits // 8) & 0xFFFF
    fmt = struct.pack("<HHIIHH", tag, channels, rate, (rate * block) & 0xFFFFFFFF, block, bits)
    data = bytes((i * 37) & 0xFF for i in range(present))
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", declared) + data
    path = scratch / "h.wav"
    path.write_bytes(b"RIFF" + struct.pack("<I", (len(body)) & 0xFFFFFFFF) + body)
    check_load(path)


# ---------------------------------------------------------------- the manifest, as bytes


@pytest.fixture(scope="module")
def manifest_bytes(tiny_bundle) -> bytes:
    return (tiny_bundle / MANIFEST_NAME).read_bytes()


def _parse(data: bytes) -> None:
    try:
        m = Manifest.from_json(data.decode("utf-8", errors="replace"))
    except BundleError:
        return
    assert isinstance(m, Manifest)


@SETTINGS
@given(mutations=st.lists(_mutation, min_size=1, max_size=6))
def test_manifest_with_mutated_bytes(manifest_bytes, mutations):
    _parse(mutate(manifest_bytes, mutations))


@SETTINGS
@given(data=st.binary(max_size=2048))
def test_manifest_file_of_arbitrary_bytes(scratch, data):
    """read_manifest on a model.pte of any bytes (invalid UTF-8 included)."""
    (scratch / MANIFEST_NAME).write_bytes(data)
    try:
        read_manifest(scratch)
    except BundleError:
        pass


@pytest.mark.parametrize("field", ["format_version", "size"])
@pytest.mark.parametrize("bad", ["1e999", "-1e999", "1" * 5000, "NaN", "Infinity", "-1", "1.5"])
def test_manifest_numbers_out_of_range(manifest_bytes, field, bad):
    """JSON numbers Python parses into huge ints, infinities or fractions where the manifest wants a small whole
    number, put in place of the real manifest's own (found in its text, whatever its format version): refused."""
    text = manifest_bytes.decode()
    assert isinstance(Manifest.from_json(text), Manifest)  # the number replaced is the only fault
    real = re.search(rf'"{field}": (\d+)', text)
    assert real is not None, f"the manifest has no {field} number to replace"
    mutated = text[: real.start(1)] + bad + text[real.end(1) :]
    assert mutated != text
    with pytest.raises(BundleError):
        Manifest.from_json(mutated)


@pytest.mark.parametrize("sr", [SAMPLE_RATE, 44100])
def test_huge_float_samples_in_several_channels(scratch, sr):
    """Found by atheris: finite float32 samples near 3e38 in two channels; the float32 channel mean overflowed
    to inf, and load_audio returned non-finite samples."""
    x = np.full((400, 2), 3e38, np.float32)
    x[::2] *= -1
    path = scratch / f"huge{sr}.wav"
    sf.write(path, x, sr, subtype="FLOAT")
    check_load(path)
