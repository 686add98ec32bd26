"""The library's streams (runner/app/api.py's Model.stream, stream_slots and stream_many): audio into a realtime
bundle as it arrives, one stream alone or several at once in the bundle's stream slots.

A realtime bundle is exported with S stream slots (`export --max-streams`): its step methods take a batch of
streams, stream i in state row i. StreamSlots holds them; each Stream is one slot. A step runs every stream whose
next position's audio is here, in one call of each method, and a stream whose audio has not arrived waits in its
row without holding the others back (session.py's StreamBatch with hold_idle). `stream_many` feeds sources of
blocks (files, a pipe) in lockstep instead, one block of each at a time, as `python -m runner stream` does: it is
that verb's loop. Each stream's tokens are those it gets alone, and those of `stream --json` on the same samples."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import numpy as np

from runner.app.audio_inputs import mono_samples
from runner.app.stream_record import stream_stats, timed
from runner.app.transcription import Delta, Transcription
from runner.audio import SAMPLE_RATE
from runner.errors import GenerationError, RunnerError
from runner.families.voxtral_realtime import Stream as Positions
from runner.families.voxtral_realtime import StreamBatch
from runner.families.voxtral_realtime.times import token_times
from runner.runtime.results import Segment, Word

__all__ = ["Stream", "StreamSlots", "stream_many"]

# A source that cannot be read (a bad file, samples that are not audio) ends its own stream; the others go on.
SOURCE_ERRORS = (RunnerError, OSError)


class StreamSlots:
    """A realtime bundle's stream slots, for several streams at once: `open()` a Stream in a free slot (at most
    `size` open), `push` audio into any of them. A push (or finish) steps every stream of the slots whose audio
    is here, so its deltas go to its own `on_delta` whichever stream was pushed. A loop of its own (the server's)
    can instead `feed` and `end` the streams and call `step()`. The slots hold the model's state from creation to
    `close()` (one StreamSlots, or one Model.stream(), at a time), and are called from one thread at a time.

    With `lockstep` a step waits until every open stream's next position's audio is here, as for streams fed
    together (stream_many): no row steps held."""

    def __init__(self, model, lockstep: bool = False):
        model._check_open()
        if model._steps is None:
            raise GenerationError(
                f"{model.name}: a {model.family} bundle transcribes whole inputs: use Model.transcribe(), not streams"
            )
        self.model = model
        self._lock = model._program.state_lock  # the state rows are the model's: one user (or call) at a time
        if not self._lock.acquire(blocking=False):
            raise GenerationError(f"{model.name}: a stream is already open on this model; finish it first")
        model._steps.reset()
        self._batch = StreamBatch(model._steps, model._family.spec, hold_idle=not lockstep)
        self._streams: list[Stream] = []  # open, in the order opened
        self._open = True

    @property
    def size(self) -> int:
        """The bundle's stream slots (its export's --max-streams)."""
        return len(self._batch.rows)

    @property
    def free(self) -> int:
        return self.size - len(self._streams)

    def open(self, on_delta: Callable[[Delta], None] | None = None) -> Stream:
        """A stream in a free slot (its state cleared); GenerationError when all `size` are taken."""
        self._check_open()
        if not self.free:
            raise GenerationError(f"{self.model.name}: all {self.size} stream slots are taken; finish or close one")
        return Stream(self, on_delta)

    def step(self) -> bool:
        """One position of every open stream whose next position's audio is here, in one batched call of each
        method (the others wait, as they were); whether one was."""
        self._check_open()
        return self._batch.step()

    def run(self) -> int:
        """Step while a stream has its next position's audio; the number of steps."""
        self._check_open()
        return self._batch.run()

    def close(self) -> None:
        """Close every open stream and give the model's state back; any call after this raises."""
        if self._open:
            for s in list(self._streams):
                s.close()
            self._open = False
            self._lock.release()

    def _check_open(self) -> None:
        self.model._check_open()
        if not self._open:
            raise GenerationError("the stream slots are closed; open them again with Model.stream_slots()")

    def __enter__(self) -> StreamSlots:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Stream:
    """Audio into a realtime bundle as it arrives. `push(pcm)` takes float32 samples at 16 kHz (mono, or
    (n, channels) averaged) or bytes of s16le mono PCM, and gives the text deltas it decided; `finish()` ends the
    stream (its right padding decides the last tokens, whose deltas go to `on_delta` and `deltas`) and gives the
    Transcription: the same tokens and text as `python -m runner stream --json` on the same audio.

    Each stream is a slot of a StreamSlots: its own (Model.stream()), or one of several (StreamSlots.open()). A
    loop that steps the slots itself uses `feed` (audio in, nothing stepped) and `end` (no more audio), then
    `result()` once the stream is `done`."""

    def __init__(self, slots: StreamSlots, on_delta: Callable[[Delta], None] | None = None, own: bool = False):
        self._slots, self._own, self._on_delta = slots, own, on_delta
        family = slots.model._family
        self._tok, self._spec = family.tokenizer, family.spec
        self._decoder = family.decoder()
        self._positions = Positions(self._spec, self._token)
        slots._batch.add(self._positions)
        slots._streams.append(self)
        self._odd = b""  # a byte of an s16 sample split across pushes
        self.deltas: list[Delta] = []  # every delta so far, in order
        self._open, self._ended = True, False

    def push(self, pcm: np.ndarray | bytes) -> list[Delta]:
        """Feed audio and step the slots; the deltas of this stream's tokens it decided (none until the model's
        delay has passed)."""
        n = len(self.deltas)
        self.feed(pcm)
        self._slots.run()
        return self.deltas[n:]

    def finish(self) -> Transcription:
        """End the stream: the last tokens, then the whole transcript. The stream is closed after."""
        try:
            self.end()
            self._slots.run()
            return self.result()
        finally:
            self.close()

    def feed(self, pcm: np.ndarray | bytes) -> None:
        """Audio in; the slots' step() decides its tokens."""
        self._check_open()
        if self._ended:
            raise GenerationError("the stream has ended: it takes no more audio")
        self._positions.feed(self._samples(pcm))

    def end(self) -> None:
        """No more audio: the right padding goes in, and the slots' steps run the stream to its last token."""
        self._check_open()
        self._ended = True
        self._positions.finish()

    @property
    def pending(self) -> bool:
        """Whether audio is here that a step of the slots has yet to run."""
        return self._open and self._positions.ready()

    @property
    def done(self) -> bool:
        """Whether the stream is ended and stepped to its last token (or its </s>): `result()` is ready."""
        return self._ended and self._positions.done

    def result(self) -> Transcription:
        """A done stream's Transcription (the decoder's held-back text is its last delta); the stream is closed
        after."""
        self._check_open()
        if not self.done:
            raise GenerationError("the stream is not done: end() it and step its slots first")
        try:
            tail = self._decoder.flush()
            if tail:
                p = self._positions.positions
                end = token_times(self._spec, p[-1:])[0][1] if p else 0.0
                self._add(Delta(tail, end, end))
            return self._transcription()
        finally:
            self.close()

    def _stop(self) -> Transcription:
        """End the stream where it is, without the rest of its audio or its right padding (its source failed): the
        Transcription of the tokens decided so far. The stream is closed after."""
        self._check_open()
        self._ended = True
        self._positions.done = True  # it leaves its row before the next step
        return self.result()

    def close(self) -> None:
        """Give the stream's slot back (finish() and result() do); the stream takes no more audio."""
        if self._open:
            self._open = False
            self._positions.done = True  # it leaves its row: the slot is free for the next stream
            self._slots._streams.remove(self)
            if self._own:
                self._slots.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        self._slots.model._check_open()
        if not self._open:
            raise GenerationError("the stream is finished; open another with Model.stream()")

    def _samples(self, pcm: np.ndarray | bytes) -> np.ndarray:
        if isinstance(pcm, bytes | bytearray | memoryview):
            data = self._odd + bytes(pcm)
            cut = len(data) - len(data) % 2
            self._odd = data[cut:]
            return np.frombuffer(data[:cut], dtype="<i2").astype(np.float32) * np.float32(1 / 32768.0)
        if np.asarray(pcm).size == 0:  # nothing arrived yet: nothing to decide
            return np.zeros(0, np.float32)
        return mono_samples(pcm, "pushed audio")

    def _token(self, token: int) -> None:
        """A token a step decided: its text (once the decoder has its whole character) is a delta."""
        text = self._decoder.feed(token) if token < self._tok.vocab_size else ""
        if text:
            start, end = token_times(self._spec, self._positions.positions[-1:])[0]
            self._add(Delta(text, start, end))

    def _add(self, delta: Delta) -> None:
        self.deltas.append(delta)
        if self._on_delta is not None:
            self._on_delta(delta)

    def _transcription(self) -> Transcription:
        """What `stream --json` records of the stream (runner/app/stream_record.py), as a Transcription."""
        s, tok = self._positions, self._tok
        text = tok.decode([t for t in s.tokens if t < tok.vocab_size])
        record = timed(tok, self._spec, s)
        segments = tuple(_segment(r) for r in record["segments"])
        stats = stream_stats(s, self._spec, s.received / SAMPLE_RATE)
        times = tuple(tuple(t) for t in record["token_times"])
        return Transcription(text, segments, None, tuple(s.tokens), stats, None, 0, token_times=times)


