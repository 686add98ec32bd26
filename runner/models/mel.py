"""The `preprocessor` method: waveform -> Whisper-style log-mel features, as an exportable nn.Module (exported
with its chunk count dynamic by runner/export/methods.py).

ONE log-mel over the whole waveform, then its frames cut into 30 s chunks, as transformers'
`VoxtralProcessor._retrieve_input_features` (WhisperFeatureExtractor over the audio padded to a multiple of
480000 samples), vLLM, ExecuTorch's `mel_spectrogram.py` and openai/whisper's `log_mel_spectrogram` compute it:
STFT (Hann 400, periodic; hop 160; center=True, reflect pad at the waveform's two ends only) -> power -> drop the
last frame -> Slaney mel filters -> log10(clamp 1e-10) -> max(x, global max - 8) -> (x + 4) / 4.
Chunk by chunk would reflect-pad every chunk edge and floor each chunk at its own max: a quiet chunk next to a
loud one differs by up to ~0.9.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from runner.audio import HOP_LENGTH, N_FFT, N_FRAMES, N_MELS, SAMPLE_RATE


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default): linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / (200.0 / 3)
    log_region = hz >= 1000.0
    mel[log_region] = 15.0 + np.log(hz[log_region] / 1000.0) / (np.log(6.4) / 27.0)
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = mel * (200.0 / 3)
    log_region = mel >= 15.0
    hz[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel[log_region] - 15.0))
    return hz


def mel_filters(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-normalised triangular mel filterbank over [0, sample_rate / 2]: [n_mels, 1 + n_fft // 2] float32.

    Same as librosa.filters.mel(htk=False, norm="slaney") and transformers'
    mel_filter_bank(norm="slaney", mel_scale="slaney") (which is transposed: [freqs, mels]).
    """
    fft_freqs = np.linspace(0.0, sample_rate / 2, 1 + n_fft // 2)
    mel_max = _hz_to_mel(np.array([sample_rate / 2]))[0]
    edges = _mel_to_hz(np.linspace(0.0, mel_max, n_mels + 2))  # filter i spans edges[i] .. edges[i + 2]

    widths = np.diff(edges)  # [n_mels + 1]
    slopes = edges[:, None] - fft_freqs[None, :]  # [n_mels + 2, n_freqs]
    rising = -slopes[:-2] / widths[:-1, None]
    falling = slopes[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]  # Slaney: each filter has unit area
    return weights.astype(np.float32)


class LogMelSpectrogram(nn.Module):
    """waveform [n_chunks * N_SAMPLES] float32 -> log-mel [n_chunks, n_mels, N_FRAMES] float32: chunk i is
    frames [i * N_FRAMES, (i + 1) * N_FRAMES) of the one spectrogram.

    Window and filters are persistent buffers, so they sit in the state dict with the model's other tensors
    (the exported program stores them as constants).
    """

    def __init__(self, n_mels: int = N_MELS) -> None:
        super().__init__()
        self.n_mels = n_mels
        self.register_buffer("window", torch.hann_window(N_FFT, periodic=True, dtype=torch.float32))
        self.register_buffer("filters", torch.from_numpy(mel_filters(n_mels)))  # [n_mels, 201]

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(
            waveform, N_FFT, HOP_LENGTH, window=self.window, center=True, pad_mode="reflect", return_complex=True
        )  # [201, c * 3000 + 1] complex: reflect-padded at the two ends only
        # |z|^2 from the real view: Inductor handles real ops everywhere, complex abs() less so.
        power = torch.view_as_real(spec[:, :-1]).pow(2).sum(-1)  # [201, c * 3000]; the last frame dropped
        chunks = power.reshape(power.shape[0], -1, N_FRAMES).transpose(0, 1)  # [c, 201, 3000], a view
        # bmm, not matmul: matmul's decomposition branches on batch == 1, which would pin the chunk count. Cutting
        # the chunks here (not .contiguous() on the output) also avoids a guard: a [1, ...] transpose is contiguous.
        mel = torch.bmm(self.filters.expand(chunks.shape[0], -1, -1), chunks)  # [c, n_mels, 3000]
        log_spec = torch.clamp(mel, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.amax() - 8.0)  # one floor for the whole audio
        return (log_spec + 4.0) / 4.0
