"""What a generation gives back: one prompt window's result, and a file's windows joined into one result (texts,
tokens, stats), the same whether the windows ran one after another (MultimodalRunner.generate_windows) or in a
batch beside other files' (runner/runtime/batch.py)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from runner.runtime.detokenize import Tokenizer
from runner.runtime.voicing import implausibly_short
from runner.stats import Stats, now_ms


def compression_ratio(text: str) -> float:
    """openai-whisper's: the text's bytes over their zlib-compressed size (repetitive text compresses well; empty
    text: 0). What the long form's fallback judges a window by, and verbose_json reports per segment."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data))


@dataclass(frozen=True)
class Word:
    """A word of a segment with its times (seconds from the start of the file) and probability, as
    openai-whisper's `word_timestamps` gives them."""

    word: str
    start: float
    end: float
    probability: float

    def to_dict(self) -> dict:
        return {"word": self.word, "start": self.start, "end": self.end, "probability": self.probability}


@dataclass(frozen=True)
class Segment:
    """A stretch of a file's transcript with its times (seconds from the start of the file), as openai-whisper's
    `transcribe` gives them: from timestamp tokens where the family has them, else the window's bounds."""

    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    avg_logprob: float | None = None
    no_speech_prob: float | None = None
    temperature: float | None = None
    words: tuple[Word, ...] | None = None  # with --word-timestamps; None: not asked for

    def to_dict(self) -> dict:
        d = {
            "start": self.start,
            "end": self.end,
            "text": self.text,
            "tokens": list(self.tokens),
            "avg_logprob": self.avg_logprob,
            "no_speech_prob": self.no_speech_prob,
            "temperature": self.temperature,
        }
        if self.words is not None:
            d["words"] = [w.to_dict() for w in self.words]
        return d


@dataclass(frozen=True)
class WindowResult:
    """One prompt window of a result: its own text, token count, stop reason and stats, and what its decoding
    went through where the family judges its output (Whisper's long form): the temperature its kept decode used,
    the fallbacks taken to get there (each a decode at a higher temperature after one judged implausible), and
    whether it was judged silent (its decode dropped: no speech, and too unlikely to trust)."""

    text: str
    tokens: int
    stop_reason: str
    stats: Stats
    temperature: float | None = None  # None: decoded once at the run's temperature, nothing judged
    fallbacks: int = 0
    silent: bool = False
    # a fixed window's seconds of sound (runner/runtime/voicing.py), where its audio was measured; and whether its
    # answer is implausibly short for them
    sound_seconds: float | None = None
    short: bool = False

    def outcome(self) -> dict:
        """What happened to this window, for its record (empty where nothing was judged)."""
        judged = {}
        if self.sound_seconds is not None:
            judged = {"sound_s": round(self.sound_seconds, 2), "implausibly_short": self.short}
        if self.temperature is None:
            return judged
        return {"temperature": self.temperature, "fallbacks": self.fallbacks, "silent": self.silent, **judged}


@dataclass(frozen=True)
class GenerationResult:
    text: str
    prompt_ids: list[int]
    tokens: list[int]
    stop_reason: str  # "eos" | "max_new_tokens" | "context"
    stats: Stats
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # per generated token, when recorded
    windows: tuple[int, ...] = ()  # tokens generated in each prompt window, in order (their sum: len(tokens))
    parts: tuple[WindowResult, ...] = ()  # each prompt window's own text, tokens, stop reason and stats
    # the transcript's stretches with their times (from timestamp tokens); () where the family has none
    segments: tuple[Segment, ...] = ()
    # the prompts the windows were decoded from, where they were decided while decoding (Whisper's seek): what
    # teacher forcing replays instead of the job's windows; () where the job's windows are the prompts
    prompts: tuple[list, ...] = ()

    def window_tokens(self) -> list[list[int]]:
        """`tokens` cut back into windows: what teacher forcing replays, window by window."""
        out, start = [], 0
        for n in self.windows or (len(self.tokens),):
            out.append(list(self.tokens[start : start + n]))
            start += n
        return out


def window_result(
    tok: Tokenizer, prompt_ids: list[int], tokens: list[int], stop: str, stats: Stats, logits, device: str
) -> GenerationResult:
    """One prompt window's result once its last token is in: the end time, the counts, the text (EOS and
    tokens past the tokenizer's vocabulary left out)."""
    stats.inference_end_ms = now_ms()
    stats.generated_tokens = len(tokens)
    stats.finish_memory(device)
    text = tok.decode([t for t in tokens if t < tok.vocab_size and t != tok.eos_id])
    return GenerationResult(text, prompt_ids, tokens, stop, stats, logits)


def join_results(
    results: list[GenerationResult], stats: Stats, device: str, sound: list[float | None] | None = None
) -> GenerationResult:
    """A file's windows, in order, as one result: texts joined (join_texts), tokens and prompt ids concatenated,
    the stats summed into `stats` (the first token's time is the first window's), `windows` giving each one's
    token count and `parts` each one's own text and stats; with each window's seconds of sound (`sound`), whether
    its answer is implausibly short for them."""
    vars(stats).update(vars(results[0].stats))
    for r in results[1:]:
        merge_stats(stats, r.stats)
    sound = sound or [None] * len(results)
    parts = tuple(
        WindowResult(
            r.text, len(r.tokens), r.stop_reason, r.stats, sound_seconds=s, short=implausibly_short(len(r.tokens), s)
        )
        for r, s in zip(results, sound, strict=True)
    )
    if len(results) == 1:
        return replace(results[0], stats=stats, windows=(len(results[0].tokens),), parts=parts)
    stats.finish_memory(device)
    reasons = [r.stop_reason for r in results if r.stop_reason != "eos"]
    return GenerationResult(
        text=join_texts(r.text for r in results),
        prompt_ids=[i for r in results for i in r.prompt_ids],
        tokens=[t for r in results for t in r.tokens],
        stop_reason=reasons[-1] if reasons else "eos",
        stats=stats,
        logits=[x for r in results for x in r.logits],
        windows=tuple(len(r.tokens) for r in results),
        parts=parts,
    )


def merge_stats(total: Stats, s: Stats) -> None:
    """Adds window `s` to `total`: counts and durations summed, the end time the latest window's."""
    total.prompt_eval_total_ms = total.prompt_eval_ms + s.prompt_eval_ms
    total.generation_total_ms = total.generation_ms + s.generation_ms
    total.decode_total_ms = total.decode_ms + s.decode_ms
    total.windows += s.windows
    total.prompt_tokens += s.prompt_tokens
    total.generated_tokens += s.generated_tokens
    total.aggregate_sampling_time_ms += s.aggregate_sampling_time_ms
    total.audio_seconds += s.audio_seconds
    total.inference_end_ms = s.inference_end_ms


def join_texts(texts) -> str:
    """Windows' texts as one, as `TextJoiner` streams them."""
    out: list[str] = []
    joiner = TextJoiner(out.append)
    for text in texts:
        joiner.next_window()
        joiner(text)
    return "".join(out)


class TextJoiner:
    """Streams the texts of consecutive windows as one text: a space before a window's first text where the text
    so far ends in none and it begins with none (a cut at a pause falls between two words)."""

    def __init__(self, out: Callable[[str], None] | None):
        self.out, self.tail, self.pending = out, "", False

    def next_window(self) -> None:
        self.pending = bool(self.tail) and not self.tail[-1].isspace()

    def __call__(self, text: str) -> None:
        if not text:
            return
        if self.pending and not text[0].isspace():
            text = " " + text
        self.pending, self.tail = False, text
        self.out(text)
