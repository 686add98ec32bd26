"""One small hierarchy of our own errors; the CLI turns any of them into a single `error: ...` line."""


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
