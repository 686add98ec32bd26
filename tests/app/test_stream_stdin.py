"""`stream --audio -` (runner/app/stream.py): a WAV header on stdin is recognised and its samples are the file's
(load_audio's: same scaling, mix-down and soxr resampling); raw PCM without a header stays the default."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import soundfile as sf
from conftest import AUDIO

from runner.app.stream import _stdin_blocks
from runner.audio import SAMPLE_RATE, load_audio
from runner.errors import AudioError

BLOCK = 1280  # 80 ms at 16 kHz: what stream feeds per step


def fed(data: bytes, pcm: str = "s16le") -> np.ndarray:
    return np.concatenate(list(_stdin_blocks(io.BytesIO(data), pcm, BLOCK)))


def wav_bytes(path, subtype=None) -> bytes:
    samples, sr = sf.read(path, dtype="float64", always_2d=True)
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype=subtype or sf.info(path).subtype)
    return buf.getvalue()


@pytest.mark.parametrize("name", ["speech.wav", "speech_48k_stereo.wav"])
@pytest.mark.parametrize("subtype", [None, "PCM_24", "FLOAT", "PCM_U8"])
def test_a_wav_on_stdin_gives_the_file_s_samples(tmp_path, name, subtype):
    data = wav_bytes(AUDIO / name, subtype)
    path = tmp_path / "same.wav"
    path.write_bytes(data)
    np.testing.assert_array_equal(fed(data), load_audio(path))


def test_a_16k_mono_wav_is_fed_in_the_file_s_blocks():
    blocks = list(_stdin_blocks(io.BytesIO((AUDIO / "speech.wav").read_bytes()), "s16le", BLOCK))
    assert all(len(b) == BLOCK for b in blocks[:-1])


def test_a_streaming_writer_s_unknown_sizes_read_to_the_end():
    data = bytearray((AUDIO / "speech.wav").read_bytes())
    struct.pack_into("<I", data, 4, 0xFFFFFFFF)
    pos = data.index(b"data")
    struct.pack_into("<I", data, pos + 4, 0xFFFFFFFF)
    np.testing.assert_array_equal(fed(bytes(data)), load_audio(AUDIO / "speech.wav"))


def test_chunks_after_the_data_are_not_samples():
    data = (AUDIO / "speech.wav").read_bytes() + b"LIST" + struct.pack("<I", 8) + b"INFOabcd"
    np.testing.assert_array_equal(fed(data), load_audio(AUDIO / "speech.wav"))


@pytest.mark.parametrize("pcm, dtype, scale", [("s16le", "<i2", 1 / 32768), ("f32le", "<f4", 1.0)])
def test_raw_pcm_without_a_header_stays_the_default(pcm, dtype, scale):
    rng = np.random.default_rng(0)
    x = (rng.uniform(-0.5, 0.5, SAMPLE_RATE + 7) / scale).astype(dtype)
    np.testing.assert_array_equal(fed(x.tobytes(), pcm), x.astype(np.float32) * np.float32(scale))
    assert len(fed(x[:3].tobytes(), pcm)) == 3  # fewer bytes than the header peek


def test_an_unsupported_wav_encoding_is_one_line():
    data = bytearray((AUDIO / "speech.wav").read_bytes())
    struct.pack_into("<H", data, data.index(b"fmt ") + 8, 0x0055)  # MPEG-3 in a WAV
    with pytest.raises(AudioError, match=r"^unsupported WAV encoding on stdin \(format tag 0x0055, 16 bits\)"):
        fed(bytes(data))