def _segment(record: dict) -> Segment:
    """A stream's segment record (runner/families/voxtral_realtime/times.py) as a Segment with its Words."""
    words = tuple(Word(w["word"], w["start"], w["end"], w["probability"]) for w in record["words"])
    return Segment(
        record["start"],
        record["end"],
        record["text"],
        tuple(record["tokens"]),
        avg_logprob=record["avg_logprob"],
        no_speech_prob=record["no_speech_prob"],
        temperature=record["temperature"],
        words=words,
    )


def stream_many(
    model, sources: Iterable[Iterable[np.ndarray | bytes]], on_delta: Callable[[int, Delta], None] | None = None
) -> Iterator[tuple[Transcription, Exception | None]]:
    """Model.stream_many: every source a stream in the model's slots, fed in lockstep (one block of each open
    stream, then every step they make possible) and ended when its source is; more sources than slots wait, in
    order, for a free one. Yields (its Transcription, None) as each stream ends (`index`: its source's place), or
    (what it decided before, the error) where its source raised a RunnerError or OSError: that stream stops
    there and the others go on. `on_delta(index, delta)` as each stream's text is decided."""
    waiting = list(enumerate(sources))
    fed: dict[int, _Fed] = {}
    with StreamSlots(model, lockstep=True) as slots:
        while waiting or fed:
            while waiting and slots.free:
                i, source = waiting.pop(0)
                fed[i] = _Fed(i, slots.open(_indexed(on_delta, i)), iter(source))
            for f in fed.values():
                f.feed_next()
            slots.run()
            for i in [i for i, f in fed.items() if f.over]:
                yield fed.pop(i).outcome()


