"""The `run` verb: several audio files through one loaded program, streamed text, stats, and the checks the
e2e job relies on (golden tokens, an expected substring, the eager reference, the word error rate); with a job
summary file (GITHUB_STEP_SUMMARY, read by the CLI), a table of them, one row per file."""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from runner.app.checks import ResultCheck, build_checks
from runner.app.e2e_summary import COLUMNS, E2ESummary
from runner.app.folder import FilePlan
from runner.app.golden import golden_mismatch  # tests/app/test_cli_ux.py imports it from here
from runner.app.os_errors import reason
from runner.app.report import Reporter
from runner.app.run_args import RunOptions
from runner.errors import AudioError, RunnerError
from runner.families import FAMILIES, family_for
from runner.runtime.batch import JOB_ERRORS, Job, JobResult, generate_many
from runner.runtime.engine import ProgramEngine
from runner.runtime.generate import GenerationOptions, MultimodalRunner, Prompt
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Program
from runner.stats import Stats, now_ms

__all__ = ["golden_mismatch", "run_files", "transcribe"]


def run_files(program: Program, args: argparse.Namespace, load: Stats, plan: FilePlan, live: bool = False) -> int:
    """The CLI's entry: `run`'s options are made from its flags here, once."""
    return transcribe(program, RunOptions.from_args(args), load, plan, live)


def transcribe(program: Program, options: RunOptions, load: Stats, plan: FilePlan, live: bool = False) -> int:
    """Every file of `plan` through one loaded program, `--batch` at a time, each result through the checks asked
    for; each file's record to stdout (--json) and to --out as it finishes. `live`: stderr is a terminal (the
    progress bar is drawn)."""
    family = family_for(program.bundle_dir, program.manifest.model)
    if family.capabilities.streaming:  # its methods are streaming steps, not a prompt's prefill and decode
        raise RunnerError(f"{program.bundle_dir}: a streaming bundle; use `python -m runner stream`")
    engine = ProgramEngine(program, options.runtime, cross_attention=family.cross_attention)
    if options.word_timestamps:
        check_word_timestamps(program, family, engine)
    _warm_up(engine, options.runtime, load)
    runner = MultimodalRunner(engine, family.tokenizer, family.audio_id)
    generation = generation_options(options)
    checks = build_checks(program, family, options, generation)
    summary = summary_for(program, generation, checks, len(plan.todo))
    report = Reporter(options, summary, plan.out, live, program.manifest.model.get("max_seq_len"))

    def prompts(path: Path) -> list[Prompt]:
        return family.prompts(path, options.prompt, options.language, engine.max_audio_chunks)

    streamed = dict(on_start=report.file_started, on_text=report.text) if report.streaming else {}
    results = file_results(runner, plan.todo, prompts, generation, options.batch, load, **streamed)
    with report:  # the job summary is written however the run ends
        with report.showing_progress():
            for done in results:
                if done.error is not None:
                    report.file_failed(done.job.key, done.error)
                    continue
                report.file_text(done)
                report.file_checked(done, [check.check(done) for check in checks])
        report.totals([check.finish() for check in checks])
    return report.exit_code()


def check_word_timestamps(program: Program, family, engine: ProgramEngine) -> None:
    """--word-timestamps on a bundle that cannot give them: one line before any file runs."""
    if not family.capabilities.word_timestamps:
        able = " or ".join(name for name, f in FAMILIES.items() if f.capabilities.word_timestamps)
        raise RunnerError(
            f"--word-timestamps: a {family.name} bundle gives no word times (its segments are its windows; "
            f"finer times need an aligner); {able} bundles give them"
        )
    if not engine.aligns:
        raise RunnerError(
            f"--word-timestamps: {program.bundle_dir} has no alignment method (exported by an older version); "
            "export it again"
        )


def _warm_up(engine: ProgramEngine, runtime: RuntimeOptions, load: Stats) -> None:
    """Part of the load: the first file pays no first-call costs."""
    t0 = now_ms()
    if runtime.warm_up and engine.warm_up():
        load.model_load_end_ms = now_ms()
        load.warm_up_ms = load.model_load_end_ms - t0


def generation_options(options: RunOptions) -> GenerationOptions:
    return GenerationOptions(
        max_new_tokens=options.max_new_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        seed=options.seed,
        min_new_tokens=options.min_new_tokens,
        record_logits=options.reference is not None,
        temperature_increment_on_fallback=options.temperature_increment_on_fallback,
        compression_ratio_threshold=options.compression_ratio_threshold,
        logprob_threshold=options.logprob_threshold,
        no_speech_threshold=options.no_speech_threshold,
        condition_on_previous_text=options.condition_on_previous_text,
        word_timestamps=options.word_timestamps,
    )


def summary_for(program: Program, generation: GenerationOptions, checks: list[ResultCheck], files: int) -> E2ESummary:
    """The job summary's heading: the bundle, the sampling and the checks asked for (in the table's order)."""
    m = program.manifest
    g = generation
    sampling = "greedy" if g.temperature == 0 else f"temperature {g.temperature:g}, top-p {g.top_p:g}"
    described = [c.described for c in sorted(checks, key=lambda c: list(COLUMNS).index(c.column))]
    return E2ESummary(
        title=f"e2e: {program.bundle_dir.name} ({m.device}, {m.dtype}), {files} file(s)",
        settings=f"{sampling}, at most {g.max_new_tokens or 'the default number of'} new tokens; checked: "
        f"{', '.join(described) or 'nothing'}",
        files=files,
        notes=[note for c in checks for note in c.notes],
    )


def file_results(
    runner: MultimodalRunner,
    paths: list[Path],
    prompts: Callable[[Path], list[Prompt]],
    opts: GenerationOptions,
    batch: int,
    load: Stats,
    on_start: Callable[[Path], None] | None = None,
    on_text: Callable[[str], None] | None = None,
) -> Iterator[JobResult]:
    """Each file's result as it finishes (`generate_many`, `batch` at a time). A file whose audio cannot be read
    (or opened: its permissions) fails before it is a job; its result comes out ahead of the next finished one.
    With `on_text` the files run one at a time with their text streamed as it is generated (`on_start` as each
    begins)."""
    failed: deque[JobResult] = deque()

    def jobs() -> Iterator[Job]:
        for path in paths:
            if on_start is not None:
                on_start(path)
            try:
                windows = prompts(path)
            except JOB_ERRORS as e:
                failed.append(JobResult(Job(path, []), None, e))
                continue
            except OSError as e:  # the system refused this file (its permissions, a folder's): the others go on
                failed.append(
                    JobResult(Job(path, []), None, AudioError(f"cannot read audio file: {path} ({reason(e)})"))
                )
                continue
            yield Job(path, windows, load)

    results = generate_many(runner, jobs(), opts, batch, on_text=on_text)
    for r in results:
        while failed:
            yield failed.popleft()
        yield r
    while failed:
        yield failed.popleft()
