"""runner/models/mel.py: the preprocessor computes what the reference processors compute over the WHOLE audio
(one STFT, one global max, frames cut into 30 s chunks), in eager, as an exported program and in a compiled bundle.

Voxtral: transformers' `VoxtralProcessor._retrieve_input_features` (WhisperFeatureExtractor with the processor's
own audio kwargs). Whisper: openai/whisper's transcribe (log_mel_spectrogram over the recording + 30 s of zeros,
its segments cut at multiples of 3000 frames and padded with 0.0; runner/runtime/features.py).
Quiet audio followed by loud audio is where a per-chunk max would differ.
"""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import VoxtralProcessor, WhisperFeatureExtractor
from transformers.audio_utils import mel_filter_bank

from runner.audio import HOP_LENGTH, N_FRAMES, N_MELS, N_SAMPLES, SAMPLE_RATE, load_audio
from runner.audio_chunks import pad_to_chunks
from runner.export.methods import export_mel
from runner.models.mel import LogMelSpectrogram, mel_filters
from runner.runtime.features import RecordingFeatures, window_count

AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio"
# Same float32 STFT as the references' torch path; measured max |diff| ~1.2e-7 (one float32 ulp around 1).
ATOL = 1e-5


@pytest.fixture(scope="module")
def mel():
    return LogMelSpectrogram(N_MELS).eval()


def processor_audio_kwargs() -> dict:
    """VoxtralProcessor's own audio kwargs: a class attribute in transformers 5.25, its kwargs class's
    `_defaults` (plus the common return_tensors="pt") in 5.17."""
    kwargs = getattr(VoxtralProcessor, "audio_kwargs", None)
    if kwargs is None:
        from transformers.models.voxtral.processing_voxtral import VoxtralProcessorKwargs

        kwargs = {**VoxtralProcessorKwargs._defaults["audio_kwargs"], "return_tensors": "pt"}
    return dict(kwargs)


def voxtral_processor_features(wave: np.ndarray, n_mels: int = N_MELS) -> np.ndarray:
    """The processor's own method and kwargs; it only reads `self.feature_extractor`."""
    kwargs = processor_audio_kwargs()
    max_source_positions = kwargs.pop("max_source_positions")
    holder = SimpleNamespace(feature_extractor=WhisperFeatureExtractor(feature_size=n_mels))
    return VoxtralProcessor._retrieve_input_features(holder, [wave], max_source_positions, **kwargs).numpy()


def quiet_then_loud(n_samples: int, seed: int = 0) -> np.ndarray:
    """A whisper for the first half, then loud noise: the loud half's max sets the floor of the quiet half."""
    rng = np.random.default_rng(seed)
    half = n_samples // 2
    quiet = rng.standard_normal(half) * 1e-4
    loud = rng.standard_normal(n_samples - half) * 0.5
    return np.concatenate([quiet, loud]).astype(np.float32)


def _compare(features, ref: np.ndarray, label: str) -> None:
    assert features.shape == ref.shape, label
    diff = float(np.abs(features - ref).max())
    print(f"{label}: max abs diff {diff:.3g}")
    assert diff < ATOL, label


# ---------------------------------------------------------------- Voxtral: VoxtralProcessor


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


@pytest.mark.parametrize("n_chunks", [1, 2, 5])
def test_quiet_then_loud_matches_voxtral_processor(mel, n_chunks):
    wave = quiet_then_loud(n_chunks * N_SAMPLES - 12345, seed=n_chunks)  # the last chunk partly padding
    ref = voxtral_processor_features(wave)
    assert ref.shape == (n_chunks, N_MELS, N_FRAMES)
    _compare(mel(torch.from_numpy(pad_to_chunks(wave, n_chunks))).numpy(), ref, f"quiet+loud, {n_chunks} chunks")


@pytest.mark.parametrize("name,n_chunks", [("speech.wav", 1), ("long_35s.flac", 2), ("silence.wav", 1)])
def test_fixtures_match_voxtral_processor(mel, name, n_chunks):
    wave = load_audio(AUDIO / name)
    _compare(mel(torch.from_numpy(pad_to_chunks(wave, n_chunks))).numpy(), voxtral_processor_features(wave), name)


def test_80_mel_variant_matches_the_processor_path():
    wave = quiet_then_loud(2 * N_SAMPLES)
    ours = LogMelSpectrogram(80)(torch.from_numpy(wave)).numpy()
    _compare(ours, voxtral_processor_features(wave, 80), "quiet+loud, 80 mels")


def test_one_floor_for_the_whole_audio_not_one_per_chunk(mel):
    """What a chunk-by-chunk front end got wrong (and this test would catch): the quiet chunk's floor is the
    loud chunk's max - 8, and its first frames see the loud chunk's first samples, not a reflection."""
    wave = quiet_then_loud(2 * N_SAMPLES)
    ours = mel(torch.from_numpy(wave))
    alone = mel(torch.from_numpy(wave[:N_SAMPLES]))  # the quiet chunk as its own spectrogram
    assert (ours[0] - alone[0]).abs().max().item() > 0.5
    floor = ours.amax().item() - 2.0  # log-mel floor max - 8, as features ((x + 4) / 4): 8 / 4 below the max
    assert ours[0].amin().item() == pytest.approx(floor, abs=1e-6) and alone[0].amin().item() < floor - 0.5


# ---------------------------------------------------------------- Whisper: openai/whisper's transcribe


