"""One small hierarchy of our own errors; the CLI turns any of them into a single `error: ...` line. And how a
stop is asked for (SIGTERM, a Cancellation) and held off while a step that must not be cut short finishes."""

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, as KeyboardInterrupt is for SIGINT."""


class Cancellation:
    """A request to stop, made by whoever owns the process (the CLI's SIGTERM handler, a server shutting down) and
    passed down as a value to long work, which checks it where stopping is safe: between an export's methods and
    before it publishes. Once requested, whatever exception unwinds the stack (torch's own cleanup may replace the
    one raised, e.g. "Trying to pop empty mode stack" mid-trace) is still a termination: nothing may treat it as a
    failure to recover from (an export's fallback compile)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise Terminated if a stop was requested."""
        if self._event.is_set():
            raise Terminated()


@contextlib.contextmanager
def signals_held(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Ctrl-C (or SIGTERM) inside the block takes effect when it ends: a line being written, a bundle being
    swapped in, is finished first."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    pending: list[tuple[int, object]] = []
    previous = {s: signal.signal(s, lambda signum, frame: pending.append((signum, frame))) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signum, frame = pending[0]
            handler = previous[signum]
            if callable(handler):  # Python's KeyboardInterrupt, the CLI's Terminated
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


class RunnerError(Exception):
    """Base for every error a user can cause (bad input, bad bundle, bad network answer)."""


class AudioError(RunnerError):
    pass


class TokenizerError(RunnerError):
    pass


class BundleError(RunnerError):
    pass


class DelegateError(RunnerError):
    pass


class ExportError(RunnerError):
    pass


class FetchError(RunnerError):
    pass


class GenerationError(RunnerError):
    pass
