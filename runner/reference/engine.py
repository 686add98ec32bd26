"""The eager PyTorch model behind the same Engine interface as the exported program: the method modules the
exporter compiles (runner/models/methods.py), run eagerly. `--reference eager` and the bench's eager peer."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runner.models.methods import Methods
from runner.runtime.engine import CrossAttended, Engine, admit_into_slot, extra_inputs


class EagerEngine(Engine):
    scores = True  # text_decoder gives every position's logits when asked

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
        batch: nn.Module | None = None,
        slots: list[tuple[torch.Tensor, torch.Tensor]] = (),
    ):
        """`batch`: the batched decoder (embeds [B, 1, H], positions [B] -> logits [B, V]) over its own slot
        caches; `slots` pairs each slot cache [N, ...] with the prefill's cache [1, ...] it is copied from."""
        super().__init__()  # the model's caches are this engine's own
        self.methods, self.device, self._reset = methods, device, reset
        self.max_seq_len, self.max_audio_chunks, self.encoder_dtype = max_seq_len, max_audio_chunks, encoder_dtype
        if cross_attention:
            self.cross = CrossAttended()
        self.aligns = methods.alignment is not None and cross_attention
        self.batch, self.slots = batch, list(slots)
        self.max_batch = slots[0][0].shape[0] if batch is not None else 1

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

    @torch.inference_mode()
    def score(self, embeds, pos):
        """The logits at every position of `embeds` [1, S, H] (decode gives the last one's): a forced answer
        scored in one call (runner/reference/score.py)."""
        return self.methods.text_decoder(embeds, pos, *extra_inputs(self.cross), every_position=True)

    def reset(self):
        self._reset()

    @torch.inference_mode()
    def align(self, ids):
        if not self.aligns:
            return super().align(ids)
        return self.methods.alignment(ids.to(self.device), *self.cross.inputs())

    @torch.inference_mode()
    def admit(self, slot: int, length: int) -> None:
        admit_into_slot(self.slots, slot, length)

    @torch.inference_mode()
    def decode_batch(self, tokens, pos):
        b = tokens.shape[0]
        return self.batch(self.embed(tokens.view(1, b)).view(b, 1, -1), pos)
