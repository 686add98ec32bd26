"""A linear layer whose weight is stored in 8-bit floating point, e4m3 (`torch.float8_e4m3fn`), with one float32 scale
per output channel (weight-only fp8, `--quant fp8`):

    qweight       float8_e4m3fn [N, K]
    weight_scale  float32 [N]              W[n, k] = qweight[n, k] * weight_scale[n]

compressed-tensors' "float-quantized" layout with strategy "channel" (its `weight`, and `weight_scale` as [N, 1]), so
an FP8 checkpoint's layers are stored as they are (runner/export/fp8_checkpoint.py). Quantising here: each row's
largest magnitude maps to 448, e4m3's largest value; round to nearest.

- **Scales in float32**, whatever the model's dtype: `torch._scaled_mm` takes float32 scales, and a checkpoint's
  are kept exactly.
- **Every CPU method and every decode step dequantise** (W in float32, one rounding to the compute dtype) and
  multiply: what AOTInductor compiles on CPU and CUDA alike, and what the eager reference computes.
- **The CUDA prefill (sm_89+) runs `scaled_mm`** where the export sets `matmul` for its trace: the prompt's
  activations quantised per token at run time (dynamic, as an FP8-dynamic checkpoint's own `input_activations`
  say) and multiplied on the fp8 tensor cores, both scales applied in the epilogue (`_scaled_mm`'s row-wise
  scaling, which gives bf16: hence `--quant fp8` needs bf16). It differs from the dequantised matmul by the
  activations' rounding to e4m3. Its fallback, export/kernels_fp8.py's GEMM over the codes, rounds no activation.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import BundleError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
TINY = torch.finfo(torch.float32).tiny  # a scale for an all-zero row (any scale codes it as zeros)
LAYOUT = "e4m3-channel"  # the manifest's quant record names it
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (sm_89), Hopper and later
MM_MULTIPLE = 16  # _scaled_mm's: K and N multiples of 16


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (codes float8_e4m3fn [N, K], scales float32 [N]): each row's largest magnitude to 448."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(TINY)
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(qweight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype`: codes times scales in float32, one rounding to `dtype` at the end."""
    return (qweight.float() * weight_scale.unsqueeze(1)).to(dtype)


class Fp8Linear(nn.Module):
    """nn.Linear's interface over fp8 storage (module docstring). The bias, if any, stays in the model's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        # (Fp8Linear, x) -> y instead of the dequantised matmul: `scaled_mm`, set while the CUDA prefill is traced
        self.matmul = None

    @classmethod
    def from_linear(cls, lin: nn.Linear, stored: tuple[torch.Tensor, torch.Tensor] | None = None) -> Fp8Linear:
        """`lin` quantised per channel, or holding `stored` (codes, scales [N]) as they are: a checkpoint's, whose
        dequantised values `lin` holds. Same device; the bias kept as it is."""
        w = lin.weight.detach()
        out = cls(lin.in_features, lin.out_features, lin.bias is not None, w.dtype, w.device)
        q, scale = stored if stored is not None else quantize(w)
        if q.dtype != FP8 or tuple(q.shape) != tuple(w.shape) or tuple(scale.shape) != (lin.out_features,):
            raise ValueError(f"fp8: codes {q.dtype} {list(q.shape)}, scales {list(scale.shape)} for {list(w.shape)}")
        with torch.no_grad():
            out.qweight.copy_(q.to(w.device))
            out.weight_scale.copy_(scale.to(w.device, torch.float32))
            if lin.bias is not None:
                out.bias.copy_(lin.bias)
        return out

    def _apply(self, fn, recurse=True):
        """Module.to(dtype) (and .half(), .bfloat16()) casts every floating tensor, e4m3 ones too, which would
        round the float32 scales: here the codes and scales only follow the device (what `fn` does to an empty
        float32 tensor's), the bias takes `fn` as it is."""
        kept = {k: self._buffers.pop(k) for k in ("qweight", "weight_scale")}
        try:
            super()._apply(fn, recurse)
        finally:
            device = fn(torch.empty(0, device=kept["qweight"].device)).device
            for k, t in kept.items():
                self._buffers[k] = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
        return self

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.qweight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is not None:
            return self.matmul(self, x)
        return F.linear(x, self.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3, a scale per output channel"


def scaled_mm(lin: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] through `torch._scaled_mm`: x quantised per row (its largest magnitude to 448), both
    operands e4m3, the float32 accumulator scaled by x's row scales and the weight's channel scales, in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    sx = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_min(TINY)  # [M, 1]
    xq = (x2.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # the weight as [K, N] column-major (a transposed view of the row-major codes), its scales as [1, N]
    y = torch._scaled_mm(xq, lin.qweight.t(), scale_a=sx, scale_b=lin.weight_scale.unsqueeze(0), out_dtype=x.dtype)
    y = y if lin.bias is None else y + lin.bias
    return y.reshape(*x.shape[:-1], lin.out_features)


def fp8_layers(module: nn.Module) -> list[Fp8Linear]:
    return [m for m in module.modules() if isinstance(m, Fp8Linear)]


def scaled_mm_serves(device: str, module: nn.Module, capability: tuple[int, int] | None = None) -> bool:
    """Whether a CUDA prefill runs `module`'s fp8 layers through `scaled_mm`: a CUDA device of sm_89 or later
    (`capability`, else the current device's) and every layer's sizes multiples of 16; elsewhere they dequantise."""
    layers = fp8_layers(module)
    if torch.device(device).type != "cuda" or not layers:
        return False
    if tuple(capability or torch.cuda.get_device_capability()) < MIN_CAPABILITY:
        return False
    return all(m.in_features % MM_MULTIPLE == 0 and m.out_features % MM_MULTIPLE == 0 for m in layers)


@contextlib.contextmanager
def matmul_through(module: nn.Module, matmul) -> Iterator[None]:
    """`module`'s fp8 layers through `matmul` ((Fp8Linear, x) -> y) for the duration (a CUDA prefill's trace); the
    eager model, which the self-check and the reference run, keeps the dequantised matmul."""
    layers = fp8_layers(module)
    for m in layers:
        m.matmul = matmul
    try:
        yield
    finally:
        for m in layers:
            m.matmul = None


def scaled_prefill(module: nn.Module):
    """`module`'s fp8 layers through `scaled_mm` for the duration."""
    return matmul_through(module, scaled_mm)


def check_layout(record: dict) -> None:
    """Raise BundleError for an fp8 record of another layout than this runner reads."""
    if record.get("layout") != LAYOUT:
        raise BundleError(
            f"its fp8 weights are in the {record.get('layout')!r} layout, not {LAYOUT!r}: export it again"
        )


def use_layout(model: nn.Module, record: dict) -> list[str]:
    """Replace the nn.Linear modules the manifest's fp8 `record` names (fnmatch patterns) by empty Fp8Linear ones of
    the same shapes (on the same device, meta included), ready for a bundle's state dict."""
    check_layout(record)
    names = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in record["modules"])
    ]
    for name in names:
        lin = model.get_submodule(name)
        parent, _, child = name.rpartition(".")
        new = Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, lin.weight.dtype, lin.weight.device)
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return names
