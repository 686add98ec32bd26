"""The eager PyTorch model behind the same Engine interface as the exported program: the method modules the
exporter compiles (runner/models/methods.py), run eagerly. `--reference eager` and the bench's eager peer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from runner.models.methods import Methods
from runner.runtime.engine import CrossAttended, decode_token, extra_inputs


class EagerEngine:
    def __init__(
        self,
        methods: Methods,
        *,
        device: str,
        max_seq_len: int,
        max_audio_chunks: int,
        encoder_dtype: torch.dtype,
        reset: Callable[[], None],
        cross_attention: bool = False,
    ):
        self.methods, self.device, self._reset = methods, device, reset
        self.max_seq_len, self.max_audio_chunks, self.encoder_dtype = max_seq_len, max_audio_chunks, encoder_dtype
        self.cross = CrossAttended() if cross_attention else None

    @torch.inference_mode()
    def preprocess(self, wave):
        return self.methods.preprocessor(wave)

    @torch.inference_mode()
    def encode(self, mel):
        out = self.methods.audio_encoder(mel)
        return self.cross.keep(out) if self.cross is not None else out

    @torch.inference_mode()
    def embed(self, ids):
        return self.methods.token_embedding(ids)

    @torch.inference_mode()
    def decode(self, embeds, pos):
        return self.methods.text_decoder(embeds, pos, *extra_inputs(self.cross))

    def reset(self):
        self._reset()

    def decode_token(self, token, pos):
        return decode_token(self, token, pos)

    def run_prefill(self, compute, inputs):
        return compute(self, *inputs)
