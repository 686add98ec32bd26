"""The Whisper family at run time. The audio is not part of the decoder's sequence: `audio_encoder` turns one
30 s window into the cross-attention K/V of every decoder layer, which the engine passes to every decoder call
(`cross_attention`). Long audio is transcribed window by window: each window is its own prompt (reset the KV
cache, encode, `<|startoftranscript|>[<|lang|><|transcribe|>]<|notimestamps|>`, decode to `<|endoftext|>`), and
the runtime joins their text."""

from __future__ import annotations

import os
from pathlib import Path

from runner.audio import N_SAMPLES, load_audio
from runner.errors import GenerationError
from runner.families.whisper.tokenizer import TOKENIZER_TYPE, WhisperTokenizer
from runner.runtime.generate import AudioSegment, Prompt, TextSegment

NAME = "whisper"
# The control tokens a bundle's manifest lists (ids looked up by name in tokenizer.json at export).
SPECIAL_TOKENS = {
    "eot": "<|endoftext|>",
    "sot": "<|startoftranscript|>",
    "transcribe": "<|transcribe|>",
    "translate": "<|translate|>",
    "startofprev": "<|startofprev|>",
    "nocaptions": "<|nocaptions|>",
    "notimestamps": "<|notimestamps|>",
}

__all__ = ["NAME", "SPECIAL_TOKENS", "TOKENIZER_TYPE", "WhisperFamily", "WhisperTokenizer", "whisper_prompt", "windows"]


def whisper_prompt(tok: WhisperTokenizer, multilingual: bool, language: str | None) -> tuple[int, ...]:
    """<|startoftranscript|> [<|xx|><|transcribe|>] <|notimestamps|>; English-only models take no language."""
    if not multilingual:
        if language not in (None, "en"):
            raise GenerationError(f"this Whisper model is English-only; --language {language} is not available")
        return tok.special_id("<|startoftranscript|>"), tok.special_id("<|notimestamps|>")
    return (
        tok.special_id("<|startoftranscript|>"),
        tok.special_id(f"<|{language or 'en'}|>"),
        tok.special_id("<|transcribe|>"),
        tok.special_id("<|notimestamps|>"),
    )


def windows(samples, ids: tuple[int, ...]) -> list[Prompt]:
    """One prompt per 30 s of audio: the window's samples, then the text prompt (silence: one window)."""
    starts = range(0, max(len(samples), 1), N_SAMPLES)
    return [[AudioSegment(samples[s : s + N_SAMPLES]), TextSegment(ids)] for s in starts]


class WhisperFamily:
    cross_attention = True
    audio_id = None  # cross-attended: the audio takes no decoder positions

    def __init__(self, tokenizer: WhisperTokenizer, multilingual: bool = False):
        self.tokenizer, self.multilingual = tokenizer, multilingual

    @classmethod
    def from_bundle(cls, bundle_dir: Path, model: dict) -> WhisperFamily:
        vocab = model["config"]["text"]["vocab_size"]
        return cls(WhisperTokenizer(Path(bundle_dir) / model["tokenizer"], vocab), bool(model.get("multilingual")))

    def prompts(
        self, audio_path: str | os.PathLike, prompt: str | None, language: str | None, max_audio_chunks: int
    ) -> list[Prompt]:
        if prompt:
            raise GenerationError("a Whisper bundle transcribes only; --prompt is not supported")
        return windows(load_audio(audio_path), whisper_prompt(self.tokenizer, self.multilingual, language))
