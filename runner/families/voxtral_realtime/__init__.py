"""The Voxtral Realtime family at run time: streams over three step methods, batched.

Audio arrives in blocks of any size; every 80 ms of it (1280 samples, plus 40 of look-ahead for the STFT) is one
text position: `preprocessor` (1520 samples -> 8 mel frames), `encoder_step` (-> that position's audio
embedding), `decoder_step` (previous token + audio embedding + the delay's time conditioning -> logits). Each
method takes a batch of streams, each at its own position, stream i in state row i (session.py); the methods' K/V
caches are ring buffers, so a stream of any length runs in bounded memory.
"""

from __future__ import annotations

import os
from pathlib import Path

from runner.errors import GenerationError
from runner.families.base import Capabilities
from runner.families.voxtral.tokenizer import Tekken
from runner.families.voxtral_realtime.session import (
    Steps,
    StepTimes,
    Stream,
    StreamBatch,
    StreamSession,
    StreamSpec,
    blocks_of,
    run_fed,
    run_together,
    run_whole,
)
from runner.families.voxtral_realtime.steps import METHODS, GraphSteps, ProgramSteps, program_steps
from runner.runtime.detokenize import StreamDecoder

NAME = "voxtral-realtime"
SPECIAL_TOKENS = {"bos": "<s>", "eos": "</s>", "streaming_pad": "[STREAMING_PAD]"}

__all__ = [
    "METHODS",
    "NAME",
    "SPECIAL_TOKENS",
    "GraphSteps",
    "ProgramSteps",
    "RealtimeFamily",
    "StepTimes",
    "Steps",
    "Stream",
    "StreamBatch",
    "StreamSession",
    "StreamSpec",
    "blocks_of",
    "program_steps",
    "run_fed",
    "run_together",
    "run_whole",
]


class RealtimeFamily:
    name = NAME
    capabilities = Capabilities(streaming=True, windows=False)
    cross_attention = False
    audio_id = None

    def __init__(self, tokenizer: Tekken, spec: StreamSpec):
        self.tokenizer, self.spec = tokenizer, spec

    @classmethod
    def from_bundle(cls, bundle_dir: Path, model: dict) -> RealtimeFamily:
        return cls(Tekken.from_file(Path(bundle_dir) / model["tokenizer"]), StreamSpec.from_model(model))

    def decoder(self) -> StreamDecoder:
        return StreamDecoder(self.tokenizer)

    def prompts(self, audio_path: str | os.PathLike, prompt, language, max_audio_chunks):
        raise GenerationError(f"{audio_path}: a {NAME} bundle transcribes streams: use `python -m runner stream`")
