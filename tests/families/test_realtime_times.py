"""Voxtral Realtime's token times, exact by construction (runner/families/voxtral_realtime/times.py).

A synthetic stream: silence with a click at known samples, through a model that, like the real one, says what it
heard `num_delay_tokens` positions later: at each click the next word of a script, one token per position. Each
word's time must hold its click's sample exactly (start at the click's 80 ms, one position per token), however the
stream is fed and beside other streams in one batch; words and segments come out as the script says them."""

from __future__ import annotations

import argparse
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import FIXTURES

from runner.app.stream import _stream_sources
from runner.app.streams import stream_many
from runner.audio import N_FFT
from runner.errors import AudioError
from runner.families.voxtral.tokenizer import Tekken
from runner.families.voxtral_realtime import RealtimeFamily, Steps, Stream, StreamBatch, StreamSpec, blocks_of, run_fed
from runner.families.voxtral_realtime.times import segments_of, token_times, words_of

TOK = Tekken.from_file(FIXTURES / "tekken.json")
PAD = 32  # a control token of the fixture tokenizer, as [STREAMING_PAD] is of the real one
SPEC = StreamSpec(8, n_left_pad_tokens=2, n_right_pad_tokens=7, num_delay_tokens=3, bos_id=1, eos_id=2, pad_id=PAD)
SPT = SPEC.samples_per_token  # 1280 samples: 80 ms

# (click sample, word): clicks at a position's first and last sample, others anywhere; a sentence's end after
# " world." and a pause of over a second before " news": a new segment after each.
SCRIPT = [(3 * SPT, " Hello"), (12 * SPT - 1, " world."), (30_500, " it's"), (40_000, " good"), (70_000, " news")]


