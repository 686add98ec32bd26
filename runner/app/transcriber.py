"""A bundle made ready to transcribe whole files, one way for the library (runner/app/api.py's Model) and the CLI's
`run` (runner/app/run.py): the program loaded with its load stats, the engine warmed up, the runner; each file's
result as it finishes; and the segments a result's record gives."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from runner.app.os_errors import reason
from runner.bundle import read_manifest
from runner.errors import AudioError, RunnerError
from runner.families import FAMILIES, Family
from runner.runtime.batch import JOB_ERRORS, Job, JobResult, generate_many
from runner.runtime.engine import ProgramEngine
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Program
from runner.runtime.prompt import Prompt
from runner.runtime.results import GenerationResult, Segment
from runner.stats import Stats, now_ms

__all__ = ["Transcriber", "load_program", "segments_of", "window_bounds"]


def load_program(
    bundle: str | os.PathLike, options: RuntimeOptions, device: str | None = None
) -> tuple[Program, Stats]:
    """The bundle's program (every file's digest checked first) and the load's stats: its start and end, and on
    CUDA the device memory before and after. The caller closes the program."""
    cuda = (device or read_manifest(bundle).device) == "cuda"  # no CUDA context for a CPU bundle
    load = Stats(model_load_start_ms=now_ms())
    if cuda:
        load.record_gpu_memory("before_load")
    program = Program.load(bundle, device=device, options=options)
    load.model_load_end_ms = now_ms()
    if cuda:
        try:
            load.record_gpu_memory("after_load")
        except BaseException:
            program.close()
            raise
    return program, load


@dataclass(frozen=True)
class Transcriber:
    """A whole-file bundle's engine (warmed up: part of the load, in `load`) and runner over its program."""

    program: Program
    family: Family
    engine: ProgramEngine
    runner: MultimodalRunner
    load: Stats  # the load's stats: each file's result starts from them

    @classmethod
    def ready(
        cls, program: Program, family: Family, runtime: RuntimeOptions, load: Stats, word_timestamps: bool = False
    ) -> Transcriber:
        """The engine and runner over `program`; with `word_timestamps`, a bundle that cannot give them is refused
        before the warm-up."""
        engine = ProgramEngine(program, runtime, cross_attention=family.cross_attention)
        if word_timestamps:
            _check_word_timestamps(program.bundle_dir, family, engine)
        t0 = now_ms()
        if runtime.warm_up and engine.warm_up():  # part of the load: the first file pays no first-call costs
            load.model_load_end_ms = now_ms()
            load.warm_up_ms = load.model_load_end_ms - t0
        return cls(program, family, engine, MultimodalRunner(engine, family.tokenizer, family.audio_id), load)

    def check_word_timestamps(self) -> None:
        """Word times asked of a bundle that cannot give them: the one line saying why (its family, or an export
        without the alignment method)."""
        _check_word_timestamps(self.program.bundle_dir, self.family, self.engine)

    def prompts(self, path: str | Path, prompt: str | None, language: str | None) -> list[Prompt]:
        """The family's prompt windows for an audio file."""
        return self.family.prompts(path, prompt, language, self.engine.max_audio_chunks)

    def file_results(
        self,
        paths: list[Path],
        generation: GenerationOptions,
        batch: int,
        prompt: str | None = None,
        language: str | None = None,
        on_start: Callable[[Path], None] | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Iterator[JobResult]:
        """Each file's result as it finishes (`generate_many`, `batch` at a time). A file whose audio cannot be
        read (or opened: its permissions) fails before it is a job; its result comes out ahead of the next finished
        one. With `on_text` the files run one at a time with their text streamed as it is generated (`on_start` as
        each begins)."""
        failed: deque[JobResult] = deque()

        def jobs() -> Iterator[Job]:
            for path in paths:
                if on_start is not None:
                    on_start(path)
                try:
                    windows = self.prompts(path, prompt, language)
                except JOB_ERRORS as e:
                    failed.append(JobResult(Job(path, []), None, e))
                    continue
                except OSError as e:  # the system refused this file (its permissions, a folder's): the others go on
                    failed.append(
                        JobResult(Job(path, []), None, AudioError(f"cannot read audio file: {path} ({reason(e)})"))
                    )
                    continue
                yield Job(path, windows, self.load)

        for r in generate_many(self.runner, jobs(), generation, batch, on_text=on_text):
            while failed:
                yield failed.popleft()
            yield r
        while failed:
            yield failed.popleft()


def _check_word_timestamps(bundle_dir: Path, family: Family, engine: ProgramEngine) -> None:
    if not family.capabilities.word_timestamps:
        able = " or ".join(name for name, f in FAMILIES.items() if f.capabilities.word_timestamps)
        raise RunnerError(
            f"--word-timestamps: a {family.name} bundle gives no word times (its segments are its windows; "
            f"finer times need an aligner); {able} bundles give them"
        )
    if not engine.aligns:
        raise RunnerError(
            f"--word-timestamps: {bundle_dir} has no alignment method (exported by an older version); export it again"
        )


# ---------------------------------------------------------------- a result's times


def window_bounds(result: GenerationResult) -> list[tuple[float, float]]:
    """Each window's start and end in the file, in seconds to the millisecond: windows are consecutive, so each
    starts where the one before ends."""
    out, start = [], 0.0
    for part in result.parts:
        end = start + part.stats.audio_seconds
        out.append((round(start, 3), round(end, 3)))
        start = end
    return out


def segments_of(result: GenerationResult) -> tuple[Segment, ...]:
    """The result's own segments (from timestamp tokens), else one per window at its bounds: a family without
    timestamp tokens knows no finer times, and none are made up. A window judged silent has none."""
    if result.segments:
        return result.segments
    if not result.parts:  # a result not cut into windows: the whole file is its one stretch
        whole = Segment(0.0, round(result.stats.audio_seconds, 3), result.text, tuple(result.tokens))
        return (whole,) if result.text.strip() else ()
    return tuple(
        Segment(start, end, part.text, tuple(tokens), temperature=part.temperature)
        for part, tokens, (start, end) in zip(result.parts, result.window_tokens(), window_bounds(result))
        if part.text.strip() and not part.silent
    )
