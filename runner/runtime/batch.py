"""Many files through one program: `generate_many` takes jobs (one audio file's prompt windows each) and yields
each job's result as it finishes, in completion order.

At batch 1 the jobs run one after another through `MultimodalRunner.generate_windows`. At batch B > 1 (a bundle
exported with `--max-batch`), B sequences are in flight in one batched decode step, each with its own position,
prompt length and stop; when one finishes, the next prompt's prefill takes its slot (continuous batching).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from runner.errors import AudioError, GenerationError, TokenizerError
from runner.runtime.generate import GenerationOptions, GenerationResult, MultimodalRunner, Prompt
from runner.stats import Stats

# a job's own fault: its error record, and the other jobs go on
JOB_ERRORS = (AudioError, GenerationError, TokenizerError)


@dataclass(frozen=True)
class Job:
    key: object  # what the caller knows the job by (its audio path)
    windows: list[Prompt]  # one or more prompts, run in order, joined into one result
    stats: Stats | None = None  # what the caller recorded before (the model load); copied, never mutated


@dataclass(frozen=True)
class JobResult:
    job: Job
    result: GenerationResult | None  # None when the job failed
    error: Exception | None = None


def generate_many(
    runner: MultimodalRunner, jobs: Iterable[Job], opts: GenerationOptions, batch: int = 1
) -> Iterator[JobResult]:
    """Each job's result as it finishes. A job that fails (bad audio, a prompt over the context) yields its error
    and the others go on. `batch` sequences decode at once (1: one after another)."""
    if batch < 1:
        raise GenerationError(f"--batch {batch}: must be at least 1")
    if batch == 1:
        yield from _serial(runner, jobs, opts)
        return
    raise GenerationError(f"--batch {batch}: batched decoding is not built yet")


def _serial(runner: MultimodalRunner, jobs: Iterable[Job], opts: GenerationOptions) -> Iterator[JobResult]:
    for job in jobs:
        stats = copy.copy(job.stats) if job.stats is not None else Stats()
        try:
            result = runner.generate_windows(job.windows, opts, stats=stats)
        except JOB_ERRORS as e:
            yield JobResult(job, None, e)
            continue
        yield JobResult(job, result)
