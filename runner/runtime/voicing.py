"""How much of a window is sound, and whether its text is implausibly short for it: a window of Voxtral's fixed
windows whose answer is a word or two over half a minute of speech lost what was said there, and its record and
stderr say so (Whisper's long form judges its windows itself: runner/families/whisper/longform.py)."""

from __future__ import annotations

import numpy as np

from runner.audio import SAMPLE_RATE

FRAME = SAMPLE_RATE * 30 // 1000  # 30 ms frames
SOUND_RMS = 0.01  # -40 dBFS: a frame louder than this counts as sound (speech is around -20; room noise -60)
MIN_SOUND_SECONDS = 5.0  # less sound than this is never judged: a short answer may be right
# Speech gives 2-4 tokens a second; an answer under a quarter of the slowest of that is a window lost. Tokens, not
# words: a language without spaces counts the same, and a random model's text of few spaces is not judged short.
MIN_TOKENS_PER_SOUND_SECOND = 0.5


def sound_seconds(samples: np.ndarray) -> float:
    """Seconds of 16 kHz `samples` in 30 ms frames louder than SOUND_RMS."""
    n = len(samples) // FRAME
    if n == 0:
        return 0.0
    frames = np.asarray(samples[: n * FRAME], dtype=np.float32).reshape(n, FRAME)
    loud = np.sqrt(np.mean(np.square(frames, dtype=np.float64), axis=1)) > SOUND_RMS
    return float(loud.sum()) * FRAME / SAMPLE_RATE


def implausibly_short(tokens: int, sound: float | None) -> bool:
    """Whether an answer of `tokens` tokens is too short for `sound` seconds of sound (None: not judged)."""
    return sound is not None and sound >= MIN_SOUND_SECONDS and tokens < MIN_TOKENS_PER_SOUND_SECOND * sound
