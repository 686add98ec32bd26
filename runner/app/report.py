"""Where `run`'s results go, in one place: the terminal (text on stdout, or on stderr with --json; stats, notes and
errors on stderr), the JSON records (stdout with --json, and the --out file), the progress display (with --out,
instead of each file's text and stats) and the e2e job summary (GITHUB_STEP_SUMMARY).

With --out the records are the output: each bad file's error is said as it fails, the other failures once at the
end. Without it every failure is said at the end, the last one as the run's error."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from runner.app.checks import Totals, Verdict
from runner.app.e2e_summary import E2ESummary, FileRow, md_text
from runner.app.progress import Progress
from runner.app.results_file import ResultsFile
from runner.app.run_args import RunOptions
from runner.app.transcriber import segments_of, window_bounds
from runner.app.writers import TranscriptWriter, transcript
from runner.errors import RunnerError
from runner.runtime.batch import JobResult
from runner.runtime.results import GenerationResult

MAX_ERROR_LINES = 10  # with --out, the check failures listed at the end (each bad file's is its record)
ERROR_CELL = 120  # characters of an error in the summary's text cell


class Reporter:
    def __init__(
        self, options: RunOptions, summary: E2ESummary, out: ResultsFile | None, live: bool, context_tokens: int | None
    ):
        self.json, self.step_summary = options.json, options.step_summary
        self.summary, self.out, self.context_tokens = summary, out, context_tokens
        self.quiet = out is not None
        self.progress = Progress(summary.files, live) if out is not None else None
        # text streams as it is generated only one file at a time (a batch's files finish in any order)
        self.streaming = options.batch == 1 and not self.quiet
        self.text_out = sys.stderr if options.json else sys.stdout  # with --json, stdout carries only JSON lines
        self.failures: list[str] = []
        self.announced: set[str] = set()  # failures already printed as they happened
        self.writer = TranscriptWriter(options.outputs) if options.outputs is not None else None
        self.language = options.language

    # ------------------------------------------------ as files start and finish

    def file_started(self, path: Path) -> None:
        if not self.json:
            print(f"== {path}", file=sys.stderr)

    def text(self, text: str) -> None:
        self.text_out.write(text)
        self.text_out.flush()

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress.note(line)
        else:
            print(line, file=sys.stderr)

    def file_failed(self, path: Path, error: BaseException) -> None:
        """This file's fault: its record and summary row say so, and the run goes on with the next."""
        msg = str(error) if str(path) in str(error) else f"{path}: {error}"  # the line names the file at fault
        self.failures.append(msg)
        self.summary.rows.append(FileRow(Path(path).name, "", error=msg[:ERROR_CELL]))
        if self.progress is not None:
            self.say(f"error: {msg}")
            self.announced.add(msg)
            self.progress.advance(0.0, failed=True)
        self._emit({"audio": str(path), "error": msg})

    def file_text(self, done: JobResult) -> None:
        """A finished file's text (unless it streamed), and what is worth saying about how it ended."""
        path, result = done.job.key, done.result
        if self.streaming:
            self.text_out.write("\n")
        elif not self.quiet:
            self.file_started(path)
            self.text(result.text + "\n")
        if result.stop_reason == "context":
            self.say(
                f"note: {path}: stopped at the end of the context ({self.context_tokens} tokens); export with a "
                "larger --max-seq-len for longer output"
            )
        if len(result.parts) > 1 and not self.json and not self.quiet:
            for line in window_lines(result):
                print(line, file=sys.stderr)
        for line in window_warnings(path, result):
            self.say(line)
            self.summary.notes.append(f"- {md_text(line)}")  # a list: markdown would run lines together

    def file_checked(self, done: JobResult, verdicts: list[Verdict]) -> None:
        """A finished file's checks, summary row, stats and record."""
        path, result = done.job.key, done.result
        record = file_record(path, result)
        row = FileRow(Path(path).name, result.text)
        for v in verdicts:
            record.update(v.record)
            if v.cell is not None:
                row.cells[v.column] = v.cell
            if not self.quiet:
                for line in v.lines:
                    print(line, file=sys.stderr)
            self.failures += v.failures
        self.summary.rows.append(row)
        if self.progress is not None:
            self.progress.advance(result.stats.audio_seconds, failed=False)
        else:
            print(result.stats.observer_line(), file=sys.stderr)
            for line in result.stats.human_lines():
                print(line, file=sys.stderr)
        self._emit(record)
        self._write_files(path, record)

    def _write_files(self, path: Path, record: dict) -> None:
        """--output-format's files for this input; a file we may not replace fails this input, not the run."""
        if self.writer is None:
            return
        try:
            self.writer.write(path, transcript(record["text"], record["segments"], self.language))
        except (RunnerError, OSError) as e:
            msg = str(e) if isinstance(e, RunnerError) else f"{path}: writing its transcript files: {e}"
            self.failures.append(msg)
            if self.progress is not None:
                self.say(f"error: {msg}")
                self.announced.add(msg)

    def _emit(self, record: dict) -> None:
        if self.out is not None:
            self.out.append(record)
        if self.json:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    # ------------------------------------------------ the run as a whole

    def showing_progress(self) -> contextlib.AbstractContextManager:
        return self.progress if self.progress is not None else contextlib.nullcontext()

    def totals(self, totals: list[Totals]) -> None:
        for t in totals:
            for line in t.lines:
                print(line, file=sys.stderr)
            self.summary.notes += t.notes
            self.failures += t.failures

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, kind, stopped: BaseException | None, tb) -> None:
        """The files done so far still go to the summary, which says where the run stopped, if it did."""
        if self.progress is not None and isinstance(stopped, KeyboardInterrupt):
            print(
                f"note: stopped: {self.progress.done} of {self.summary.files} file(s) have their record in "
                f"{self.out.path}; the same command again does the rest",
                file=sys.stderr,
            )
        if self.step_summary:
            # backslashreplace: a file name that is not UTF-8 must not fail the summary of the others
            with open(self.step_summary, "a", encoding="utf-8", errors="backslashreplace") as f:
                f.write(self.summary.markdown(self.failures, stopped))

    def exit_code(self) -> int:
        """0 when nothing failed; otherwise the failures said and RunnerError raised."""
        if not self.failures:
            if self.progress is not None:
                print(f"done: {self.progress.summary()}; records in {self.out.path}", file=sys.stderr)
            return 0
        if self.progress is None:
            for f in self.failures[:-1]:
                print(f"error: {f}", file=sys.stderr)
            raise RunnerError(self.failures[-1])
        # each bad file's line was printed as it failed; what else failed (checks, WER) is said once here
        later = [f for f in self.failures if f not in self.announced]
        for f in later[:MAX_ERROR_LINES]:
            print(f"error: {f}", file=sys.stderr)
        more = f" ({len(later) - MAX_ERROR_LINES} more not shown)" if len(later) > MAX_ERROR_LINES else ""
        raise RunnerError(
            f"{self.progress.summary()}; {len(self.failures)} failure(s){more}; records in {self.out.path}"
        )


