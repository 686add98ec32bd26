"""What every run-time family is: the protocol the app and the runtime program against, and the capabilities a
family declares so that callers check what it can do, never its name."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from runner.runtime.detokenize import Tokenizer
from runner.runtime.prompt import Prompt


@dataclass(frozen=True)
class Capabilities:
    """What a family can do, declared once by the family and checked by callers: never its name."""

    chat_prompts: bool = False  # `run --prompt TEXT`: a question about the audio, not only a transcription
    streaming: bool = False  # its methods are streaming steps: `stream` takes it, `run` and `bench` do not
    batching: bool = False  # a bundle can be exported with --max-batch > 1 (a batched decode step)
    timestamps: bool = False  # its decoder can emit timestamp tokens
    word_timestamps: bool = False  # `--word-timestamps`: each word's times (an engine's `align`)
    windows: bool = True  # audio longer than one prompt is transcribed in windows


class Family(Protocol):
    """A family at run time, made from a bundle by its class's `from_bundle(bundle_dir, model)`."""

    name: str
    capabilities: Capabilities
    cross_attention: bool  # the decoder attends to the encoder's output, which takes no decoder positions
    tokenizer: Tokenizer
    audio_id: int | None  # the id prompt_ids show at each audio position (None: cross-attended)

    def prompts(
        self, audio_path: str | os.PathLike, prompt: str | None, language: str | None, max_audio_chunks: int
    ) -> list[Prompt]: ...  # one or more prompt windows for one audio file
