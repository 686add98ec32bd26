"""Word timestamps as openai-whisper's `timing.py` (20250625) finds them: one forward of a window's text over its
cross-attention (the engine's `align`: the alignment heads' scores and each token's probability), the scores
softmaxed over the window's frames, normalised per frame, median-filtered and averaged over the heads; dynamic
time warping then matches each token to a stretch of frames, and a word's times are its tokens'. The same
heuristics follow: words at sentence ends and after pauses held to twice the median word length, punctuation
merged into its word, and each segment's bounds moved to its words'."""

from __future__ import annotations

import string
from dataclasses import dataclass, replace

import numpy as np
import torch

from runner.audio import HOP_LENGTH, SAMPLE_RATE
from runner.families.whisper.tokenizer import WhisperTokenizer
from runner.runtime.results import Segment, Word

TOKENS_PER_SECOND = SAMPLE_RATE // (2 * HOP_LENGTH)  # encoder positions per second: 50
MEDFILT_WIDTH = 7
PREPEND_PUNCTUATIONS = "\"'“¿([{-"  # merged into the word after them
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"  # merged into the word before them
SENTENCE_END_MARKS = ".。!！?？"


@dataclass
class WordTiming:
    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """A median filter of odd `width` along the last dimension of x [A, S, F], reflect-padded."""
    pad = width // 2
    if x.shape[-1] <= pad:  # reflect padding needs more frames than the pad
        return x
    x = torch.nn.functional.pad(x[None], (pad, pad, 0, 0), mode="reflect")[0]
    return x.unfold(-1, width, 1).sort()[0][..., pad]


def dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through the cost matrix x [N, M] (float64): (row indices, column indices)
    along it. openai-whisper's dtw_cpu, anti-diagonal by anti-diagonal (every cell of one depends only on the two
    before): the same float32 costs and the same tie-breaking, so the same path."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    cost[0, 0] = 0
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        t = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        cost[i, j] = x[i - 1, j - 1] + np.choose(t, [c0, c1, c2])
        trace[i, j] = t
    return backtrace(trace)


