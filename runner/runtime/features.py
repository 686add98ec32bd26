"""Features of a recording cut into 30 s windows (Whisper): ONE log-mel over the whole recording, each window
its frames, as openai/whisper's `transcribe` computes them:

    mel = log_mel_spectrogram(audio, n_mels, padding=N_SAMPLES)    # the recording + 30 s of zeros, one global max
    content_frames = mel.shape[-1] - N_FRAMES                     # = len(audio) // HOP_LENGTH
    segment = pad_or_trim(mel[:, seek : seek + min(N_FRAMES, content_frames - seek)], N_FRAMES)

pad_or_trim pads the *log-mel* with 0.0, so a window's frames past the recording's last whole frame are 0.0 (not
the log-mel of silence). Without timestamps, seek advances N_FRAMES per window: window i is frames
[i * N_FRAMES, (i + 1) * N_FRAMES).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from runner.audio import HOP_LENGTH, N_FRAMES, N_SAMPLES
from runner.audio_chunks import num_chunks
from runner.runtime.engine import Engine


def window_count(num_samples: int) -> int:
    """openai/whisper's windows over a recording: one per N_FRAMES of its content frames; at least one, so a
    recording shorter than a frame still gets one (all 0.0) window."""
    return max(1, math.ceil(num_samples // HOP_LENGTH / N_FRAMES))


def recording_chunks(num_samples: int) -> int:
    """The 30 s chunks the preprocessor computes for a recording: the recording and 30 s of zeros, padded to
    whole chunks. Every frame openai/whisper computes is there (only zeros follow the recording either way);
    frames past its own are log-mel of zeros, the floor -10, which never raises the global max."""
    return num_chunks(num_samples + N_SAMPLES)


def recording_mel(e: Engine, samples: np.ndarray) -> torch.Tensor:
    """The preprocessor over the whole recording (recording_chunks): [c, n_mels, 3000] f32 on the device."""
    wave = np.zeros(recording_chunks(len(samples)) * N_SAMPLES, dtype=np.float32)
    wave[: len(samples)] = samples
    return e.preprocess(torch.from_numpy(wave).to(e.device))


def window_features(mel: torch.Tensor, num_samples: int, window: int) -> torch.Tensor:
    """Window `window` of a recording's log-mel: [1, n_mels, 3000], its frames past the recording's content 0.0."""
    content = num_samples // HOP_LENGTH - window * N_FRAMES  # this window's frames of the recording
    out = mel[window : window + 1]
    if content >= N_FRAMES:
        return out
    out = out.clone()
    out[..., max(content, 0) :] = 0.0
    return out


def frames_features(mel: torch.Tensor, num_samples: int, first: int, count: int) -> torch.Tensor:
    """The window of `count` frames from frame `first` of a recording's log-mel (transcribe's seek, any frame
    offset), padded with 0.0 to [1, n_mels, 3000] as pad_or_trim pads it: the chunks [c, n_mels, 3000] are one
    log-mel cut every N_FRAMES, so its frames are read across a chunk's end."""
    count = max(0, min(count, N_FRAMES, num_samples // HOP_LENGTH - first))
    flat = mel.permute(1, 0, 2).reshape(mel.shape[1], -1)  # [n_mels, c * 3000]
    out = torch.zeros(1, mel.shape[1], N_FRAMES, dtype=mel.dtype, device=mel.device)
    out[0, :, :count] = flat[:, first : first + count]
    return out


class RecordingFeatures:
    """Each recording's log-mel for the windows cut from it: computed by the first window that needs it and
    kept until clear() (the end of a generate_windows call), so a file of n windows costs one preprocessor call,
    not n calls over the whole file. Keyed by the samples array itself (held, so its id stays its own)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._mels: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

    def window(self, samples: np.ndarray, window: int, frames: tuple[int, int] | None = None) -> torch.Tensor:
        """Window `window` (every N_FRAMES), or with `frames` (first, count) the frames from any offset."""
        key = id(samples)
        if key not in self._mels:
            self._mels[key] = (samples, recording_mel(self.engine, samples))
        mel = self._mels[key][1]
        if frames is not None:
            return frames_features(mel, len(samples), *frames)
        return window_features(mel, len(samples), window)

    def clear(self) -> None:
        self._mels.clear()
