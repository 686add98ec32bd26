"""Model families at run time: what is particular to one family (its tokenizer, prompts and special tokens,
whether its decoder cross-attends to the audio, how long audio is windowed). The registry maps a manifest's
`family` to it; the runtime's engine and generation loop are shared. Adding a family: one folder here, one line
in FAMILIES, its model under runner/models/ and its export module under runner/export/."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from runner.errors import BundleError
from runner.families.voxtral import NAME as VOXTRAL
from runner.families.voxtral import VoxtralFamily
from runner.families.voxtral_realtime import NAME as VOXTRAL_REALTIME
from runner.families.voxtral_realtime import RealtimeFamily
from runner.families.whisper import NAME as WHISPER
from runner.families.whisper import WhisperFamily
from runner.runtime.detokenize import Tokenizer
from runner.runtime.generate import Prompt


class Family(Protocol):
    cross_attention: bool  # the decoder attends to the encoder's output, which takes no decoder positions
    tokenizer: Tokenizer
    audio_id: int | None  # the id prompt_ids show at each audio position (None: cross-attended)

    def prompts(
        self, audio_path: str | os.PathLike, prompt: str | None, language: str | None, max_audio_chunks: int
    ) -> list[Prompt]: ...  # one or more prompt windows for one audio file


FAMILIES: dict[str, type] = {VOXTRAL: VoxtralFamily, WHISPER: WhisperFamily, VOXTRAL_REALTIME: RealtimeFamily}


def family_for(bundle_dir: str | os.PathLike, model: dict) -> Family:
    """The family of a bundle's manifest `model` entry (bundles from before families say none: Voxtral)."""
    name = model.get("family", VOXTRAL)
    family = FAMILIES.get(name)
    if family is None:
        raise BundleError(f"{bundle_dir}: model family {name!r} is not one this runner knows")
    return family.from_bundle(Path(bundle_dir), model)
