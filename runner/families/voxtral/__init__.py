"""The Voxtral family at run time: Tekken, mistral-common's transcription prompt and the seed's chat prompt.
The audio embeddings are decoder positions (`[AUDIO]` in prompt_ids); one prompt takes audio up to the bundle's
exported chunk count."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from runner.audio import CHUNK_LENGTH, SAMPLE_RATE, load_audio, num_chunks
from runner.errors import AudioError, GenerationError
from runner.families.voxtral.tokenizer import Tekken
from runner.runtime.generate import AudioSegment, Prompt, TextSegment

NAME = "voxtral"
# Languages Voxtral transcribes (mistral-common's `lang:xx` prefix).
LANGUAGES = ("en", "es", "fr", "pt", "hi", "de", "nl", "it")
AUDIO_TOKEN = "[AUDIO]"
# The control tokens a bundle's manifest lists (ids looked up by name in tekken.json at export).
SPECIAL_TOKENS = {
    "bos": "<s>",
    "eos": "</s>",
    "inst": "[INST]",
    "inst_end": "[/INST]",
    "audio": AUDIO_TOKEN,
    "begin_audio": "[BEGIN_AUDIO]",
    "transcribe": "[TRANSCRIBE]",
}

__all__ = ["LANGUAGES", "NAME", "SPECIAL_TOKENS", "Tekken", "VoxtralFamily", "chat_prompt", "transcription_prompt"]


def transcription_prompt(tok: Tekken, audio: np.ndarray, language: str | None) -> Prompt:
    """mistral-common's transcription request: <s>[INST][BEGIN_AUDIO][AUDIO]…[/INST]lang:xx[TRANSCRIBE]."""
    if language is not None and language not in LANGUAGES:
        raise GenerationError(f"unknown language {language!r}; choose from {', '.join(LANGUAGES)}")
    s = tok.special_id
    tail = [s("[/INST]")] + (tok.encode(f"lang:{language}") if language else []) + [s("[TRANSCRIBE]")]
    return [TextSegment((tok.bos_id, s("[INST]"), s("[BEGIN_AUDIO]"))), AudioSegment(audio), TextSegment(tuple(tail))]


def chat_prompt(tok: Tekken, audio: np.ndarray, prompt: str) -> Prompt:
    """The seed's runner: <s>[INST][BEGIN_AUDIO] + audio + {prompt}[/INST]. The prompt is plain text: a
    "[INST]" typed by a user stays text, never a control token."""
    s = tok.special_id
    return [
        TextSegment((tok.bos_id, s("[INST]"), s("[BEGIN_AUDIO]"))),
        AudioSegment(audio),
        TextSegment(tuple(tok.encode(prompt)) + (s("[/INST]"),)),
    ]


class VoxtralFamily:
    cross_attention = False

    def __init__(self, tokenizer: Tekken):
        self.tokenizer, self.audio_id = tokenizer, tokenizer.special_id(AUDIO_TOKEN)

    @classmethod
    def from_bundle(cls, bundle_dir: Path, model: dict) -> VoxtralFamily:
        return cls(Tekken.from_file(Path(bundle_dir) / model["tokenizer"]))

    def prompts(
        self, audio_path: str | os.PathLike, prompt: str | None, language: str | None, max_audio_chunks: int
    ) -> list[Prompt]:
        samples = load_audio(audio_path)
        n = num_chunks(len(samples))
        if n > max_audio_chunks:  # pad_to_chunks says so too, later, but without the file's name
            raise AudioError(
                f"{audio_path}: audio is {len(samples) / SAMPLE_RATE:.1f} s long ({n} chunks of {CHUNK_LENGTH} s); "
                f"this bundle takes at most {max_audio_chunks} chunks ({max_audio_chunks * CHUNK_LENGTH} s)"
            )
        tok = self.tokenizer
        return [chat_prompt(tok, samples, prompt) if prompt else transcription_prompt(tok, samples, language)]
