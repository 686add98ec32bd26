"""The four methods of a bundle as nn.Modules over one model (they share its parameters and KV cache): what the
exporter compiles, and what the eager reference runs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class Methods:
    preprocessor: nn.Module  # waveform [k*480000] f32 -> mel [k, n_mels, 3000] f32
    audio_encoder: nn.Module  # mel -> audio embeddings [1, k*375, H] (Voxtral) or cross-attention K/V (Whisper)
    token_embedding: nn.Module  # ids [1, S] -> [1, S, H]
    text_decoder: nn.Module  # embeds [1, S, H], cache_position [S] (, cross K/V) -> logits [1, V] f32
    alignment: nn.Module | None = None  # ids [1, S], cross K/V -> word-timing scores and probabilities (Whisper)
