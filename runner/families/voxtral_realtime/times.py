"""Each streamed token's time, and the words and segments they make, exact by construction.

A stream's position p carries the audio of padded samples [p, p + 1) x samples_per_token (80 ms: the position's
8 mel frames), and the model says at position p what it heard `num_delay_tokens` positions earlier. So the token
decided at position p is the audio of position p - num_delay_tokens, which is stream time
(p - n_left_pad_tokens - num_delay_tokens) x 80 ms, for 80 ms: no alignment model, nothing estimated.

Words are runs of text tokens, a new one starting at a token that begins with whitespace (Tekken's byte-level BPE
keeps the space on the word's first token, as openai-whisper's words keep it); the [STREAMING_PAD] tokens the model
says between a word's pieces do not split it. A word spans its first token's start to its last token's end.
Segments are the words up to a sentence's end or up to a pause, in openai-whisper's record shape
(runner/runtime/results.py's Segment, with its `words`)."""

from __future__ import annotations

from dataclasses import dataclass

from runner.audio import SAMPLE_RATE
from runner.families.voxtral_realtime.session import StreamSpec
from runner.runtime.detokenize import Tokenizer
from runner.runtime.results import Segment

SENTENCE_ENDS = (".", "!", "?", "…", "。", "！", "？")
PAUSE_S = 1.0  # a silence this long between two words starts a new segment (a subtitle's natural break)


@dataclass(frozen=True)
class Word:
    """One word: its text (with its leading space), its times, and the indices of its tokens in the stream's."""

    word: str
    start: float
    end: float
    tokens: tuple[int, ...]  # indices into the stream's tokens

    def to_dict(self) -> dict:
        # the stream's step gives the greedy token only, not its probability
        return {"word": self.word, "start": self.start, "end": self.end, "probability": None}


def token_times(spec: StreamSpec, positions: list[int]) -> list[tuple[float, float]]:
    """(start, end) in seconds from the start of the stream for the token decided at each position."""
    spt = spec.samples_per_token
    first = spec.n_left_pad_tokens + spec.num_delay_tokens  # the position whose token is the audio at 0
    return [(_seconds((p - first) * spt), _seconds((p - first + 1) * spt)) for p in positions]


def _seconds(samples: int) -> float:
    # A whole number of 10 ms hops: three decimals hold it exactly (round(t * SAMPLE_RATE) gives the samples back).
    return round(samples / SAMPLE_RATE, 3)


def _is_text(tok: Tokenizer, token: int) -> bool:
    return token < tok.vocab_size and not tok.is_special(token)


def words_of(tok: Tokenizer, tokens: list[int], times: list[tuple[float, float]]) -> list[Word]:
    """The stream's words, in order, each from its tokens' times."""
    runs: list[list[int]] = []
    for i, t in enumerate(tokens):
        if not _is_text(tok, t):
            continue
        if not runs or tok.token_bytes(t)[:1].isspace():
            runs.append([])
        runs[-1].append(i)
    out = []
    for run in runs:
        text = tok.decode([tokens[i] for i in run])
        out.append(Word(text, times[run[0]][0], times[run[-1]][1], tuple(run)))
    return out


def segments_of(tok: Tokenizer, tokens: list[int], times: list[tuple[float, float]]) -> list[dict]:
    """The stream's segments as records (Segment.to_dict() with their `words`), cut after a sentence's last word
    and before a word that follows a pause of PAUSE_S or more."""
    groups: list[list[Word]] = []
    for w in words_of(tok, tokens, times):
        if (
            not groups
            or groups[-1][-1].word.rstrip().endswith(SENTENCE_ENDS)
            or w.start - groups[-1][-1].end >= PAUSE_S
        ):
            groups.append([])
        groups[-1].append(w)
    records = []
    for ws in groups:
        ids = tuple(tokens[i] for w in ws for i in w.tokens)
        # greedy decoding: temperature 0; the step gives no log-probabilities or no-speech probability
        seg = Segment(ws[0].start, ws[-1].end, "".join(w.word for w in ws), ids, temperature=0.0)
        records.append({**seg.to_dict(), "words": [w.to_dict() for w in ws]})
    return records
