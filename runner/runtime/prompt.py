"""A prompt, as the generation loop takes it: its segments in order (token ids, audio for the encoder, or audio
already encoded), and each segment's input copied onto the device before the loop queues any compute.

The families build prompts (runner/families/) and the loop runs them (runner/runtime/generate.py): this is the
vocabulary the two share, apart from the loop that consumes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner.audio import HOP_LENGTH, N_SAMPLES, SAMPLE_RATE
from runner.errors import GenerationError
from runner.runtime.voicing import sound_seconds
from runner.runtime.waveform import PinnedHostBuffer, wave_on_device


@dataclass(frozen=True)
class TextSegment:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class AudioSegment:
    """Audio for the encoder. `window` None: all of `samples` (float32 mono 16 kHz) is one encoder input, its
    features ONE log-mel over it padded to whole 30 s chunks (Voxtral). `window` i: `samples` is a whole recording
    and this segment its i-th 30 s window, the features cut from ONE log-mel over the recording, computed once
    for all its windows (Whisper; runner/runtime/features.py)."""

    samples: np.ndarray
    window: int | None = None
    # (first frame, frames): a window at any frame offset of the recording (Whisper's seek); `window` is then 0
    frames: tuple[int, int] | None = None
    # the answer is this audio's transcript (not a chat answer): judged implausibly short or not for its sound
    transcribed: bool = False

    def own_samples(self) -> np.ndarray:
        """The samples this segment stands for (a view)."""
        if self.frames is not None:
            return self.samples[self.frames[0] * HOP_LENGTH :][: self.num_samples]
        if self.window is None:
            return self.samples
        return self.samples[self.window * N_SAMPLES :][:N_SAMPLES]

    @property
    def num_samples(self) -> int:
        """The samples of audio this segment stands for."""
        if self.frames is not None:
            return self.frames[1] * HOP_LENGTH
        if self.window is None:
            return len(self.samples)
        return min(N_SAMPLES, max(0, len(self.samples) - self.window * N_SAMPLES))


def window_sound(prompt: Prompt) -> float | None:
    """The seconds of sound in a transcription prompt's audio (None: not a transcription)."""
    for seg in prompt:
        if isinstance(seg, AudioSegment) and seg.transcribed:
            return sound_seconds(seg.own_samples())
    return None


@dataclass(frozen=True)
class EncodedAudio:
    """Audio already through the encoder: its embeddings [1, n, H] on the device, and the samples they stand for.
    The batch runner encodes the chunks of several files in one call, then prefills each (runner/runtime/batch.py)."""

    embeds: torch.Tensor
    num_samples: int


Segment = TextSegment | AudioSegment | EncodedAudio
Prompt = list[Segment]  # one decoder context


def audio_seconds(segments: list[Segment]) -> float:
    """The seconds of audio a prompt stands for."""
    return sum(s.num_samples for s in segments if not isinstance(s, TextSegment)) / SAMPLE_RATE


def inputs_on_device(
    segments: list[Segment], device: str, audio_chunks: int, window_mel=None, pinned: PinnedHostBuffer | None = None
) -> list[torch.Tensor]:
    """Each segment's input on the device (ids [1, S] int64, or the waveform padded to whole 30 s chunks, at
    most `audio_chunks`, through the `pinned` buffer: wave_on_device), all copied before any compute is queued: a
    copy from pageable host memory synchronises the stream, so one made after the audio encoder is queued would
    wait for it.
    A recording's window (Whisper) is its features [1, n_mels, 3000], from `window_mel(samples, window, frames)`
    (RecordingFeatures.window) after the copies; encoded audio is its embeddings, already on the device."""

    def on_device(s: Segment) -> torch.Tensor | None:
        if isinstance(s, TextSegment):
            return torch.tensor([s.ids], dtype=torch.int64).to(device)
        if isinstance(s, EncodedAudio):
            return s.embeds  # already there
        if s.window is not None:
            return None  # its features, after the copies
        return wave_on_device(s.samples, audio_chunks, device, pinned)

    copied = [on_device(s) for s in segments]
    if window_mel is None and any(x is None for x in copied):
        raise GenerationError(
            "a recording's window needs the recording's features: inputs_on_device(..., window_mel=...)"
        )
    return [window_mel(s.samples, s.window, s.frames) if x is None else x for s, x in zip(segments, copied)]
