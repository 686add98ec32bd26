"""`serve`'s engine: the one thread that calls the Model, running the requests as one continuous batch
(`Model.transcribe_feed`): a request joins a free slot as soon as it arrives, while the others decode.

A running batch has one set of options (language, prompt, temperature, word times: a run's generation options
are its own), so it takes the waiting requests in arrival order while they ask the same. The first that asks
otherwise closes it to newcomers: the batch drains, and the next starts with that request's options. No request
waits behind one that came after it, so none starves: a request waits at most for the running batch to drain and
for the requests ahead of it. A request whose client has gone is dropped before it is taken (before its prefill).
Each request's future is settled from this thread with call_soon_threadsafe."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from dataclasses import asdict, dataclass

from runner.app.serve_metrics import Metrics
from runner.app.serve_openai import Options
from runner.errors import RunnerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    """A request the engine owes an answer: its upload, what it asks, and the future its handler awaits."""

    audio: bytes
    options: Options
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class Waiting:
    """The requests not yet in a batch, oldest first, at most `limit` of them. Closing it lets what waits finish."""

    def __init__(self, limit: int):
        self._limit = limit
        self._requests: deque[Submission] = deque()
        self._changed = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._requests)

    def put(self, request: Submission) -> None:
        """Never blocks: queue.Full when `limit` requests already wait."""
        with self._changed:
            if len(self._requests) >= self._limit:
                raise queue.Full
            self._requests.append(request)
            self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def take(self, options: Options | None, wait: bool) -> Submission | None:
        """The oldest request, if it asks `options` (None: any); else None. With `wait`, an empty queue is waited
        on, and None then says the queue is closed or its oldest asks other options (the batch that asked ends)."""
        with self._changed:
            while True:
                while self._requests and self._requests[0].future.cancelled():  # its client is gone
                    self._requests.popleft()
                if self._requests:
                    oldest = self._requests[0]
                    return self._requests.popleft() if options is None or oldest.options == options else None
                if not wait or self._closed:
                    return None
                self._changed.wait()


class _RunFeed:
    """The AudioFeed of one batch: its first request, then the waiting ones that ask its options; each taken
    request is known by an index until it is answered."""

    def __init__(self, waiting: Waiting, first: Submission, metrics: Metrics):
        self.waiting, self.first, self.metrics = waiting, first, metrics
        self.options = first.options
        self.running: dict[int, Submission] = {}  # taken, not yet answered
        self.taken = 0

    def take(self, wait: bool) -> tuple[int, bytes] | None:
        first, self.first = self.first, None
        if first is not None and not first.future.cancelled():
            request = first
        else:
            request = self.waiting.take(self.options, wait)
        if request is None:
            return None
        index, self.taken = self.taken, self.taken + 1
        self.running[index] = request
        self.metrics.batch.observe(len(self.running))
        return index, request.audio

    def unanswered(self) -> list[Submission]:
        """Those taken and not answered, and the first if the batch failed before it took it."""
        return [*([self.first] if self.first is not None else []), *self.running.values()]


class Engine:
    """The one thread that calls the Model. `submit` never blocks: queue.Full when --max-queue requests already
    wait."""

    def __init__(self, model, max_batch: int, max_queue: int, max_new_tokens: int | None, metrics: Metrics):
        self.model, self.max_batch, self.max_new_tokens, self.metrics = model, max_batch, max_new_tokens, metrics
        self._waiting = Waiting(max_queue)
        self._thread = threading.Thread(target=self._work, name="runner-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Submission) -> None:
        self._waiting.put(request)

    def depth(self) -> int:
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Finish what is running and waiting, then end the thread."""
        if self._thread.is_alive():
            self._waiting.close()
            self._thread.join()

    def _work(self) -> None:
        while (first := self._waiting.take(None, wait=True)) is not None:
            self._run(first)

    def _run(self, first: Submission) -> None:
        """One continuous batch with `first`'s options, until it drains with none of them waiting. A failure of
        the batch itself (not one request's: those come back as their own errors) answers every request in it."""
        feed = _RunFeed(self._waiting, first, self.metrics)
        kwargs = dict(asdict(first.options), max_new_tokens=self.max_new_tokens)
        try:
            for index, outcome in self.model.transcribe_feed(feed, batch=self.max_batch, **kwargs):
                self._settle(feed.running.pop(index), outcome)
        except Exception as e:
            if not isinstance(e, RunnerError):
                log.exception("the engine's batch failed")
            for request in feed.unanswered():
                self._settle(request, e)

    def _settle(self, request: Submission, outcome) -> None:
        if not isinstance(outcome, Exception):
            self.metrics.tokens.inc(len(outcome.tokens))
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone, nobody waits
            request.loop.call_soon_threadsafe(_resolve, request.future, outcome)


def _resolve(future: asyncio.Future, outcome) -> None:
    if future.done():  # cancelled: the client went away
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
