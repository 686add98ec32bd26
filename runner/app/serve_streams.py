"""The stream engine behind `/v1/realtime` (runner/app/serve_realtime.py): a realtime bundle's stream slots
(runner/app/streams.py) on one thread of their own, the only one that calls the model.

Connections hand it commands: open a stream, audio in, end it, close it. It runs every command waiting, then
one batched step of every stream whose next position's audio is here, and again, until no stream has audio to
step; then it waits for the next command. So the audio of every connection steps together, and a connection whose
audio has not arrived waits in its slot without holding the others back. A stream's deltas go to its `on_delta`
(on this thread) as its steps decide them; audio in is answered once it is stepped (as a lone stream's push
returns), an end with the Transcription once the stream is done. The slots are taken while a stream is open and
given back when the last one closes, so the model is free between utterances."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError

from runner.errors import GenerationError

log = logging.getLogger(__name__)


class StreamEngine:
    """The thread that owns a realtime Model's streams; `start()` once, `stop()` waits for it to end."""

    def __init__(self, model):
        self.model = model
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (handler, future, args); None: stop
        self._thread: threading.Thread | None = None
        self._slots = None  # the model's StreamSlots while a stream is open
        self._feeding: list[tuple[object, Future]] = []  # audio in, answered once stepped
        self._ending: list[tuple[object, Future]] = []  # ended, answered with the Transcription once done

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="runner-realtime", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
            self._thread = None

    # ------------------------------------------------ what a connection asks (on the server's loop)

    async def open(self, on_delta):
        """A Stream in a free slot; `on_delta(delta)` is called on the engine's thread."""
        return await self._call(self._open, on_delta)

    async def feed(self, stream, pcm: bytes) -> None:
        await self._call(self._feed, stream, pcm)

    async def finish(self, stream):
        """The stream ended and stepped to its last token: its Transcription (the stream is closed)."""
        return await self._call(self._end, stream)

    async def close(self, stream) -> None:
        await self._call(self._close, stream)

    def _call(self, handler, *args) -> asyncio.Future:
        future: Future = Future()
        self._inbox.put((handler, future, args))
        return asyncio.wrap_future(future)

    # ------------------------------------------------ the engine's thread

    def _run(self) -> None:
        stepped = False
        while True:
            for command in self._commands(block=not stepped):
                if command is None:
                    self._fail(GenerationError("the server is stopping"))
                    return
                handler, future, args = command
                try:
                    handler(future, *args)
                except Exception as e:  # the command's own error (a closed stream, every slot taken)
                    _answer(future, error=e)
            stepped = self._step()
            self._settle()

    def _commands(self, block: bool):
        """The commands waiting (the first one waited for, if `block`)."""
        try:
            yield self._inbox.get(block=block)
            while True:
                yield self._inbox.get_nowait()
        except queue.Empty:
            return

    def _open(self, future: Future, on_delta) -> None:
        if self._slots is None:
            self._slots = self.model.stream_slots()
        try:
            _answer(future, self._slots.open(on_delta))
        finally:
            self._give_back()

    def _feed(self, future: Future, stream, pcm: bytes) -> None:
        stream.feed(pcm)
        self._feeding.append((stream, future))

    def _end(self, future: Future, stream) -> None:
        stream.end()
        self._ending.append((stream, future))

    def _close(self, future: Future, stream) -> None:
        stream.close()
        _answer(future)
        self._give_back()

    def _step(self) -> bool:
        if self._slots is None:
            return False
        try:
            return self._slots.step()
        except Exception as e:
            log.exception("the realtime step failed")
            self._fail(GenerationError(f"the step failed ({e})"))
            return False

    def _settle(self) -> None:
        """Answer the audio now stepped and the streams now done."""
        feeding, self._feeding = self._feeding, []
        for stream, future in feeding:
            if stream.pending:
                self._feeding.append((stream, future))
            else:
                _answer(future)
        ending, self._ending = self._ending, []
        for stream, future in ending:
            if not stream.done:
                self._ending.append((stream, future))
                continue
            try:
                _answer(future, stream.result())
            except Exception as e:
                _answer(future, error=e)
        self._give_back()

    def _fail(self, error: Exception) -> None:
        """Every stream closed, and whoever waits on one told why."""
        for _, future in self._feeding + self._ending:
            _answer(future, error=error)
        self._feeding, self._ending = [], []
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def _give_back(self) -> None:
        """The model's streams given back once no stream is open."""
        if self._slots is not None and self._slots.free == self._slots.size:
            self._slots.close()
            self._slots = None


def _answer(future: Future, value=None, error: Exception | None = None) -> None:
    """A command answered; one whose connection stopped waiting (its task cancelled: the server stopping) is let
    be."""
    with contextlib.suppress(InvalidStateError):
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)
