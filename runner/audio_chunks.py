"""Audio fitted to what a bundle takes: whole 30 s chunks for one encoder input (zero-padded, refused past the
bundle's limit), and windows, each one prompt's worth, for audio longer than one prompt takes. How many chunks a
prompt's context is sized for (context_for) stays in runner/audio.py, beside the constants the export reads.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from runner.audio import CHUNK_LENGTH, N_SAMPLES, SAMPLE_RATE
from runner.errors import AudioError

if TYPE_CHECKING:  # numpy is imported where samples are handled, as in runner/audio.py
    import numpy as np


# ---------------------------------------------------------------- one encoder input: whole 30 s chunks


def num_chunks(num_samples: int) -> int:
    """How many 30 s chunks `num_samples` samples need (ceil); at least one, so empty input still has a chunk."""
    return max(1, math.ceil(num_samples / N_SAMPLES))


def checked_chunks(num_samples: int, max_chunks: int) -> int:
    """num_chunks(num_samples), refusing audio longer than the bundle was exported for."""
    n = num_chunks(num_samples)
    if n > max_chunks:
        raise AudioError(
            f"audio is {num_samples / SAMPLE_RATE:.1f} s long ({n} chunks of {CHUNK_LENGTH} s); "
            f"this bundle takes at most {max_chunks} chunks ({max_chunks * CHUNK_LENGTH} s)"
        )
    return n


def pad_to_chunks(wave: np.ndarray, max_chunks: int) -> np.ndarray:
    """Zero-pad `wave` to a whole number of chunks, refusing audio longer than the bundle was exported for."""
    import numpy as np

    n = checked_chunks(len(wave), max_chunks)
    out = np.zeros(n * N_SAMPLES, dtype=np.float32)
    out[: len(wave)] = wave
    return out


# ---------------------------------------------------------------- windows: audio longer than one prompt takes

CUT_FRAME = SAMPLE_RATE // 10  # 100 ms: the unit the quietest point is chosen in
CUT_SEARCH = 10 * SAMPLE_RATE  # how far before a window's limit its cut is looked for


def window_bounds(wave: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """[start, end) sample ranges, each at most `capacity` samples, that cover `wave` end to end: one range if it
    fits. Otherwise each window ends at the quietest point near its limit: the 100 ms frame of least energy
    (the latest of equals) among those in the last 10 s before the limit (the last third of the capacity, if
    that is shorter), cut at the frame's middle; the next window starts there. Only those 10 s are read."""
    import numpy as np

    n = len(wave)
    search = max(CUT_FRAME, min(CUT_SEARCH, capacity // 3) // CUT_FRAME * CUT_FRAME)
    bounds, start = [], 0
    while n - start > capacity:
        limit = start + capacity
        frames = wave[limit - search : limit].reshape(-1, CUT_FRAME)  # a view: frames ending at the limit
        energy = np.square(frames, dtype=np.float64).sum(axis=1)
        last_min = len(energy) - 1 - int(np.argmin(energy[::-1]))
        cut = limit - search + last_min * CUT_FRAME + CUT_FRAME // 2
        bounds.append((start, cut))
        start = cut
    bounds.append((start, n))
    return bounds


def audio_windows(wave: np.ndarray, max_chunks: int) -> list[np.ndarray]:
    """`wave` cut into windows of at most `max_chunks` chunks (window_bounds); views into it, never copies, so
    a long recording is held in memory once however many windows it takes."""
    return [wave[s:e] for s, e in window_bounds(wave, max_chunks * N_SAMPLES)]
