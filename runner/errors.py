"""One small hierarchy of our own errors; the CLI turns any of them into a single `error: ...` line."""

import threading


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
