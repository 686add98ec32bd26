"""Word error rate against reference transcripts: (substitutions + deletions + insertions) / reference words.

Both sides are normalised first, as ASR evaluations do (Whisper's paper uses a larger English normaliser):
lower case, punctuation dropped (apostrophes inside words kept), hyphens split, and the number words zero to
ninety-nine written as digits, so "thirty" and "30" are the same word. Corpus WER sums the edits and the reference
words over all files; a file with an empty reference (silence) adds its insertions to the edits and nothing to the
words, so hallucinating on silence still costs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from runner.errors import RunnerError

_UNITS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
    "seventeen eighteen nineteen".split()  # fmt: skip
_TENS = {w: 10 * i for i, w in enumerate("_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()) if i >= 2}
_NUMBERS = {w: i for i, w in enumerate(_UNITS)} | _TENS


def normalize(text: str) -> list[str]:
    text = text.lower().replace("-", " ")
    text = re.sub(r"[^\w\s']", " ", text)  # punctuation -> space
    words = [w.strip("'") for w in text.split()]
    out: list[str] = []
    for w in filter(None, words):
        n = _NUMBERS.get(w)
        # "thirty five" -> 35: a unit right after a bare tens word joins it
        if n is not None and n < 10 and out and out[-1].isdigit() and int(out[-1]) in _TENS.values():
            out[-1] = str(int(out[-1]) + n)
        else:
            out.append(str(n) if n is not None else w)
    return out


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    """Levenshtein distance over words (one row at a time)."""
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


@dataclass(frozen=True)
class FileWER:
    name: str
    errors: int
    words: int
    reference: str
    hypothesis: str

    @property
    def wer(self) -> float | None:
        return self.errors / self.words if self.words else None

    def to_dict(self) -> dict:
        return {"errors": self.errors, "words": self.words, "wer": self.wer}


def score(name: str, reference: str, hypothesis: str) -> FileWER:
    ref, hyp = normalize(reference), normalize(hypothesis)
    return FileWER(name, edit_distance(ref, hyp), len(ref), reference, hypothesis)


def corpus_wer(files: list[FileWER]) -> float:
    words = sum(f.words for f in files)
    return sum(f.errors for f in files) / words if words else 0.0


def read_references(path: Path) -> dict[str, str]:
    """A JSON object {audio file name: reference transcript} (fixtures/audio/transcripts.json)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, or not UTF-8
        raise RunnerError(f"{path}: not a transcript file ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise RunnerError(f"{path}: expected a JSON object of file name -> transcript")
    return data


def table(files: list[FileWER]) -> list[str]:
    lines = [f"{'file':28s} {'errors':>6s} {'words':>6s} {'WER':>7s}"]
    for f in files:
        wer = f"{f.wer:7.1%}" if f.wer is not None else f"{'-':>7s}"
        lines.append(f"{f.name:28s} {f.errors:6d} {f.words:6d} {wer}")
    total = sum(f.errors for f in files), sum(f.words for f in files)
    lines.append(f"{'total':28s} {total[0]:6d} {total[1]:6d} {corpus_wer(files):7.1%}")
    return lines
