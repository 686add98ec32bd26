"""runner/export/mel.py: the log-mel module equals transformers' WhisperFeatureExtractor, and exports."""

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank

from runner.audio import N_FRAMES, N_MELS, N_SAMPLES, SAMPLE_RATE, load_audio, pad_to_chunks
from runner.export.methods import export_mel
from runner.models.mel import LogMelSpectrogram, mel_filters

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"
# Same float32 STFT as HF's torch path; measured max |diff| is ~1e-7 (one float32 ulp around 1).
ATOL = 1e-5


@pytest.fixture(scope="module")
def mel():
    return LogMelSpectrogram(N_MELS).eval()


def _hf_per_chunk(wave: np.ndarray, n_mels: int = N_MELS) -> np.ndarray:
    """HF pads/truncates to one 30 s window, so long audio is fed to it one chunk at a time."""
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    chunks = [wave[i : i + N_SAMPLES] for i in range(0, len(wave), N_SAMPLES)]
    return np.concatenate(
        [fe(c, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features for c in chunks], axis=0
    )


def _compare(mel, wave, label, n_chunks):
    ours = mel(torch.from_numpy(pad_to_chunks(wave, max_chunks=n_chunks))).numpy()
    ref = _hf_per_chunk(wave, mel.n_mels)
    assert ours.shape == ref.shape == (n_chunks, mel.n_mels, N_FRAMES)
    diff = float(np.abs(ours - ref).max())
    print(f"mel vs HF WhisperFeatureExtractor, {label}: max abs diff {diff:.3g}")
    assert diff < ATOL


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_match_transformers(n_mels):
    ref = mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    )  # [freqs, mels]
    ours = mel_filters(n_mels)
    assert ours.shape == (n_mels, 201) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref.T, rtol=1e-6, atol=1e-9)


def test_speech_fixture_matches_hf(mel):
    _compare(mel, load_audio(AUDIO / "speech.wav"), "speech.wav (1 chunk)", 1)


def test_long_fixture_matches_hf_per_chunk(mel):
    _compare(mel, load_audio(AUDIO / "long_35s.flac"), "long_35s.flac (2 chunks)", 2)


def test_silence_matches_hf(mel):
    _compare(mel, load_audio(AUDIO / "silence.wav"), "silence.wav", 1)


@pytest.mark.parametrize("n_chunks", [1, 2])
def test_random_signal_matches_hf(mel, n_chunks):
    wave = (np.random.default_rng(n_chunks).standard_normal(n_chunks * N_SAMPLES) * 0.1).astype(np.float32)
    _compare(mel, wave, f"random ({n_chunks} chunks)", n_chunks)


def test_80_mel_variant_matches_hf():
    _compare(LogMelSpectrogram(80), load_audio(AUDIO / "speech.wav"), "speech.wav, 80 mels", 1)


def test_chunks_are_normalised_independently(mel):
    # A loud chunk next to a quiet one must not change the quiet chunk's features (per-chunk max - 8 floor).
    rng = np.random.default_rng(0)
    quiet = (rng.standard_normal(N_SAMPLES) * 1e-3).astype(np.float32)
    loud = (rng.standard_normal(N_SAMPLES) * 0.5).astype(np.float32)
    both = mel(torch.from_numpy(np.concatenate([quiet, loud])))
    alone = mel(torch.from_numpy(quiet))
    torch.testing.assert_close(both[:1], alone, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def exported(mel):
    return export_mel(mel, max_chunks=4)


@pytest.mark.parametrize("n_chunks", [1, 3])
def test_exported_program_matches_eager(mel, exported, n_chunks):
    wave = torch.randn(n_chunks * N_SAMPLES, generator=torch.Generator().manual_seed(n_chunks)) * 0.1
    out = exported.module()(wave)
    assert out.shape == (n_chunks, N_MELS, N_FRAMES)
    torch.testing.assert_close(out, mel(wave), atol=1e-6, rtol=0)


def test_exported_program_rejects_more_chunks_than_declared(exported):
    with pytest.raises(Exception, match="1920000"):
        exported.module()(torch.zeros(5 * N_SAMPLES))


def test_exported_program_keeps_window_and_filters_as_named_state(exported):
    assert {"window", "filters"} <= set(exported.state_dict)


def test_export_for_a_one_chunk_bundle_is_static(mel):
    ep = export_mel(mel, max_chunks=1)
    wave = torch.randn(N_SAMPLES, generator=torch.Generator().manual_seed(0)) * 0.1
    torch.testing.assert_close(ep.module()(wave), mel(wave), atol=1e-6, rtol=0)
