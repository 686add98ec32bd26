"""The checks `run` makes on each file's result: the eager reference, the word error rate, an expected substring and
the golden tokens. Each is a small object asked about every file (`check`) and once at the end (`finish`); it says
what failed, its cell of the job summary, what it adds to the file's JSON record and what the terminal shows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from runner.app import wer
from runner.app.golden import golden_mismatch, read_golden
from runner.app.run_args import RunOptions
from runner.bundle import Manifest
from runner.dtypes import torch_dtype
from runner.errors import RunnerError
from runner.families import Family
from runner.reference import eager_engine
from runner.reference.score import STEP_TOLERANCE, ReferenceReport, compare_with_reference
from runner.runtime.batch import JobResult
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.program import Program


@dataclass
class Verdict:
    """What one check says about one file."""

    column: str  # the check's column of the job summary (e2e_summary.COLUMNS)
    cell: str | None = None  # None: not checked for this file (the summary shows "not asked")
    failures: list[str] = field(default_factory=list)
    record: dict = field(default_factory=dict)  # added to the file's JSON record
    lines: list[str] = field(default_factory=list)  # shown on stderr under the file's text (not with --out)


@dataclass
class Totals:
    """What one check says once every file is done."""

    lines: list[str] = field(default_factory=list)  # on stderr, also with --out
    notes: list[str] = field(default_factory=list)  # the job summary's lines under its table
    failures: list[str] = field(default_factory=list)


class ResultCheck:
    """One check of every file's result. `described` goes into the summary's "checked:" line; `notes` into the
    summary from the start (they hold even if the run stops)."""

    column: str
    described: str
    notes: tuple[str, ...] = ()

    def check(self, done: JobResult) -> Verdict:
        raise NotImplementedError

    def finish(self) -> Totals:
        return Totals()


class EagerReference(ResultCheck):
    """The eager PyTorch model on the bundle's weights scores the same windows: the tokens must agree, or differ
    only at a near tie (sampled runs: the logits must agree)."""

    column = "reference"
    described = "the eager reference"

    def __init__(self, reference: MultimodalRunner, generation: GenerationOptions, dtype: torch.dtype):
        self.reference, self.generation, self.dtype = reference, generation, dtype

    @classmethod
    def load(cls, program: Program, family: Family, generation: GenerationOptions) -> EagerReference:
        engine = eager_engine(program.bundle_dir, program.manifest)
        runner = MultimodalRunner(engine, family.tokenizer, family.audio_id)
        return cls(runner, generation, torch_dtype(program.manifest.dtype))

    def check(self, done: JobResult) -> Verdict:
        rep = compare_with_reference(
            self.reference, done.result.prompts or done.job.windows, done.result, self.generation, self.dtype
        )
        first = "match" if rep.first_divergence is None else f"first divergence at token {rep.first_divergence}"
        line = (
            f"eager reference: {first}, max logit error {rep.max_logit_error:.3g} (logit scale {rep.logit_scale:.3g})"
            f"{', near tie' if rep.near_tie else ''}"
        )
        at, tol = rep.first_divergence, STEP_TOLERANCE.get(self.dtype, STEP_TOLERANCE[torch.bfloat16])
        failures = []
        if not rep.worst_ratio <= tol:
            failures.append(
                f"{done.job.key}: logits differ from the eager reference at step {rep.worst_step} by "
                f"{rep.worst_ratio:.3g} of its logit scale (a faithful {self.dtype} run stays within {tol:g})"
            )
        elif not rep.ok:
            failures.append(f"{done.job.key}: tokens differ from the eager reference at token {at}")
        return Verdict(self.column, self._cell(rep), failures, {"reference": rep.to_dict()}, [line])

    def _cell(self, rep: ReferenceReport) -> str:
        if self.generation.temperature > 0 or not rep.ok and rep.first_divergence is None:
            return f"{'ok' if rep.ok else '**logits differ**'} (max logit error {rep.max_logit_error:.2g})"
        if rep.first_divergence is None:
            return "match"
        where = f"at token {rep.first_divergence}{' (near tie)' if rep.near_tie else ''}"
        return f"ok: differs {where}" if rep.ok else f"**differs** {where}"


class WordErrorRate(ResultCheck):
    """Each file's WER against its reference transcript; the corpus WER at the end, with --max-wer a limit."""

    column = "wer"

    def __init__(self, path: Path, references: dict[str, str], max_wer: float | None):
        self.path, self.references, self.max_wer = path, references, max_wer
        self.described = f"WER against {Path(path).name}"
        self.scores: list[wer.FileWER] = []

    def check(self, done: JobResult) -> Verdict:
        name = Path(done.job.key).name
        if name not in self.references:
            return Verdict(self.column, "**no reference**", [f"{self.path}: no reference transcript for {name}"])
        s = wer.score(name, self.references[name], done.result.text)
        self.scores.append(s)
        cell = f"{s.wer:.1%} ({s.errors}/{s.words})" if s.wer is not None else f"– ({s.errors} words, empty reference)"
        return Verdict(self.column, cell, record={"wer": s.to_dict()})

    def finish(self) -> Totals:
        if not self.scores:
            return Totals()
        total = wer.corpus_wer(self.scores)
        failures = []
        if self.max_wer is not None and total > self.max_wer:
            failures.append(f"word error rate {total:.1%} is above --max-wer {self.max_wer:.1%}")
        return Totals(
            wer.table(self.scores), [f"word error rate over {len(self.scores)} file(s): {total:.1%}"], failures
        )