def file_record(path: Path, result: GenerationResult) -> dict:
    """A finished file's JSON record (the checks add their fields after these)."""
    return {
        "audio": str(path),
        "text": result.text,
        "prompt_ids": result.prompt_ids,
        "tokens": result.tokens,
        "stop_reason": result.stop_reason,
        "stats": result.stats.to_dict(),
        "segments": [s.to_dict() for s in segments_of(result)],
        "windows": window_records(result),
    }


def window_records(result: GenerationResult) -> list[dict]:
    """Each prompt window's own record: where it lies in the audio, its text, tokens, stop reason and stats, and
    what its decoding went through (temperature, fallbacks, silent) where the family judged it."""
    return [
        {
            "start_s": start,
            "end_s": end,
            "text": part.text,
            "tokens": tokens,
            "stop_reason": part.stop_reason,
            "stats": part.stats.to_dict(),
            **part.outcome(),
        }
        for part, tokens, (start, end) in zip(result.parts, result.window_tokens(), window_bounds(result))
    ]


def window_warnings(path: Path, result: GenerationResult) -> list[str]:
    """A line for each window whose text was dropped as silence, came out implausibly short for its sound, or was
    kept only from a fallback temperature: the transcript may miss or garble what was said there."""
    lines = []
    for i, (part, (start, end)) in enumerate(zip(result.parts, window_bounds(result)), 1):
        where = f"{path}: window {i}/{len(result.parts)} ({start:.1f}-{end:.1f} s)"
        if part.silent:
            lines.append(f"warning: {where} judged silent (no speech, and its text too unlikely to keep)")
        elif part.short:
            lines.append(
                f"warning: {where} came out implausibly short: {part.tokens} token(s) for {part.sound_seconds:.1f} s "
                "of sound; what was said there may be lost (check the audio, or try --temperature)"
            )
        elif part.fallbacks and part.temperature is not None:
            lines.append(
                f"warning: {where} decoded only at temperature {part.temperature:g}, after {part.fallbacks} "
                "fallback(s): its decodes at lower temperatures were judged implausible; check what it says"
            )
    return lines


def window_lines(result: GenerationResult) -> list[str]:
    return [
        f"window {i + 1}/{len(result.parts)}: {w['start_s']:.1f}-{w['end_s']:.1f} s, {len(w['tokens'])} tokens "
        f"({w['stop_reason']}), prompt {w['stats']['prompt_tokens']} tokens, "
        f"{w['stats']['prefill_tokens_per_s']:.0f}/{w['stats']['decode_tokens_per_s']:.1f} tokens/s prefill/decode"
        for i, w in enumerate(window_records(result))
    ]
