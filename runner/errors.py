"""One small hierarchy of our own errors; the CLI turns any of them into a single `error: ...` line."""

import threading

# Set by the CLI's SIGTERM handler before it raises: whatever exception then unwinds the stack (torch's own cleanup
# may replace the one raised, e.g. "Trying to pop empty mode stack" mid-trace) is still a termination, which the
# CLI reports as one and nothing may treat as a failure to recover from (an export's fallback compile).
TERMINATING = threading.Event()


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