class ExpectedText(ResultCheck):
    """`--expect TEXT`: every transcript contains it (case-insensitive)."""

    column = "expected"

    def __init__(self, text: str):
        self.text = text
        self.described = f"expected text {text!r}"

    def check(self, done: JobResult) -> Verdict:
        said = done.result.text
        if self.text.lower() in said.lower():
            return Verdict(self.column, "yes")
        return Verdict(self.column, "**no**", [f"{done.job.key}: transcript does not contain {self.text!r}: {said!r}"])


class GoldenTokens(ResultCheck):
    """`--expect-tokens GOLDEN`: the tokens equal the golden file's for this model, device and dtype, as a prefix.
    A golden file without this bundle's model, device and dtype stops the run before any file (read_golden)."""

    column = "golden"

    def __init__(self, path: Path, golden: dict[str, list[int]]):
        self.path, self.golden = path, golden
        self.described = f"golden tokens {Path(path).name}"

    @classmethod
    def read(cls, path: Path, manifest: Manifest) -> GoldenTokens:
        return cls(path, read_golden(path, manifest))

    def check(self, done: JobResult) -> Verdict:
        name, tokens = Path(done.job.key).name, done.result.tokens
        want = self.golden.get(name)
        if want is None:
            return Verdict(self.column, "**none for this file**", [f"{self.path}: no golden tokens for {name}"])
        if (diff := golden_mismatch(want, tokens)) is not None:
            failure = f"{done.job.key}: tokens differ from {Path(self.path).name} at index {diff}"
            return Verdict(self.column, f"**differs** at token {diff}", [failure])
        return Verdict(self.column, f"match ({min(len(want), len(tokens))} tokens)")


def build_checks(
    program: Program, family: Family, options: RunOptions, generation: GenerationOptions
) -> list[ResultCheck]:
    """The checks asked for, in the order each file's are made (and its failures listed)."""
    checks: list[ResultCheck] = []
    # read first: a golden file that cannot check this bundle stops the run before the eager model loads
    golden = GoldenTokens.read(options.expect_tokens, program.manifest) if options.expect_tokens else None
    if options.reference == "eager":
        checks.append(EagerReference.load(program, family, generation))
    if options.max_wer is not None and not options.wer:
        raise RunnerError("--max-wer needs --wer TRANSCRIPTS.json: there is nothing to score without references")
    if options.wer:
        checks.append(WordErrorRate(options.wer, wer.read_references(options.wer), options.max_wer))
    if options.expect:
        checks.append(ExpectedText(options.expect))
    if golden is not None:
        checks.append(golden)
    return checks
