"""The progress display of a folder run: files done, audio hours per hour and the time left, as a bar on a terminal
and as plain lines in a log.
"""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Files done of the total, audio hours transcribed per hour of wall time, and the time left. On a terminal a
    rich bar on stderr; elsewhere (a log, a pipe, CI) a plain line every tenth of the files or PLAIN_EVERY_S
    seconds, whichever comes first, and one at the end: a redrawn bar would fill a log with its frames."""

    PLAIN_EVERY_S = 30.0

    def __init__(self, total: int, live: bool):
        self.total, self.live = total, live
        self.done = self.failed = 0
        self.audio_s = 0.0
        self.start = self._last = time.monotonic()
        self._step = max(1, total // 10)
        self._bar = self._task = None

    def __enter__(self) -> Progress:
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("files"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(stderr=True), redirect_stdout=False, redirect_stderr=False,
            )  # fmt: skip
            self._bar.start()
            self._task = self._bar.add_task("files", total=self.total, rate=self.rate_text())
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def rate_text(self) -> str:
        wall = time.monotonic() - self.start
        rate = self.audio_s / wall if wall > 0 else 0.0
        errors = f", {self.failed} error(s)" if self.failed else ""
        return f"{rate:.1f} audio h/h{errors}"

    def advance(self, audio_seconds: float, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        self.audio_s += audio_seconds
        if self._bar is not None:
            self._bar.update(self._task, advance=1, rate=self.rate_text())
            return
        now = time.monotonic()
        if self.done == self.total or self.done % self._step == 0 or now - self._last >= self.PLAIN_EVERY_S:
            self._last = now
            left = (now - self.start) / self.done * (self.total - self.done)
            print(
                f"progress: {self.done}/{self.total} files, {self.rate_text()}, ETA {_duration(left)}",
                file=sys.stderr,
                flush=True,
            )

    def note(self, text: str) -> None:
        """A line above the bar (or in the log)."""
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def summary(self) -> str:
        wall = time.monotonic() - self.start
        return (
            f"{self.done} file(s) in {_duration(wall)}, {self.failed} error(s); {self.audio_s / 3600:.2f} h of audio "
            f"({self.audio_s / wall if wall > 0 else 0.0:.1f} audio h/h)"
        )