def backtrace(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    i, j = trace.shape[0] - 1, trace.shape[1] - 1
    trace[0, :], trace[:, 0] = 2, 1
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    rows, cols = np.array(path[::-1]).T
    return rows, cols


def split_to_word_tokens(tok: WhisperTokenizer, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    """openai-whisper's split_tokens_on_spaces: tokens grouped into whole characters, then into words (a word
    starts at a space, a punctuation mark or a control token)."""
    full = tok.decode(tokens, keep_special=True)
    subwords, groups, current, offset = [], [], [], 0
    for t in tokens:
        current.append(t)
        text = tok.decode(current, keep_special=True)
        if "\ufffd" not in text or full[offset + text.index("\ufffd")] == "\ufffd":  # a whole character
            subwords.append(text)
            groups.append(current)
            current, offset = [], offset + len(text)
    words, word_tokens = [], []
    for sub, ids in zip(subwords, groups):
        if ids[0] >= tok.eos_id or sub.startswith(" ") or sub.strip() in string.punctuation or not words:
            words.append(sub)
            word_tokens.append(ids)
        else:
            words[-1] += sub
            word_tokens[-1] += ids
    return words, word_tokens


def find_alignment(engine, tok: WhisperTokenizer, sot: tuple[int, ...], text: list[int], frames: int):
    """Each word of `text` (ids below eot) with its times in the window encoded last (seconds from its start) and
    its probability; `frames` is the window's length in mel frames."""
    if not text:
        return []
    no_timestamps, eot = tok.special_id("<|notimestamps|>"), tok.eos_id
    ids = torch.tensor([[*sot, no_timestamps, *text, eot]], dtype=torch.int64)
    scores, probs = engine.align(ids)
    probs = probs.float().cpu()[len(sot) + 1 : len(sot) + 1 + len(text)].tolist()
    weights = scores.float().cpu()[:, :, : frames // 2].softmax(dim=-1)  # [A, S, frames]
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = median_filter((weights - mean) / std, MEDFILT_WIDTH)
    matrix = weights.mean(dim=0)[len(sot) : -1]
    rows, cols = dtw(-matrix.double().numpy())
    words, word_tokens = split_to_word_tokens(tok, text + [eot])
    if len(word_tokens) <= 1:
        return []
    bounds = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(rows), (1, 0), constant_values=1).astype(bool)
    jump_times = cols[jumps] / TOKENS_PER_SECOND
    starts, ends = jump_times[bounds[:-1]], jump_times[bounds[1:]]
    word_probs = [float(np.mean(probs[i:j])) for i, j in zip(bounds[:-1], bounds[1:])]
    return [WordTiming(*w) for w in zip(words, word_tokens, starts, ends, word_probs)]


def merge_punctuations(alignment: list[WordTiming]) -> None:
    """Opening marks join the word after them, closing marks the word before (in place)."""
    i, j = len(alignment) - 2, len(alignment) - 1
    while i >= 0:
        previous, following = alignment[i], alignment[j]
        if previous.word.startswith(" ") and previous.word.strip() in PREPEND_PUNCTUATIONS:
            following.word, following.tokens = previous.word + following.word, previous.tokens + following.tokens
            previous.word, previous.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        previous, following = alignment[i], alignment[j]
        if not previous.word.endswith(" ") and following.word in APPEND_PUNCTUATIONS:
            previous.word, previous.tokens = previous.word + following.word, previous.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1


def add_word_timestamps(
    engine, tok: WhisperTokenizer, sot, segments: list[Segment], seek_seconds: float, frames: int, last_speech: float
) -> list[Segment]:
    """The window's segments with their words, each segment's bounds moved to its words' (openai-whisper's
    add_word_timestamps; `last_speech`: where speech last ended before this window)."""
    if not segments:
        return segments
    per_segment = [[t for t in s.tokens if t < tok.eos_id] for s in segments]
    alignment = find_alignment(engine, tok, sot, [t for ts in per_segment for t in ts], frames)
    durations = np.array([t.end - t.start for t in alignment])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    if len(durations):  # words at sentence boundaries no longer than twice the median
        for i in range(1, len(alignment)):
            if alignment[i].end - alignment[i].start > longest:
                if alignment[i].word in SENTENCE_END_MARKS:
                    alignment[i].end = alignment[i].start + longest
                elif alignment[i - 1].word in SENTENCE_END_MARKS:
                    alignment[i].start = alignment[i].end - longest
    merge_punctuations(alignment)
    out, k = [], 0
    for segment, text in zip(segments, per_segment):
        saved, words = 0, []
        while k < len(alignment) and saved < len(text):
            timing = alignment[k]
            if timing.word:
                start, end = round(seek_seconds + timing.start, 2), round(seek_seconds + timing.end, 2)
                words.append(Word(timing.word, start, end, timing.probability))
            saved += len(timing.tokens)
            k += 1
        segment = _fit(segment, words, median, last_speech)
        last_speech = segment.end if words else last_speech
        out.append(segment)
    return out


def _fit(segment: Segment, words: list[Word], median: float, last_speech: float) -> Segment:
    """openai-whisper's boundary heuristics: the first words after a pause held to twice the median length, and
    the segment's bounds taken from its words unless a word runs far past them."""
    if not words:
        return replace(segment, words=())
    longest = median * 2
    first, last = words[0], words[-1]
    after_pause = first.end - last_speech > median * 4
    if after_pause and (
        first.end - first.start > longest or (len(words) > 1 and words[1].end - first.start > longest * 2)
    ):
        if len(words) > 1 and words[1].end - words[1].start > longest:
            boundary = max(words[1].end / 2, words[1].end - longest)
            first = words[0] = replace(first, end=boundary)
            words[1] = replace(words[1], start=boundary)
        first = words[0] = replace(first, start=max(0, first.end - longest))
    start, end = segment.start, segment.end
    if start < first.end and start - 0.5 > first.start:  # the first word too long: the segment's start wins
        words[0] = replace(first, start=max(0, min(first.end - median, start)))
    else:
        start = first.start
    last = words[-1]
    if end > last.start and end + 0.5 < last.end:  # the last word too long: the segment's end wins
        words[-1] = replace(last, end=max(last.start + median, end))
    else:
        end = last.end
    return replace(segment, start=start, end=end, words=tuple(words))


def last_end(segments: list[Segment]) -> float | None:
    """openai-whisper's get_end: the last word's end, else the last segment's."""
    ends = [w.end for s in segments for w in (s.words or ())]
    return ends[-1] if ends else (segments[-1].end if segments else None)
