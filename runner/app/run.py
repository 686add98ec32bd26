"""The `run` verb: several audio files through one loaded program, streamed text, stats, and the checks the
e2e job relies on (golden tokens, an expected substring, the eager reference)."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.app import wer
from runner.errors import RunnerError
from runner.families import family_for
from runner.reference import eager_engine
from runner.runtime.engine import ProgramEngine
from runner.runtime.generate import GenerationOptions, GenerationResult, MultimodalRunner, Segment
from runner.runtime.program import Program
from runner.stats import Stats


@dataclass(frozen=True)
class ReferenceReport:
    """Our tokens scored by the eager model under teacher forcing. For greedy decoding, "no divergence" is
    exactly "eager would have generated the same tokens": with the same prefix it picks the same next one."""

    first_divergence: int | None  # index of the first generated token eager would not have picked
    max_logit_error: float  # max |ours - eager| over every generated step
    logit_scale: float  # max |eager logit|, to read the error against
    near_tie: bool  # at the divergence, eager's margin between its pick and ours is within the logit error
    ok: bool

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def compare_with_reference(
    reference: MultimodalRunner,
    windows: list[list[Segment]],
    ours: GenerationResult,
    opts: GenerationOptions,
    dtype: torch.dtype,
) -> ReferenceReport:
    forced = GenerationOptions(max_new_tokens=len(ours.tokens), record_logits=True)
    ref = reference.generate_windows(windows, forced, forced=ours.window_tokens())
    first, err, scale, tie = None, 0.0, 0.0, False
    for i, (a, b) in enumerate(zip(ours.logits, ref.logits)):
        err = max(err, (a - b).abs().max().item())
        scale = max(scale, b.abs().max().item())
        if first is None and opts.temperature == 0 and int(b.argmax()) != ours.tokens[i]:
            first = i
            margin = (b[0, b.argmax()] - b[0, ours.tokens[i]]).item()
            tie = margin <= 2 * (a - b).abs().max().item()
    # fp32 must match exactly; bf16 may flip a token only where eager itself sees a near tie.
    ok = first is None or (dtype != torch.float32 and tie)
    if opts.temperature > 0:
        ok = err <= (1e-3 if dtype == torch.float32 else 5e-2) * max(scale, 1.0)
    return ReferenceReport(first, err, scale, tie, ok)


def run_files(program: Program, args: argparse.Namespace, load: Stats) -> int:
    family = family_for(program.bundle_dir, program.manifest.model)
    tok = family.tokenizer
    engine = ProgramEngine(program, args.runtime, cross_attention=family.cross_attention)
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
    references = wer.read_references(args.wer) if getattr(args, "wer", None) else None
    scores: list[wer.FileWER] = []
    golden = _read_golden(args.expect_tokens, program) if args.expect_tokens else None
    text_out = sys.stderr if args.json else sys.stdout  # with --json, stdout carries only the JSON lines
    failures: list[str] = []
    dtype = getattr(torch, program.manifest.dtype)

    for path in args.audio:
        windows = family.prompts(path, args.prompt, args.language, engine.max_audio_chunks)
        if not args.json:
            print(f"== {path}", file=sys.stderr)
        stats = copy.copy(load)

        def stream(text: str) -> None:
            text_out.write(text)
            text_out.flush()

        result = runner.generate_windows(windows, opts, on_text=stream, stats=stats)
        text_out.write("\n")
        if result.stop_reason == "context":
            print(
                f"note: {path}: stopped at the end of the context ({program.manifest.model['max_seq_len']} "
                "tokens); export with a larger --max-seq-len for longer output",
                file=sys.stderr,
            )
        record = {
            "audio": str(path),
            "text": result.text,
            "prompt_ids": result.prompt_ids,
            "tokens": result.tokens,
            "stop_reason": result.stop_reason,
            "stats": stats.to_dict(),
        }
        if reference is not None:
            rep = compare_with_reference(reference, windows, result, opts, dtype)
            record["reference"] = rep.to_dict()
            print(
                f"eager reference: {'match' if rep.first_divergence is None else f'first divergence at token {rep.first_divergence}'}"
                f", max logit error {rep.max_logit_error:.3g} (logit scale {rep.logit_scale:.3g})"
                f"{', near tie' if rep.near_tie else ''}",
                file=sys.stderr,
            )
            if not rep.ok:
                failures.append(f"{path}: tokens differ from the eager reference at token {rep.first_divergence}")
        if references is not None:
            if Path(path).name not in references:
                failures.append(f"{args.wer}: no reference transcript for {Path(path).name}")
            else:
                scores.append(wer.score(Path(path).name, references[Path(path).name], result.text))
                record["wer"] = scores[-1].to_dict()
        if args.expect and args.expect.lower() not in result.text.lower():
            failures.append(f"{path}: transcript does not contain {args.expect!r}: {result.text!r}")
        if golden is not None:
            want = golden.get(Path(path).name)
            if want is None:
                failures.append(f"{args.expect_tokens}: no golden tokens for {Path(path).name}")
            elif (diff := golden_mismatch(want, result.tokens)) is not None:
                failures.append(f"{path}: tokens differ from {args.expect_tokens.name} at index {diff}")
        print(stats.observer_line(), file=sys.stderr)
        for line in stats.human_lines():
            print(line, file=sys.stderr)
        if args.json:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    if scores:
        for line in wer.table(scores):
            print(line, file=sys.stderr)
        total = wer.corpus_wer(scores)
        if getattr(args, "max_wer", None) is not None and total > args.max_wer:
            failures.append(f"word error rate {total:.1%} is above --max-wer {args.max_wer:.1%}")
    if failures:
        for f in failures[:-1]:
            print(f"error: {f}", file=sys.stderr)
        raise RunnerError(failures[-1])
    return 0


def golden_mismatch(golden: list[int], ours: list[int]) -> int | None:
    """The index of the first token where ours and the golden ones differ, or None. Compared as a prefix, over
    the tokens both have, so any --max-new-tokens can be checked. Stopping early at </s> is no free pass: the
    </s> is one of our tokens, compared with the golden token at its index."""
    return next((i for i, (a, b) in enumerate(zip(golden, ours)) if a != b), None)


def _read_golden(path: Path, program: Program) -> dict[str, list[int]] | None:
    """Golden tokens are per model (weights digest) and per device-dtype: another bundle's numerics may
    legitimately pick other tokens, so for those the eager reference is the check."""
    try:
        data = json.loads(Path(path).read_text())
        digest, by_kind = data["weights_digest"], data["tokens"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise RunnerError(f"{path}: not a golden-token file ({e})") from None
    m = program.manifest
    kind = f"{m.device}-{m.dtype}"
    if digest != m.model["source"]["weights_digest"] or kind not in by_kind:
        print(
            f"note: {path} holds no golden tokens for this model on {kind}; checking against --reference only",
            file=sys.stderr,
        )
        return None
    return {k: list(v) for k, v in by_kind[kind].items()}