def openai_segments(wave: np.ndarray, n_mels: int) -> np.ndarray:
    """openai/whisper 20250625's transcribe() without timestamps: its own functions where installed."""
    import whisper  # openai-whisper, the test extra: without it the comparison fails, it does not skip

    assert hasattr(whisper, "log_mel_spectrogram"), (
        f"{whisper.__file__}: the module named whisper is not openai-whisper"
    )
    full = whisper.log_mel_spectrogram(torch.from_numpy(wave), n_mels, padding=N_SAMPLES)
    content, seek, out = full.shape[-1] - N_FRAMES, 0, []
    while seek < content:
        size = min(N_FRAMES, content - seek)
        out.append(whisper.pad_or_trim(full[:, seek : seek + size], N_FRAMES))
        seek += size
    return torch.stack(out).numpy()


def hf_segments(wave: np.ndarray, n_mels: int) -> np.ndarray:
    """The same from transformers' extractor (no openai-whisper needed): one log-mel over the recording + 30 s
    of zeros, then openai's cutting written out (windows of 3000 frames, 0.0 past the content frames)."""
    fe = WhisperFeatureExtractor(feature_size=n_mels)
    padded = np.concatenate([wave, np.zeros(N_SAMPLES, np.float32)])
    full = fe(padded, sampling_rate=SAMPLE_RATE, padding="longest", truncation=False, return_tensors="np")
    full = full.input_features[0]  # [n_mels, (len + N_SAMPLES) // HOP_LENGTH]
    content = full.shape[-1] - N_FRAMES
    assert content == len(wave) // HOP_LENGTH
    out = []
    for seek in range(0, content, N_FRAMES):
        seg = np.zeros((n_mels, N_FRAMES), np.float32)
        size = min(N_FRAMES, content - seek)
        seg[:, :size] = full[:, seek : seek + size]
        out.append(seg)
    return np.stack(out)


def whisper_windows(preprocess, wave: np.ndarray, device: str = "cpu") -> np.ndarray:
    engine = SimpleNamespace(preprocess=preprocess, device=device)
    features = RecordingFeatures(engine)
    return torch.cat([features.window(wave, i) for i in range(window_count(len(wave)))]).cpu().numpy()


# windows -> samples: a partial window; exactly 60 s (the 30 s of zeros, not a reflection, follow the last frames);
# a partial last window after four whole ones
WHISPER_LENGTHS = {
    1: 70_000,
    2: 2 * N_SAMPLES,
    5: 4 * N_SAMPLES + 333_333,
}


@pytest.mark.parametrize("windows", sorted(WHISPER_LENGTHS))
@pytest.mark.parametrize("reference", [hf_segments, openai_segments])
def test_whisper_windows_match_openai_transcribe(windows, reference):
    wave = quiet_then_loud(WHISPER_LENGTHS[windows], seed=windows)
    ref = reference(wave, 80)
    assert len(ref) == windows == window_count(len(wave))
    _compare(whisper_windows(LogMelSpectrogram(80), wave), ref, f"whisper quiet+loud, {windows} windows")


def test_whisper_window_count_follows_content_frames():
    """openai seeks over len // 160 content frames: a tail shorter than one hop makes no window of its own."""
    assert [window_count(n) for n in (0, 159, N_SAMPLES, N_SAMPLES + 159, N_SAMPLES + 160)] == [1, 1, 1, 1, 2]


def test_whisper_last_window_is_padded_with_zero_log_mel():
    wave = quiet_then_loud(N_SAMPLES + 16_000)  # 31 s: the second window has 100 content frames
    second = whisper_windows(LogMelSpectrogram(80), wave)[1]
    assert (second[:, 100:] == 0.0).all() and (second[:, :100] != 0.0).any()


# ---------------------------------------------------------------- exported


@pytest.fixture(scope="module")
def exported(mel):
    return export_mel(mel, max_chunks=6)


@pytest.mark.parametrize("n_chunks", [1, 2, 5])
def test_exported_program_matches_voxtral_processor(exported, n_chunks):
    wave = quiet_then_loud(n_chunks * N_SAMPLES, seed=10 + n_chunks)
    out = exported.module()(torch.from_numpy(wave))
    _compare(out.numpy(), voxtral_processor_features(wave), f"exported, {n_chunks} chunks")


def test_exported_program_rejects_more_chunks_than_declared(exported):
    with pytest.raises(Exception, match="2880000"):
        exported.module()(torch.zeros(7 * N_SAMPLES))


def test_exported_program_keeps_window_and_filters_as_named_state(exported):
    assert {"window", "filters"} <= set(exported.state_dict)


def test_export_for_a_one_chunk_bundle_is_static(mel):
    ep = export_mel(mel, max_chunks=1)
    wave = quiet_then_loud(N_SAMPLES)
    _compare(ep.module()(torch.from_numpy(wave)).numpy(), voxtral_processor_features(wave), "static one chunk")


def test_compiled_bundle_preprocessor_matches_voxtral_processor(tiny_bundle):
    """The AOTI-compiled method of a real bundle, through the delegate, at every chunk count it is asked for."""
    from runner.runtime.engine import ProgramEngine
    from runner.runtime.program import Program

    with Program.load(tiny_bundle) as program:
        engine = ProgramEngine(program)
        counts = [n for n in (1, 2, 5) if n <= engine.max_audio_chunks]
        assert 2 in counts, "the tiny bundle should take at least two chunks"
        for n in counts:
            wave = quiet_then_loud(n * N_SAMPLES - 777, seed=20 + n)
            out = engine.preprocess(torch.from_numpy(pad_to_chunks(wave, n)))
            _compare(out.numpy(), voxtral_processor_features(wave), f"compiled bundle, {n} chunks")