class ClickSteps(Steps):
    """Hears a click (a sample above 0.5) in its position's 80 ms (the window's samples 200 .. 1480: the padded
    audio of position p is [p, p + 1) x 1280, after the STFT's 200 samples of centre padding), and says the next
    script word's tokens from `num_delay_tokens` positions later, one per position; [STREAMING_PAD] otherwise."""

    device = "cpu"

    def __init__(self, streams: int, words: list[list[str]]):
        self.streams, self.words = streams, words
        self.heard: dict[int, set[int]] = {}  # row -> positions whose 80 ms held a click
        self.said: dict[int, int] = {}  # row -> script words begun
        self.queue: dict[int, list[int]] = {}  # row -> tokens still to say
        self.reset()

    def reset(self, rows=None):
        for r in range(self.streams) if rows is None else rows:
            self.heard[r], self.said[r], self.queue[r] = set(), 0, []

    def preprocess(self, wave):
        return wave[:, N_FFT // 2 : N_FFT // 2 + SPT].abs().amax(dim=1)

    def encode(self, mel, pos):
        for r, (loud, p) in enumerate(zip(mel.tolist(), pos.tolist())):
            if loud > 0.5:
                self.heard[r].add(p)
        return mel

    def decode(self, token, audio, pos, delay):
        logits = torch.zeros(len(pos), TOK.vocab_size)
        for r, (p, d) in enumerate(zip(pos.tolist(), delay.tolist())):
            if p - int(d) in self.heard[r]:
                self.queue[r] += TOK.encode(self.words[r][self.said[r]])
                self.said[r] += 1
            logits[r, self.queue[r].pop(0) if self.queue[r] else PAD] = 1
        return logits


class ClickModel:
    """What the library's streams (runner/app/streams.py) use of a loaded Model, over ClickSteps."""

    name = "clicks"

    def __init__(self, steps: Steps):
        self._steps, self._family = steps, RealtimeFamily(TOK, SPEC)
        self._program = SimpleNamespace(state_lock=threading.Lock())

    def _check_open(self) -> None:
        pass

    def stream_many(self, sources, on_delta=None):
        return stream_many(self, sources, on_delta)


def _clicks(samples: list[int], seconds: float, seed: int) -> np.ndarray:
    audio = (0.01 * np.random.default_rng(seed).standard_normal(int(seconds * 16000))).astype(np.float32)
    audio[samples] = 1.0
    return audio


def _streamed(scripts: list[list[tuple[int, str]]], block: int) -> list[Stream]:
    steps = ClickSteps(len(scripts), [[w for _, w in s] for s in scripts])
    streams = [Stream(SPEC) for _ in scripts]
    audio = [_clicks([c for c, _ in s], 6.0, i) for i, s in enumerate(scripts)]
    run_fed(StreamBatch(steps, SPEC), [(st, blocks_of(a, block)) for st, a in zip(streams, audio)])
    return streams


def _expected_words(script: list[tuple[int, str]]) -> list[tuple[str, int, int]]:
    """(word, start sample, end sample): from the click's position, one position per token."""
    out = []
    for click, word in script:
        start = click // SPT * SPT
        assert not out or out[-1][2] <= start, "the script's words must not overlap"
        out.append((word, start, start + len(TOK.encode(word)) * SPT))
    return out


def _samples(t: float) -> int:
    assert abs(t * 16000 - round(t * 16000)) < 1e-6  # times are whole samples
    return round(t * 16000)


@pytest.mark.parametrize("block", [SPT, 777, 16000 * 6])
def test_each_word_starts_at_its_click_s_80_ms(block):
    (stream,) = _streamed([SCRIPT], block)
    times = token_times(SPEC, stream.positions)
    assert len(times) == len(stream.tokens) == len(stream.positions)
    got = [(w.word, _samples(w.start), _samples(w.end)) for w in words_of(TOK, stream.tokens, times)]
    assert got == _expected_words(SCRIPT)
    for (click, _), (_, start, end) in zip(SCRIPT, got):
        assert start <= click < start + SPT <= end


def test_every_token_has_its_80_ms_in_order():
    (stream,) = _streamed([SCRIPT], 777)
    times = [(_samples(a), _samples(b)) for a, b in token_times(SPEC, stream.positions)]
    assert all(b - a == SPT for a, b in times)
    # one token per position from the stream's start (its first token is the audio at 0), none skipped
    assert [a for a, _ in times] == [i * SPT for i in range(len(times))]
    # to the stream's end: its last position is the padded end less the delay
    assert times[-1][1] >= 6 * 16000


def test_streams_in_one_batch_keep_their_own_times():
    other = [(500, " one"), (40_000, " two."), (60_001, " three")]
    a, b = _streamed([SCRIPT, other], 500)
    for stream, script in ((a, SCRIPT), (b, other)):
        times = token_times(SPEC, stream.positions)
        got = [(w.word, _samples(w.start), _samples(w.end)) for w in words_of(TOK, stream.tokens, times)]
        assert got == _expected_words(script)


def test_segments_break_at_a_sentence_s_end_and_at_a_pause():
    (stream,) = _streamed([SCRIPT], 777)
    segs = segments_of(TOK, stream.tokens, token_times(SPEC, stream.positions))
    assert [s["text"] for s in segs] == [" Hello world.", " it's good", " news"]
    words = _expected_words(SCRIPT)
    for seg, group in zip(segs, ([0, 1], [2, 3], [4])):
        assert (_samples(seg["start"]), _samples(seg["end"])) == (words[group[0]][1], words[group[-1]][2])
        got = [(w["word"], _samples(w["start"]), _samples(w["end"])) for w in seg["words"]]
        assert got == [words[i] for i in group]
    assert [t for s in segs for t in s["tokens"]] == [t for t in stream.tokens if not TOK.is_special(t)]
    assert all(s["temperature"] == 0.0 and s["avg_logprob"] is None for s in segs)


def test_pads_between_a_word_s_pieces_do_not_split_it():
    hello = TOK.encode(" news")
    assert len(hello) > 1, "the fixture tokenizer splits the word"
    tokens = [PAD, hello[0], PAD, PAD, *hello[1:], 2]
    times = token_times(SPEC, [SPEC.n_left_pad_tokens + SPEC.num_delay_tokens + i for i in range(len(tokens))])
    (word,) = words_of(TOK, tokens, times)
    assert word.word == " news" and _samples(word.start) == SPT and _samples(word.end) == len(tokens[:-1]) * SPT


def test_the_stream_json_record_carries_the_times(tmp_path):
    """`stream --json`'s record (runner/app/stream.py) from a file: each token's [start, end], the segments and
    their words, at the clicks' times."""
    path = tmp_path / "clicks.wav"
    sf.write(path, _clicks([c for c, _ in SCRIPT], 6.0, 0), 16000, subtype="FLOAT")
    args = argparse.Namespace(audio=[str(path)], block_ms=30, json=True, realtime=False, pcm="s16le")
    steps = ClickSteps(1, [[w for _, w in SCRIPT]])
    (rec,) = json.loads(json.dumps(_stream_sources(args, ClickModel(steps))))
    assert len(rec["token_times"]) == len(rec["tokens"])
    assert [_samples(a) for a, _ in rec["token_times"]] == [i * SPT for i in range(len(rec["tokens"]))]
    words = [(w["word"], _samples(w["start"]), _samples(w["end"])) for s in rec["segments"] for w in s["words"]]
    assert words == _expected_words(SCRIPT)
    assert "".join(s["text"] for s in rec["segments"]) == rec["text"] == "".join(w for _, w in SCRIPT)
    assert set(rec["segments"][0]) == {"start", "end", "text", "tokens", "avg_logprob", "no_speech_prob",
                                       "temperature", "words"}  # fmt: skip


# ---------------------------------------------------------------- the library's stream_many (runner/app/streams.py)


class EndingSteps(ClickSteps):
    """ClickSteps that say </s> once every word of their script is said."""

    def decode(self, token, audio, pos, delay):
        said = [self.said[r] == len(self.words[r]) and not self.queue[r] for r in range(len(pos))]
        logits = super().decode(token, audio, pos, delay)
        for r in (r for r, s in enumerate(said) if s):
            logits[r] = 0
            logits[r, SPEC.eos_id] = 1
        return logits


def test_stream_many_waits_for_a_slot_and_stops_a_failing_source_alone():
    """Three sources through two slots (the third waits for one): each one's words at its clicks; a source that
    raises mid-way is its own error, with what it decided before it, and the others go on."""
    audio = [_clicks([c for c, _ in SCRIPT], 6.0, i) for i in range(3)]
    cut = 30_000  # before " it's" (sample 30 500): the failing stream has heard " Hello world." only

    def failing():
        yield from blocks_of(audio[1][:cut], 777)
        raise AudioError("stdin: not audio")

    steps = ClickSteps(2, [[w for _, w in SCRIPT]] * 2)
    seen: list[tuple[int, str]] = []
    sources = [blocks_of(audio[0], 777), failing(), blocks_of(audio[2], 777)]
    ended = list(ClickModel(steps).stream_many(sources, on_delta=lambda i, d: seen.append((i, d.text))))
    assert [(t.index, type(e).__name__ if e else None) for t, e in ended] == [(1, "AudioError"), (0, None), (2, None)]
    results = {t.index: t for t, _ in ended}
    for i in (0, 2):
        words = [(w.word, _samples(w.start), _samples(w.end)) for s in results[i].segments for w in s.words]
        assert words == _expected_words(SCRIPT) and results[i].text == "".join(w for _, w in SCRIPT)
        assert len(results[i].token_times) == len(results[i].tokens)
    partial = results[1]
    assert partial.text == " Hello world." and partial.stats["audio_seconds"] <= cut / 16000
    assert list(partial.tokens) == list(results[0].tokens[: len(partial.tokens)])
    for i, t in results.items():
        assert "".join(text for j, text in seen if j == i) == t.text


def test_stream_many_ends_a_stream_at_its_eos_without_reading_its_source_on():
    """A stream the model ends (</s>) before its source does: its transcript as soon as it is said, the rest of
    the source never read."""
    audio = _clicks([c for c, _ in SCRIPT[:2]], 2.0, 0)
    read = []

    def endless():
        for block in blocks_of(audio, SPT):
            read.append(len(block))
            yield block
        for _ in range(400):  # half a minute of silence: the </s> ends the stream long before
            read.append(SPT)
            yield np.zeros(SPT, np.float32)

    model = ClickModel(EndingSteps(1, [[w for _, w in SCRIPT[:2]]]))
    ((t, error),) = list(model.stream_many([endless()]))
    assert error is None and t.text == " Hello world." and t.tokens[-1] == SPEC.eos_id
    assert sum(read) < len(audio)  # it ended within the clicks' audio
