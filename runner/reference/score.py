"""Our tokens scored by the eager model (`run --reference eager`): the eager reference teacher-forced on the
tokens we generated, each window's prompt and answer in one decoder call, and every step's logits compared."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from runner.runtime.generate import GenerationOptions, GenerationResult, MultimodalRunner
from runner.runtime.prompt import Segment

# The largest logit error a faithful run of each dtype shows at a step, as a share of that step's logit scale
# (max |eager logit|, at least 1): bf16 keeps 8 significant bits, and its rounding compounds over the layers.
STEP_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class ReferenceReport:
    """Our tokens scored by the eager model under teacher forcing. For greedy decoding, "no divergence" is
    exactly "eager would have generated the same tokens": with the same prefix it picks the same next one."""

    first_divergence: int | None  # index of the first generated token eager would not have picked
    max_logit_error: float  # max |ours - eager| over every generated step
    logit_scale: float  # max |eager logit|, to read the error against
    near_tie: bool  # at the divergence, eager's margin between its pick and ours is within the dtype's tolerance
    ok: bool
    worst_step: int | None = None  # the step whose error is the largest share of its scale
    worst_ratio: float = 0.0  # that share: past STEP_TOLERANCE[dtype], the run is not faithful

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
    return judge(ours.logits, ref, ours.tokens, dtype, greedy=opts.temperature == 0)


def judge(ours: list[torch.Tensor], ref: list[torch.Tensor], tokens: list[int], dtype: torch.dtype, greedy: bool):
    """Each step's logits [1, V] of ours against eager's: every step's error within the dtype's tolerance of that
    step's scale, and (greedy) every token eager's pick, or a near tie at the dtype's precision. The tie is read
    against the tolerance, never against the observed error: garbage logits have an error to excuse any flip."""
    tol = STEP_TOLERANCE.get(dtype, STEP_TOLERANCE[torch.bfloat16])
    first, err, scale, tie, worst, worst_step, faithful = None, 0.0, 0.0, False, 0.0, None, True
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        # a family's decoding rules (Whisper's timestamp rules) record the tokens they ruled out as -inf: eager is
        # held to the same rules, and the error is read over the tokens that were allowed
        allowed = a != float("-inf")  # NaN and +inf are errors, not ruled out
        b = b.masked_fill(~allowed, float("-inf"))
        step_err = (a.float() - b.float())[allowed].abs().max().item()
        step_scale = max(b[allowed].abs().max().item(), 1.0)
        err, scale = max(err, step_err), max(scale, step_scale)
        ratio = step_err / step_scale
        faithful = faithful and ratio <= tol  # a NaN error compares false: not faithful
        if worst_step is None or not ratio <= worst:
            worst, worst_step = ratio, i
        if first is None and greedy and int(b.argmax()) != tokens[i]:
            first = i
            margin = (b[0, b.argmax()] - b[0, tokens[i]]).item()
            tie = dtype != torch.float32 and margin <= 2 * tol * step_scale
    ok = faithful and (first is None or tie)
    return ReferenceReport(first, err, scale, tie, ok, worst_step, worst)
