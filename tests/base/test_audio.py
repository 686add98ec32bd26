"""runner/audio.py: loading, mixing, resampling, clear errors for bad files; runner/audio_chunks.py: chunk padding."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

import runner.audio as audio_module
from runner.audio import N_FRAMES, N_SAMPLES, SAMPLE_RATE, TOKENS_PER_CHUNK, load_audio
from runner.audio_chunks import num_chunks, pad_to_chunks
from runner.errors import AudioError, RunnerError

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"


def _write_tone(path, sr=SAMPLE_RATE, seconds=1.0, **kw):
    t = np.arange(int(sr * seconds)) / sr
    sf.write(path, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), sr, **kw)
    return path


def test_constants_describe_a_30s_chunk():
    assert N_SAMPLES == 480_000 and N_FRAMES == 3000 and TOKENS_PER_CHUNK == 375


def test_speech_fixture_loads_as_float32_mono_16k():
    wave = load_audio(AUDIO / "speech.wav")
    info = sf.info(AUDIO / "speech.wav")
    assert wave.dtype == np.float32 and wave.ndim == 1 and wave.flags.c_contiguous
    assert len(wave) == info.frames
    assert 0.05 < np.abs(wave).max() <= 1.0


def test_48k_stereo_is_mixed_by_mean_then_resampled_to_16k():
    raw, sr = sf.read(AUDIO / "speech_48k_stereo.wav", dtype="float32", always_2d=True)
    assert sr == 48000 and raw.shape[1] == 2
    assert not np.allclose(raw[:, 0], raw[:, 1])  # the channels differ, so taking one would be caught

    wave = load_audio(AUDIO / "speech_48k_stereo.wav")
    expected = soxr.resample(raw.mean(axis=1), sr, SAMPLE_RATE)
    assert wave.dtype == np.float32
    assert abs(len(wave) - len(raw) * SAMPLE_RATE / sr) <= 1
    np.testing.assert_allclose(wave, expected, atol=1e-6)


def test_any_rate_is_resampled(tmp_path):
    wave = load_audio(_write_tone(tmp_path / "tone.wav", sr=22050, seconds=2.0))
    assert abs(len(wave) - 2 * SAMPLE_RATE) <= 1


def test_ogg_vorbis_loads(tmp_path):
    wave = load_audio(_write_tone(tmp_path / "tone.ogg", format="OGG"))
    assert abs(len(wave) - SAMPLE_RATE) <= 1


def test_long_flac_needs_two_chunks():
    wave = load_audio(AUDIO / "long_35s.flac")
    assert len(wave) == 35 * SAMPLE_RATE
    assert num_chunks(len(wave)) == 2


def test_short_and_silent_audio_are_valid():
    assert len(load_audio(AUDIO / "short.wav")) < SAMPLE_RATE
    silence = load_audio(AUDIO / "silence.wav")
    assert len(silence) == 2 * SAMPLE_RATE and not silence.any()


def test_transcripts_cover_every_fixture():
    transcripts = json.loads((AUDIO / "transcripts.json").read_text())
    files = {p.name for p in AUDIO.iterdir() if p.suffix in (".wav", ".flac")}
    assert set(transcripts) == files
    assert transcripts["silence.wav"] == ""


# --- errors: one line, naming the file ---


def _expect_error(path, match):
    with pytest.raises(AudioError, match=match) as err:
        load_audio(path)
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg
    assert isinstance(err.value, RunnerError)
    return msg


def test_missing_file(tmp_path):
    _expect_error(tmp_path / "nope.wav", "not found")


def test_directory_is_not_audio(tmp_path):
    _expect_error(tmp_path, "not a file")


def test_zero_byte_file(tmp_path):
    path = tmp_path / "empty.wav"
    path.write_bytes(b"")
    _expect_error(path, "empty")


def test_wav_with_no_samples(tmp_path):
    path = tmp_path / "nosamples.wav"
    sf.write(path, np.zeros(0, np.float32), SAMPLE_RATE)
    _expect_error(path, "no samples")


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_truncated_file(tmp_path, fmt):
    whole = _write_tone(tmp_path / f"whole.{fmt}", seconds=2.0)
    cut = tmp_path / f"cut.{fmt}"
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    _expect_error(cut, "truncated")


def test_text_file_is_not_audio(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("these are not the samples you are looking for\n" * 20)
    _expect_error(path, "not a readable audio file")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_samples(tmp_path, bad):
    samples = np.zeros(SAMPLE_RATE, np.float32)
    samples[123] = bad
    path = tmp_path / "nan.wav"
    sf.write(path, samples, SAMPLE_RATE, subtype="FLOAT")
    _expect_error(path, "NaN or Inf")


# --- chunking ---


@pytest.mark.parametrize(
    "n, chunks", [(0, 1), (1, 1), (N_SAMPLES - 1, 1), (N_SAMPLES, 1), (N_SAMPLES + 1, 2), (3 * N_SAMPLES, 3)]
)
def test_num_chunks_rounds_up_to_whole_chunks(n, chunks):
    assert num_chunks(n) == chunks


def test_pad_to_chunks_zero_pads_to_a_multiple_of_30s():
    wave = np.random.default_rng(0).uniform(-1, 1, N_SAMPLES + 10).astype(np.float32)
    padded = pad_to_chunks(wave, max_chunks=4)
    assert padded.shape == (2 * N_SAMPLES,) and padded.dtype == np.float32
    np.testing.assert_array_equal(padded[: len(wave)], wave)
    assert not padded[len(wave) :].any()
    assert pad_to_chunks(np.zeros(0, np.float32), 1).shape == (N_SAMPLES,)


def test_pad_to_chunks_refuses_audio_longer_than_the_bundle_takes():
    wave = np.zeros(35 * SAMPLE_RATE, np.float32)
    with pytest.raises(AudioError, match=r"35\.0 s.*at most 1 chunks \(30 s\)"):
        pad_to_chunks(wave, max_chunks=1)


def test_audio_module_imports_neither_torch_nor_the_audio_libraries():
    # torch: the runtime front end must not need it; soundfile/soxr: the export machine has only torch.
    code = "import sys, runner.audio; sys.exit(any(m in sys.modules for m in ('torch', 'soundfile', 'soxr')))"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


# ---- long files: read, mixed and resampled block by block, with the samples of one whole read


def _blocks_and_whole(monkeypatch, path):
    whole = load_audio(path)
    monkeypatch.setattr(audio_module, "BLOCK_BYTES", 4096)  # a few hundred frames a block: many blocks
    return load_audio(path), whole


@pytest.mark.parametrize(
    "rate, channels, subtype",
    [(48000, 2, "FLOAT"), (44100, 2, "PCM_16"), (SAMPLE_RATE, 3, "PCM_24"), (22050, 1, "FLOAT"), (8000, 1, "PCM_U8")],
)
def test_a_file_read_in_blocks_gives_the_samples_of_one_read(tmp_path, monkeypatch, rate, channels, subtype):
    rng = np.random.default_rng(rate + channels)
    x = (0.5 * rng.standard_normal((int(rate * 2.3) + 7, channels))).clip(-1, 1).astype(np.float32)
    path = tmp_path / "x.wav"
    sf.write(path, x, rate, subtype=subtype)
    blocks, whole = _blocks_and_whole(monkeypatch, path)
    assert blocks.dtype == np.float32 and blocks.shape == whole.shape
    np.testing.assert_allclose(blocks, whole, rtol=0, atol=1e-6)


def test_a_block_read_file_refuses_a_nan_late_in_it_like_a_whole_read(tmp_path, monkeypatch):
    x = np.zeros((48000, 2), np.float32)
    x[-3, 1] = np.nan
    sf.write(tmp_path / "nan.wav", x, 48000, subtype="FLOAT")
    monkeypatch.setattr(audio_module, "BLOCK_BYTES", 4096)
    with pytest.raises(AudioError, match="contains NaN or Inf samples"):
        load_audio(tmp_path / "nan.wav")


def test_a_block_read_file_too_loud_to_resample_names_its_peak(tmp_path, monkeypatch):
    x = np.zeros((48000, 2), np.float32)
    x[-4000:-3000] = np.float32(3e38) * np.where(np.arange(1000) % 2, 1, -1)[:, None]
    sf.write(tmp_path / "loud.wav", x, 48000, subtype="FLOAT")
    with pytest.raises(AudioError) as whole:
        load_audio(tmp_path / "loud.wav")
    monkeypatch.setattr(audio_module, "BLOCK_BYTES", 4096)
    with pytest.raises(AudioError) as blocks:
        load_audio(tmp_path / "loud.wav")
    assert "too large to process (peak 3e+38)" in str(blocks.value) and str(blocks.value) == str(whole.value)


def test_a_file_only_ffmpeg_reads_gives_in_blocks_the_samples_of_one_read(tmp_path, monkeypatch):
    """64-bit integer PCM: libsndfile refuses it, so PyAV decodes it; its frames are gathered into blocks."""
    import struct

    rng = np.random.default_rng(7)
    ints = (rng.uniform(-0.5, 0.5, (48000 * 2 + 5, 2)) * 2**63).astype("<i8")
    data = ints.tobytes()
    fmt = struct.pack("<IHHIIHH", 16, 1, 2, 48000, 48000 * 16, 16, 64)
    path = tmp_path / "s64.wav"
    path.write_bytes(
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", len(data)) + data
    )
    blocks, whole = _blocks_and_whole(monkeypatch, path)
    assert blocks.shape == whole.shape and abs(len(whole) - 32000) <= 2
    np.testing.assert_allclose(blocks, whole, rtol=0, atol=1e-6)
