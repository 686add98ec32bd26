"""The `run` verb: several audio files through one loaded program, streamed text, stats, and the checks the
e2e job relies on (golden tokens, an expected substring, the eager reference, the word error rate); with a job
summary file (GITHUB_STEP_SUMMARY, read by the CLI), a table of them, one row per file."""

from __future__ import annotations

import argparse

from runner.app.checks import ResultCheck, build_checks
from runner.app.e2e_summary import COLUMNS, E2ESummary
from runner.app.folder import FilePlan
from runner.app.golden import golden_mismatch  # tests/app/test_cli_ux.py imports it from here
from runner.app.report import Reporter
from runner.app.run_args import RunOptions
from runner.app.transcriber import Transcriber, load_program
from runner.errors import RunnerError
from runner.families import family_for
from runner.runtime.generate import GenerationOptions
from runner.runtime.program import Program
from runner.stats import Stats

__all__ = ["STREAMING", "golden_mismatch", "run_files", "transcribe"]

STREAMING = "a streaming bundle; use `python -m runner stream`"  # `run` (and `run --ray`) given a realtime bundle


def run_files(args: argparse.Namespace, plan: FilePlan, live: bool = False) -> int:
    """The CLI's entry: the bundle loaded (runner/app/transcriber.py), then `run`'s options made from its flags,
    once."""
    program, load = load_program(args.bundle, args.runtime)
    with program:
        return transcribe(program, RunOptions.from_args(args), load, plan, live)


def transcribe(program: Program, options: RunOptions, load: Stats, plan: FilePlan, live: bool = False) -> int:
    """Every file of `plan` through one loaded program, `--batch` at a time, each result through the checks asked
    for; each file's record to stdout (--json) and to --out as it finishes. `live`: stderr is a terminal (the
    progress bar is drawn)."""
    family = family_for(program.bundle_dir, program.manifest.model)
    if family.capabilities.streaming:  # its methods are streaming steps, not a prompt's prefill and decode
        raise RunnerError(f"{program.bundle_dir}: {STREAMING}")
    whole = Transcriber.ready(program, family, options.runtime, load, word_timestamps=options.word_timestamps)
    generation = generation_options(options)
    checks = build_checks(program, family, options, generation)
    summary = summary_for(program, generation, checks, len(plan.todo))
    report = Reporter(options, summary, plan.out, live, program.manifest.model.get("max_seq_len"))
    streamed = dict(on_start=report.file_started, on_text=report.text) if report.streaming else {}
    results = whole.file_results(plan.todo, generation, options.batch, options.prompt, options.language, **streamed)
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
