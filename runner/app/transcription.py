"""The library's results (runner/app/api.py): a Transcription of an input or a stream, and a stream's Delta."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.runtime.results import Segment

__all__ = ["Delta", "Transcription"]


@dataclass(frozen=True)
class Transcription:
    """One input's transcript: its text, timed segments, tokens and stats; `source` is its path (None for bytes
    or an array) and `index` its place among the inputs given (0 for one). A stream's also has each token's
    [start, end] in seconds (`token_times`, as `stream --json` records them; None for a whole input)."""

    text: str
    segments: tuple[Segment, ...]
    language: str | None
    tokens: tuple[int, ...]
    stats: dict = field(repr=False)
    source: str | None = None
    index: int = 0
    token_times: tuple[tuple[float, float], ...] | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = {
            "source": self.source,
            "index": self.index,
            "text": self.text,
            "language": self.language,
            "tokens": list(self.tokens),
            "segments": [s.to_dict() for s in self.segments],
            "stats": dict(self.stats),
        }
        if self.token_times is not None:
            d["token_times"] = [list(t) for t in self.token_times]
        return d


@dataclass(frozen=True)
class Delta:
    """Text a stream decided, with the stream time (seconds from its start) of the audio it was heard in."""

    text: str
    start: float
    end: float
