"""What every family's export plan is made of: a method's manifest entry, its KV-cache state, how it is traced (the
log-mel preprocessor with its chunk count dynamic), and the weights it carries (what they take on disk)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from runner.audio import N_FRAMES, N_SAMPLES
from runner.bundle import MethodSpec, StateSpec, TensorSpec
from runner.models.mel import LogMelSpectrogram


def dim(lo: int, hi: int, multiple: int = 1) -> dict:
    return {"min": lo, "max": hi, **({"multiple": multiple} if multiple > 1 else {})}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def method_spec(name: str, inputs, outputs, state: dict[str, StateSpec] | None = None) -> MethodSpec:
    """A method's manifest entry: `<name>.so` and `<name>.safetensors`; inputs/outputs as (name, dtype, shape)."""
    return MethodSpec(
        name,
        f"{name}.so",
        f"{name}.safetensors",
        [TensorSpec(*x) for x in inputs],
        [TensorSpec(*x) for x in outputs],
        state or {},
    )


def kv_cache_state(n_layers: int, shape: list[int], dtype: torch.dtype) -> dict[str, StateSpec]:
    """The decoder's per-layer K and V cache buffers, as the text_decoder method's state."""
    return {
        f"layers.{i}.self_attn.kv_cache.{kv}": StateSpec(list(shape), dtype_name(dtype))
        for i in range(n_layers)
        for kv in ("k_cache", "v_cache")
    }


@dataclass
class MethodPlan:
    """One method to export: its module, how to trace it, its manifest entry, and the self-check's inputs."""

    name: str
    module: nn.Module
    example: tuple[torch.Tensor, ...]
    dynamic_shapes: object
    spec: MethodSpec
    check_inputs: list[tuple[torch.Tensor, ...]]  # self-check inputs (more than one shape per method)
    reference: nn.Module | None = None  # what the self-check compares with, if not `module` run eagerly
    export: Callable[[], torch.export.ExportedProgram] | None = None  # instead of torch.export.export(...)
    key_extra: dict = field(default_factory=dict)  # what this method's compile depends on beyond the family's key
    # after its compile: free what only its trace needed (state traced at full size, which torch keeps alive)
    release: Callable[[], None] | None = None
    # compiled instead when this plan's compile fails (a hand-written kernel an older torch cannot compile): the
    # same method, spec and weights; the manifest's `model.fallbacks` names the method and why
    fallback: MethodPlan | None = None
    # the fallback serves a failed self-check too, not only a failed compile: for a plan whose check at the dtype's
    # tolerance can measure rounding's chaos rather than the compile (the fp8 prefill's e4m3 activations)
    fallback_on_mismatch: bool = False
    # compiled as it was traced, size-obliviously (a batch dim of 1..max, traced with 2 rows): Inductor's re-trace
    # otherwise takes the example's 2 as B >= 2, and where max is 2 compiles for exactly 2 rows
    size_oblivious: bool = False

    def exported(self) -> torch.export.ExportedProgram:
        if self.export is not None:
            return self.export()
        return torch.export.export(self.module, self.example, dynamic_shapes=self.dynamic_shapes, strict=False)


def preprocessor_plan(n_mels: int, device: torch.device, max_chunks: int, check_inputs) -> MethodPlan:
    """The log-mel preprocessor, waveform f32 [k * 480000] -> mel f32 [k, n_mels, 3000], k = 1..max_chunks: one
    log-mel over the whole waveform (one STFT, one global max), its frames cut into chunks. The manifest gives
    the chunk dims as ranges even when max_chunks is 1."""
    module = LogMelSpectrogram(n_mels).to(device)
    wave, mel = dim(N_SAMPLES, max_chunks * N_SAMPLES, N_SAMPLES), [dim(1, max_chunks), n_mels, N_FRAMES]
    spec = method_spec("preprocessor", [("waveform", "float32", [wave])], [("mel", "float32", mel)])
    return MethodPlan(
        "preprocessor", module, (), None, spec, check_inputs, export=lambda: export_mel(module, max_chunks)
    )


def export_mel(module: LogMelSpectrogram, max_chunks: int) -> torch.export.ExportedProgram:
    """torch.export with the waveform length dynamic in whole chunks: N_SAMPLES * chunks, 1 <= chunks <= max.

    The example input has 2 chunks: with 1 the exporter would specialise the dimension to a constant.
    Use this (not a bare torch.export.export) so that the program also accepts one chunk.
    """
    if max_chunks < 1:
        raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
    device = module.window.device  # export on the device the program will run on
    if max_chunks == 1:  # nothing to vary: a static one-chunk program
        return torch.export.export(module, (torch.zeros(N_SAMPLES, device=device),))
    chunks = torch.export.Dim("chunks", min=1, max=max_chunks)
    example = torch.zeros(2 * N_SAMPLES, device=device)
    # The trace guards on "chunks != 1" (stft's reshapes; size-1 dims have special strides); size-oblivious
    # tracing takes the general branch instead, so the one program also serves a single chunk.
    # (ep.range_constraints then shows chunks >= 2, but the input's own range is N_SAMPLES * [1, max].)
    with fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(module, (example,), dynamic_shapes={"waveform": {0: N_SAMPLES * chunks}})


def _method_tensors(plan: MethodPlan, weights_filter=None) -> dict[str, torch.Tensor]:
    sd = dict(plan.module.named_parameters())
    sd.update((k, b) for k, b in plan.module.named_buffers() if k not in plan.spec.state)
    return {k: v for k, v in sd.items() if weights_filter is None or weights_filter(plan.name, k)}


def method_weights(plan: MethodPlan, weights_filter=None) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the method module except the state the runtime allocates, and those
    `weights_filter(method, fqn)` drops."""
    return {k: v.detach().contiguous() for k, v in _method_tensors(plan, weights_filter).items()}


class TracedSlots:
    """The modules a method was traced over, with its state sized for every slot (the batched decoder's slot
    caches, the streaming steps' stream rows): torch keeps the last trace alive after the compile, so their state
    buffers (those named under `prefix`) are freed once the method is compiled. Buffers the modules reach but do
    not own (the eager model's caches, through its layers) are not theirs to free."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.modules: list[nn.Module] = []

    def add(self, module: nn.Module) -> nn.Module:
        self.modules.append(module)
        return module

    def slot_buffers(self) -> list[torch.Tensor]:
        return [b for m in self.modules for n, b in m.named_buffers() if n.startswith(self.prefix)]

    def release(self) -> None:
        for buf in self.slot_buffers():
            buf.untyped_storage().resize_(0)  # freed in place, whoever still refers to it
        self.modules.clear()


# room for the methods' `.so` files (the weights are not in them) and their compiles' scratch, all in the stage
COMPILE_ALLOWANCE = 256 << 20


def bytes_needed(plans: list[MethodPlan], weights_filter) -> int:
    """What the bundle will take on disk: each weights file once (methods may share one), and the compiled code."""
    files: dict[str, int] = {}
    for plan in plans:
        if plan.spec.weights not in files:
            files[plan.spec.weights] = sum(v.nbytes for v in _method_tensors(plan, weights_filter).values())
    return sum(files.values()) + COMPILE_ALLOWANCE