def _indexed(on_delta: Callable[[int, Delta], None] | None, i: int) -> Callable[[Delta], None] | None:
    return None if on_delta is None else lambda delta: on_delta(i, delta)


class _Fed:
    """One source of stream_many: its stream, its blocks, and the error that stopped it, if one did."""

    def __init__(self, index: int, stream: Stream, blocks: Iterator):
        self.index, self.stream, self.blocks = index, stream, blocks
        self.ended = False  # no more blocks to take
        self.error: Exception | None = None
        self.result: Transcription | None = None  # its transcript once over (a stopped one's: what it decided)

    def feed_next(self) -> None:
        """The source's next block in, or the stream's end once the source has no more."""
        if self.ended:
            return
        try:
            block = next(self.blocks, None)
            if block is not None:
                self.stream.feed(block)  # an AudioError where the block is not audio: the source's own
        except SOURCE_ERRORS as e:
            self.ended, self.error = True, e
            self.result = self.stream._stop()
            return
        if block is None:
            self.ended = True
            self.stream.end()

    @property
    def over(self) -> bool:
        """Stopped, or stepped to its last token (its audio's end, or the model's </s> before it)."""
        return self.error is not None or self.stream._positions.done

    def outcome(self) -> tuple[Transcription, Exception | None]:
        if self.error is None:
            self.stream.end()  # one the model ended (</s>) before its source did takes no more
            self.result = self.stream.result()
        return replace(self.result, index=self.index), self.error
