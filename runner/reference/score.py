"""Our tokens scored by the eager model (`run --reference eager`): the eager reference teacher-forced on the
tokens we generated, each window's prompt and answer in one decoder call, and every step's logits compared."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from runner.runtime.generate import GenerationOptions, GenerationResult, MultimodalRunner, Segment


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
        return asdict(self)


def compare_with_reference(
    reference: MultimodalRunner,
    windows: list[list[Segment]],
    ours: GenerationResult,
    opts: GenerationOptions,
    dtype: torch.dtype,
) -> ReferenceReport:
    ref = reference.score_windows(windows, ours.window_tokens())
    first, err, scale, tie = None, 0.0, 0.0, False
    for i, (a, b) in enumerate(zip(ours.logits, ref, strict=True)):
        # a family's decoding rules (Whisper's timestamp rules) record the tokens they ruled out as -inf: eager is
        # held to the same rules, and the error is read over the tokens that were allowed
        allowed = torch.isfinite(a)
        b = b.masked_fill(~allowed, float("-inf"))
        step_err = (a - b)[allowed].abs().max().item()
        err = max(err, step_err)
        scale = max(scale, b[allowed].abs().max().item())
        if first is None and opts.temperature == 0 and int(b.argmax()) != ours.tokens[i]:
            first = i
            margin = (b[0, b.argmax()] - b[0, ours.tokens[i]]).item()
            tie = margin <= 2 * step_err
    # fp32 must match exactly; bf16 may flip a token only where eager itself sees a near tie.
    ok = first is None or (dtype != torch.float32 and tie)
    if opts.temperature > 0:
        ok = err <= (1e-3 if dtype == torch.float32 else 5e-2) * max(scale, 1.0)
    return ReferenceReport(first, err, scale, tie, ok)
