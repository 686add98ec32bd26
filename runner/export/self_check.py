"""The export's self-check: every compiled method of the staged bundle, loaded through our own delegate from the
bundle's files, against eager on the same inputs; a mismatch aborts the export.

Eager goes first, for every method, and keeps its outputs; then the bundle is loaded. Where the GPU cannot hold the
bundle's weights beside the eager model's (Voxtral-Small-24B on an 80 GB card: 2 × 48.5 GB), the eager model moves
to the host in between, so the check needs one copy of the weights on the device, not two. It is left there: the
export is its last use."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch
from torch import nn

from runner.errors import ExportError
from runner.export.methods import MethodPlan
from runner.runtime.options import RuntimeOptions
from runner.runtime.program import Program
from runner.runtime.weights import free_device_bytes

log = logging.getLogger(__name__)

# Per-dtype tolerance, relative to the reference's largest magnitude. bf16's is wide because two bf16 computations of
# a deep random-init decoder (Inductor's fused kernels, eager's) part by rounding that grows with depth and width
# (the largest presets' come near it); what the check is for (a layout, a position, a missing op) is off by
# the output's own scale.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1}
# Besides the weights, what loading the bundle allocates on the device (the KV cache, the warm-up's activations).
LOAD_HEADROOM = 4 << 30


class Mismatch(ExportError):
    """A compiled method's output differs from eager's past the tolerance: `method`, and `detail` (the error, the
    tolerance, the input shapes)."""

    def __init__(self, method: str, detail: str):
        super().__init__(f"{method}: exported output differs from eager: {detail}")
        self.method, self.detail = method, detail


def check_bundle(
    stage: Path,
    plans: list[MethodPlan],
    model: nn.Module,
    dtype: torch.dtype,
    device: str,
    cache_dir: Path,
    progress=None,
) -> dict[str, float]:
    """Each method's largest relative error against eager (Mismatch past TOLERANCE[dtype]); `progress(what,
    message)` hears of the eager model's move to the host (tens of seconds for the 24B's 48.5 GB)."""
    wants = eager_outputs(plans, model)
    make_room(model, stage, device, progress)
    with Program.load(stage, device=device, options=RuntimeOptions(cache_dir=cache_dir)) as program:
        return {plan.name: compare(program, plan, wants[plan.name], dtype) for plan in plans}


def eager_outputs(plans: list[MethodPlan], model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each plan's reference outputs on its check inputs, in order; a stateful method starts from empty caches."""
    out = {}
    with torch.no_grad():
        for plan in plans:
            if plan.spec.state:
                model.reset_caches()
            out[plan.name] = [(plan.reference or plan.module)(*inputs) for inputs in plan.check_inputs]
    model.reset_caches()
    return out


def make_room(model: nn.Module, stage: Path, device: str, progress=None) -> bool:
    """Move the eager model to the host if the device's free memory cannot take the bundle's weights as well:
    whether it moved (said first through `progress(what, message)`: tens of seconds for the 24B's 48.5 GB)."""
    if device != "cuda":
        return False
    need = sum(p.stat().st_size for p in stage.glob("*.safetensors")) + LOAD_HEADROOM
    free = free_device_bytes()
    if free >= need:
        return False
    why = f"{free / 2**30:.1f} GiB of GPU memory free, the bundle needs {need / 2**30:.1f}"
    log.info("self-check: %s: the eager model moves to the host", why)
    if progress:
        progress("all", f"moving the eager model to the host ({why})")
    model.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    return True


def compare(program: Program, plan: MethodPlan, wants: list[torch.Tensor], dtype: torch.dtype) -> float:
    """The compiled method on the plan's check inputs against eager's outputs: the largest relative error."""
    method = program.methods[plan.name]
    worst = 0.0
    if plan.spec.state:  # a stateful method (the decoder's KV cache): it starts empty, as eager did
        program.reset_state()
    with torch.no_grad():
        for inputs, want in zip(plan.check_inputs, wants, strict=True):
            wanted = want if isinstance(want, tuple) else (want,)  # a method of several outputs: each compared
            for got, w in zip(method(*inputs), wanted):
                err = relative_error(plan.name, got, w)
                worst = max(worst, err)
                if not err <= TOLERANCE[dtype]:
                    shapes = [list(x.shape) for x in inputs]
                    detail = f"max relative error {err:.3g} > {TOLERANCE[dtype]:g} for input shapes {shapes}"
                    raise Mismatch(plan.name, detail)
    return worst


def relative_error(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ExportError(
            f"{name}: exported output {got.dtype}{list(got.shape)} != eager {want.dtype}{list(want.shape)}"
        )
    scale = want.float().abs().max().item() or 1.0
    return (got.float() - want.float()).abs().max().item() / scale
