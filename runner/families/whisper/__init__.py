"""The Whisper family at run time. The audio is not part of the decoder's sequence: `audio_encoder` turns one
30 s window into the cross-attention K/V of every decoder layer, which the engine passes to every decoder call
(`cross_attention`). Long audio is transcribed window by window: each window is its own prompt (reset the KV
cache, encode, `<|startoftranscript|>[<|lang|><|transcribe|>]<|notimestamps|>`, decode to `<|endoftext|>`), and
the runtime joins their text. The features are openai/whisper's `transcribe`'s: ONE log-mel over the whole
recording (and 30 s of zeros), each window its 3000 frames (runner/runtime/features.py); the bundle's
preprocessor takes the whole recording in one call, up to its manifest's `max_recording_chunks`."""

from __future__ import annotations

import os
from pathlib import Path

from runner.audio import CHUNK_LENGTH, SAMPLE_RATE, load_audio
from runner.errors import AudioError, BundleError, GenerationError
from runner.families.base import Capabilities
from runner.families.whisper.longform import LongForm
from runner.families.whisper.tokenizer import TOKENIZER_TYPE, WhisperTokenizer
from runner.runtime.features import recording_chunks, window_count
from runner.runtime.prompt import AudioSegment, Prompt, TextSegment

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


def sot_sequence(tok: WhisperTokenizer, multilingual: bool, language: str | None) -> tuple[int, ...]:
    """The long form's prompt: whisper_prompt without <|notimestamps|> (timestamp tokens on)."""
    return whisper_prompt(tok, multilingual, language)[:-1]


def windows(samples, ids: tuple[int, ...]) -> list[Prompt]:
    """One prompt per 30 s window of the recording, as openai/whisper walks it without timestamps: window i
    (its features cut from the whole recording's), then the text prompt. At least one window."""
    return [
        [AudioSegment(samples, window=i, transcribed=True), TextSegment(ids)] for i in range(window_count(len(samples)))
    ]


class WhisperFamily:
    name = NAME
    capabilities = Capabilities(timestamps=True, word_timestamps=True)
    cross_attention = True
    audio_id = None  # cross-attended: the audio takes no decoder positions

    def __init__(
        self,
        tokenizer: WhisperTokenizer,
        multilingual: bool = False,
        max_recording_chunks: int | None = None,
        long_form: bool = True,
    ):
        self.tokenizer, self.multilingual = tokenizer, multilingual
        self.max_recording_chunks = max_recording_chunks  # the preprocessor's bound; None: no bound (eager)
        # True: openai-whisper's `transcribe` (timestamps, seek, fallback); False: fixed 30 s windows without
        # timestamps, each decoded once (what the checks of one window's tokens compare)
        self.long_form = long_form

    @classmethod
    def from_bundle(cls, bundle_dir: Path, model: dict) -> WhisperFamily:
        if "max_recording_chunks" not in model:  # its preprocessor's bound, which every Whisper export records
            raise BundleError(f"{bundle_dir}: model.max_recording_chunks is missing from the manifest")
        vocab = model["config"]["text"]["vocab_size"]
        tok = WhisperTokenizer(Path(bundle_dir) / model["tokenizer"], vocab)
        return cls(tok, bool(model.get("multilingual")), int(model["max_recording_chunks"]))

    def prompts(
        self, audio_path: str | os.PathLike, prompt: str | None, language: str | None, max_audio_chunks: int
    ) -> list[Prompt] | LongForm:
        if prompt:
            raise GenerationError("a Whisper bundle transcribes only; --prompt is not supported")
        samples = load_audio(audio_path)
        bound = self.max_recording_chunks
        if bound is not None and recording_chunks(len(samples)) > bound:
            raise AudioError(
                f"{audio_path}: audio is {len(samples) / SAMPLE_RATE:.1f} s long; this bundle's preprocessor takes "
                f"recordings up to {(bound - 1) * CHUNK_LENGTH} s"
            )
        if self.long_form:
            return LongForm(samples, sot_sequence(self.tokenizer, self.multilingual, language), self.tokenizer)
        return windows(samples, whisper_prompt(self.tokenizer, self.multilingual, language))
