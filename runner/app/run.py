"""The `run` verb: several audio files through one loaded program, streamed text, stats, and the checks the
e2e job relies on (golden tokens, an expected substring, the eager reference); with a job summary file
(GITHUB_STEP_SUMMARY, read by the CLI), a table of them, one row per file."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from runner.app import wer
from runner.app.e2e_summary import E2ESummary, FileRow, md_text
from runner.app.folder import Progress, Work
from runner.errors import RunnerError
from runner.families import family_for
from runner.reference import eager_engine
from runner.reference.score import ReferenceReport, compare_with_reference
from runner.runtime.batch import JOB_ERRORS, Job, JobResult, generate_many
from runner.runtime.engine import ProgramEngine
from runner.runtime.generate import GenerationOptions, GenerationResult, MultimodalRunner
from runner.runtime.program import Program
from runner.stats import Stats, now_ms


def _reference_cell(rep: ReferenceReport, opts: GenerationOptions) -> str:
    if opts.temperature > 0:
        return f"{'ok' if rep.ok else '**logits differ**'} (max logit error {rep.max_logit_error:.2g})"
    if rep.first_divergence is None:
        return "match"
    where = f"at token {rep.first_divergence}{' (near tie)' if rep.near_tie else ''}"
    return f"ok: differs {where}" if rep.ok else f"**differs** {where}"


def run_files(program: Program, args: argparse.Namespace, load: Stats, work: Work, live: bool = False) -> int:
    """Every file of `work` through one loaded program, `--batch` at a time; each file's record to stdout
    (--json) and to --out as it finishes. `live`: stderr is a terminal (the progress bar is drawn)."""
    family = family_for(program.bundle_dir, program.manifest.model)
    if getattr(family, "stream_only", False):  # its methods are streaming steps (runner/families/voxtral_realtime)
        raise RunnerError(f"{program.bundle_dir}: a streaming bundle; use `python -m runner stream`")
    tok = family.tokenizer
    engine = ProgramEngine(program, args.runtime, cross_attention=family.cross_attention)
    t0 = now_ms()
    if args.runtime.warm_up and engine.warm_up():  # part of the load: the first file pays no first-call costs
        load.model_load_end_ms = now_ms()
        load.warm_up_ms = load.model_load_end_ms - t0
    runner = MultimodalRunner(engine, tok, family.audio_id)
    opts = GenerationOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        min_new_tokens=args.min_new_tokens,
        record_logits=args.reference is not None,
    )
    reference = None
    if args.reference == "eager":
        reference = MultimodalRunner(eager_engine(program.bundle_dir, program.manifest), tok, family.audio_id)
    if getattr(args, "max_wer", None) is not None and not getattr(args, "wer", None):
        raise RunnerError("--max-wer needs --wer TRANSCRIPTS.json: there is nothing to score without references")
    references = wer.read_references(args.wer) if getattr(args, "wer", None) else None
    scores: list[wer.FileWER] = []
    golden = _read_golden(args.expect_tokens, program) if args.expect_tokens else None
    text_out = sys.stderr if args.json else sys.stdout  # with --json, stdout carries only the JSON lines
    failures: list[str] = []
    dtype = getattr(torch, program.manifest.dtype)
    paths = work.todo
    summary = _summary_for(program, args, opts, len(paths), golden_missing=bool(args.expect_tokens) and golden is None)
    stopped: BaseException | None = None
    # With --out the records are the output: a progress display instead of each file's text and stats. Text
    # streams as it is generated only one file at a time (a batch's files finish in any order).
    quiet = work.out is not None
    progress = Progress(len(paths), live) if quiet else None
    say = progress.note if progress is not None else (lambda line: print(line, file=sys.stderr))
    announced: set[str] = set()  # failures already printed as they happened

    def stream(text: str) -> None:
        text_out.write(text)
        text_out.flush()

    def emit(record: dict) -> None:
        if work.out is not None:
            work.out.append(record)
        if args.json:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    streaming = args.batch == 1 and not quiet
    results = file_results(
        runner, family, paths, args, opts, load, engine.max_audio_chunks, on_text=stream if streaming else None
    )
    try:
        with progress if progress is not None else contextlib.nullcontext():
            for done in results:
                path = done.job.key
                if done.error is not None:  # this file's fault: its record, then the next
                    e = done.error
                    msg = str(e) if str(path) in str(e) else f"{path}: {e}"  # the line names the file at fault
                    failures.append(msg)
                    summary.rows.append(FileRow(Path(path).name, f"**error**: {md_text(msg)[:120]}"))
                    if quiet:
                        say(f"error: {msg}")
                        announced.add(msg)
                        progress.advance(0.0, failed=True)
                    emit({"audio": str(path), "error": msg})
                    continue
                result = done.result
                stats = result.stats
                if streaming:
                    text_out.write("\n")
                elif not quiet:
                    if not args.json:
                        print(f"== {path}", file=sys.stderr)
                    stream(result.text + "\n")
                row = FileRow(Path(path).name, result.text)
                if result.stop_reason == "context":
                    say(
                        f"note: {path}: stopped at the end of the context ({program.manifest.model['max_seq_len']} "
                        "tokens); export with a larger --max-seq-len for longer output"
                    )
                record = {
                    "audio": str(path),
                    "text": result.text,
                    "prompt_ids": result.prompt_ids,
                    "tokens": result.tokens,
                    "stop_reason": result.stop_reason,
                    "stats": stats.to_dict(),
                    "windows": window_records(result),
                }
                if len(result.parts) > 1 and not args.json and not quiet:
                    for line in window_lines(result):
                        print(line, file=sys.stderr)
                if reference is not None:
                    rep = compare_with_reference(reference, done.job.windows, result, opts, dtype)
                    record["reference"] = rep.to_dict()
                    row.reference = _reference_cell(rep, opts)
                    if not quiet:
                        print(
                            f"eager reference: {'match' if rep.first_divergence is None else f'first divergence at token {rep.first_divergence}'}"
                            f", max logit error {rep.max_logit_error:.3g} (logit scale {rep.logit_scale:.3g})"
                            f"{', near tie' if rep.near_tie else ''}",
                            file=sys.stderr,
                        )
                    if not rep.ok:
                        failures.append(
                            f"{path}: tokens differ from the eager reference at token {rep.first_divergence}"
                        )
                if references is not None:
                    if Path(path).name not in references:
                        failures.append(f"{args.wer}: no reference transcript for {Path(path).name}")
                        row.wer = "**no reference**"
                    else:
                        scores.append(wer.score(Path(path).name, references[Path(path).name], result.text))
                        record["wer"] = scores[-1].to_dict()
                        row.wer = _wer_cell(scores[-1])
                if args.expect:
                    found = args.expect.lower() in result.text.lower()
                    row.expected = "yes" if found else "**no**"
                    if not found:
                        failures.append(f"{path}: transcript does not contain {args.expect!r}: {result.text!r}")
                if golden is not None:
                    want = golden.get(Path(path).name)
                    if want is None:
                        failures.append(f"{args.expect_tokens}: no golden tokens for {Path(path).name}")
                        row.golden = "**none for this file**"
                    elif (diff := golden_mismatch(want, result.tokens)) is not None:
                        failures.append(f"{path}: tokens differ from {args.expect_tokens.name} at index {diff}")
                        row.golden = f"**differs** at token {diff}"
                    else:
                        row.golden = f"match ({min(len(want), len(result.tokens))} tokens)"
                summary.rows.append(row)
                if quiet:
                    progress.advance(stats.audio_seconds, failed=False)
                else:
                    print(stats.observer_line(), file=sys.stderr)
                    for line in stats.human_lines():
                        print(line, file=sys.stderr)
                emit(record)

        if scores:
            for line in wer.table(scores):
                print(line, file=sys.stderr)
            total = wer.corpus_wer(scores)
            summary.notes.append(f"word error rate over {len(scores)} file(s): {total:.1%}")
            if getattr(args, "max_wer", None) is not None and total > args.max_wer:
                failures.append(f"word error rate {total:.1%} is above --max-wer {args.max_wer:.1%}")
    except BaseException as e:  # the files done so far still go to the summary, which says where it stopped
        stopped = e
        if quiet and isinstance(e, KeyboardInterrupt):
            print(
                f"note: stopped: {progress.done} of {len(paths)} file(s) have their record in {work.out.path}; the "
                "same command again does the rest",
                file=sys.stderr,
            )
        raise
    finally:
        if args.env.step_summary:
            # backslashreplace: a file name that is not UTF-8 must not fail the summary of the others
            with open(args.env.step_summary, "a", encoding="utf-8", errors="backslashreplace") as f:
                f.write(summary.markdown(failures, stopped))
    if not failures:
        if quiet:
            print(f"done: {progress.summary()}; records in {work.out.path}", file=sys.stderr)
        return 0
    if not quiet:
        for f in failures[:-1]:
            print(f"error: {f}", file=sys.stderr)
        raise RunnerError(failures[-1])
    # each bad file's line was printed as it failed; what else failed (checks, WER) is said once here
    later = [f for f in failures if f not in announced]
    for f in later[:MAX_ERROR_LINES]:
        print(f"error: {f}", file=sys.stderr)
    more = f" ({len(later) - MAX_ERROR_LINES} more not shown)" if len(later) > MAX_ERROR_LINES else ""
    raise RunnerError(f"{progress.summary()}; {len(failures)} failure(s){more}; records in {work.out.path}")


MAX_ERROR_LINES = 10  # with --out, the check failures listed at the end (each bad file's is its record)


def file_results(
    runner: MultimodalRunner,
    family,
    paths: list[Path],
    args: argparse.Namespace,
    opts: GenerationOptions,
    load: Stats,
    max_audio_chunks: int,
    on_text: Callable[[str], None] | None = None,
) -> Iterator[JobResult]:
    """Each file's result as it finishes (`generate_many`, `--batch` at a time). A file whose audio cannot be read
    fails before it is a job; its result comes out ahead of the next finished one. With `on_text` the files run
    one at a time with their text streamed as it is generated."""
    failed: deque[JobResult] = deque()

    def jobs() -> Iterator[Job]:
        for path in paths:
            if on_text is not None and not args.json:
                print(f"== {path}", file=sys.stderr)
            try:
                windows = family.prompts(path, args.prompt, args.language, max_audio_chunks)
            except JOB_ERRORS as e:
                failed.append(JobResult(Job(path, []), None, e))
                continue
            yield Job(path, windows, load)

    results = generate_many(runner, jobs(), opts, args.batch, on_text=on_text)
    for r in results:
        while failed:
            yield failed.popleft()
        yield r
    while failed:
        yield failed.popleft()


def window_records(result: GenerationResult) -> list[dict]:
    """Each prompt window's own record: where it lies in the audio, its text, tokens, stop reason and stats.
    Windows are consecutive, so each starts where the one before ends."""
    out, start = [], 0.0
    for part, tokens in zip(result.parts, result.window_tokens()):
        end = start + part.stats.audio_seconds
        out.append(
            {
                "start_s": round(start, 3),
                "end_s": round(end, 3),
                "text": part.text,
                "tokens": tokens,
                "stop_reason": part.stop_reason,
                "stats": part.stats.to_dict(),
            }
        )
        start = end
    return out


def window_lines(result: GenerationResult) -> list[str]:
    return [
        f"window {i + 1}/{len(result.parts)}: {w['start_s']:.1f}-{w['end_s']:.1f} s, {len(w['tokens'])} tokens "
        f"({w['stop_reason']}), prompt {w['stats']['prompt_tokens']} tokens, "
        f"{w['stats']['prefill_tokens_per_s']:.0f}/{w['stats']['decode_tokens_per_s']:.1f} tokens/s prefill/decode"
        for i, w in enumerate(window_records(result))
    ]


def _summary_for(program: Program, args: argparse.Namespace, opts: GenerationOptions, files: int, golden_missing: bool):
    m = program.manifest
    sampling = "greedy" if opts.temperature == 0 else f"temperature {opts.temperature:g}, top-p {opts.top_p:g}"
    checks = [
        *([f"golden tokens `{Path(args.expect_tokens).name}`"] if args.expect_tokens else []),
        *([f"expected text {md_text(repr(args.expect))}"] if args.expect else []),
        *([f"WER against `{Path(args.wer).name}`"] if getattr(args, "wer", None) else []),
        *(["the eager reference"] if args.reference else []),
    ]
    summary = E2ESummary(
        title=f"e2e: `{program.bundle_dir.name}` ({m.device}, {m.dtype}), {files} file(s)",
        settings=f"{sampling}, at most {opts.max_new_tokens or 'the default number of'} new tokens; checked: "
        f"{', '.join(checks) or 'nothing'}",
        files=files,
    )
    if golden_missing:
        summary.notes.append(
            f"golden tokens: `{Path(args.expect_tokens).name}` has none for this model on {m.device}-{m.dtype}; "
            "checked against the eager reference only"
        )
    return summary


def _wer_cell(s: wer.FileWER) -> str:
    return f"{s.wer:.1%} ({s.errors}/{s.words})" if s.wer is not None else f"– ({s.errors} words, empty reference)"


def golden_mismatch(golden: list[int], ours: list[int]) -> int | None:
    """The index of the first token where ours and the golden ones differ, or None. Compared as a prefix, over
    the tokens both have, so any --max-new-tokens can be checked. Stopping early at </s> is no free pass: the
    </s> is one of our tokens, compared with the golden token at its index."""
    return next((i for i, (a, b) in enumerate(zip(golden, ours)) if a != b), None)


def _read_golden(path: Path, program: Program) -> dict[str, list[int]] | None:
    """Golden tokens are per model (weights digest) and per device-dtype: another bundle's numerics may
    legitimately pick other tokens, so for those the eager reference is the check."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, or not UTF-8
        raise RunnerError(f"{path}: not a golden-token file ({' '.join(str(e).split())[:200]})") from None
    shape = '{"weights_digest": "...", "tokens": {"DEVICE-DTYPE": {"FILE": [ids]}}}'
    by_kind = data.get("tokens") if isinstance(data, dict) else None
    if not (isinstance(by_kind, dict) and isinstance(data.get("weights_digest"), str)) or not all(
        isinstance(files, dict)
        and all(isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids) for ids in files.values())
        for files in by_kind.values()
    ):
        raise RunnerError(f"{path}: not a golden-token file (expected {shape})")
    digest, m = data["weights_digest"], program.manifest
    kind = f"{m.device}-{m.dtype}"
    if digest != (m.model.get("source") or {}).get("weights_digest") or kind not in by_kind:
        print(
            f"note: {path} holds no golden tokens for this model on {kind}; checking against --reference only",
            file=sys.stderr,
        )
        return None
    return {k: list(v) for k, v in by_kind[kind].items()}
