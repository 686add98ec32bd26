"""The Voxtral family at run time: Tekken, mistral-common's transcription prompt and the seed's chat prompt.
The audio embeddings are decoder positions (`[AUDIO]` in prompt_ids); one prompt takes audio up to the bundle's
exported chunk count (its capacity). Longer audio is transcribed in windows, each its own prompt, cut at the
quietest point near each limit (runner/audio_chunks.py's window_bounds); a chat prompt needs all of its audio in one
prompt, so for longer audio it is an error that names the export flags which take it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from runner.audio import CHUNK_LENGTH, SAMPLE_RATE, context_for, load_audio
from runner.audio_chunks import audio_windows, num_chunks
from runner.errors import AudioError, GenerationError
from runner.families.base import Capabilities
from runner.families.voxtral.tokenizer import Tekken
from runner.runtime.prompt import AudioSegment, Prompt, TextSegment

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

__all__ = [
    "LANGUAGES",
    "NAME",
    "SPECIAL_TOKENS",
    "Tekken",
    "VoxtralFamily",
    "chat_prompt",
    "transcription_prompt",
    "transcription_windows",
]


def transcription_prompt(tok: Tekken, audio: np.ndarray, language: str | None) -> Prompt:
    """mistral-common's transcription request: <s>[INST][BEGIN_AUDIO][AUDIO]…[/INST]lang:xx[TRANSCRIBE]."""
    if language is not None and language not in LANGUAGES:
        raise GenerationError(f"unknown language {language!r}; choose from {', '.join(LANGUAGES)}")
    s = tok.special_id
    tail = [s("[/INST]")] + (tok.encode(f"lang:{language}") if language else []) + [s("[TRANSCRIBE]")]
    audio_segment = AudioSegment(audio, transcribed=True)
    return [TextSegment((tok.bos_id, s("[INST]"), s("[BEGIN_AUDIO]"))), audio_segment, TextSegment(tuple(tail))]


def transcription_windows(tok: Tekken, samples: np.ndarray, language: str | None, max_chunks: int) -> list[Prompt]:
    """One transcription prompt per window of at most `max_chunks` chunks: the whole audio when it fits. Each
    window's samples are a view into `samples`."""
    return [transcription_prompt(tok, w, language) for w in audio_windows(samples, max_chunks)]


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
    name = NAME
    capabilities = Capabilities(chat_prompts=True, batching=True)
    cross_attention = False

    def __init__(self, tokenizer: Tekken):
        self.tokenizer, self.audio_id = tokenizer, tokenizer.special_id(AUDIO_TOKEN)

    @classmethod
    def from_bundle(cls, bundle_dir: Path, model: dict) -> VoxtralFamily:
        return cls(Tekken.from_file(Path(bundle_dir) / model["tokenizer"]))

    def prompts(
        self, audio_path: str | os.PathLike, prompt: str | None, language: str | None, max_audio_chunks: int
    ) -> list[Prompt]:
        samples = load_audio(audio_path)  # the one decode of the file: windows are views into it
        if not prompt:
            return transcription_windows(self.tokenizer, samples, language, max_audio_chunks)
        n = num_chunks(len(samples))
        if n > max_audio_chunks:
            raise AudioError(
                f"{audio_path}: audio is {len(samples) / SAMPLE_RATE:.1f} s long ({n} chunks of {CHUNK_LENGTH} s) and "
                f"a --prompt needs all of it in one prompt; this bundle takes at most "
                f"{max_audio_chunks * CHUNK_LENGTH} s (exported with --max-audio-chunks {max_audio_chunks}): export "
                f"with --max-audio-chunks {n} (--max-seq-len {context_for(n)}, its default), or transcribe it without "
                "--prompt (longer audio is transcribed in windows)"
            )
        return [chat_prompt(self.tokenizer, samples, prompt)]
