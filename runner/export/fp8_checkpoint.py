"""Compressed-tensors FP8 checkpoints, as RedHatAI/Voxtral-Mini-3B-2507-FP8-dynamic publishes them: config.json's
`quantization_config` says quant_method "compressed-tensors", format "float-quantized", and each quantised linear
layer's `weight` is float8_e4m3fn with a `weight_scale` beside it, one per output channel ([out, 1], float32 or
bf16): W = weight * weight_scale. The layers it leaves out (its `ignore`: lm_head, the audio tower) are plain.

Read into the eager model dequantised (W in float32), as from any checkpoint, so `--quant none` (or int4) exports
it as it would a bf16 one; the e4m3 codes and scales are kept beside it by our module names (q/k/v and gate/up
concatenated as the model fuses them), and `--quant fp8` stores them as they are instead of quantising again.

What the config must say, each field checked (one line naming config.json otherwise): weights of 8 bits, type
float, symmetric, a scale per output channel (strategy "channel", no group or block), static; input activations
absent or dynamic (FP8-dynamic: per-token scales made at run time, none stored; the CUDA prefill does the same);
no output activations, no quantised KV cache, no sparsity. Every fp8 tensor needs its scale and every scale its
fp8 weight; an error names the safetensors file that holds the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runner.errors import ExportError
from runner.json_file import read_json_object
from runner.models.fp8_linear import FP8, dequantize
from runner.models.fused import FUSED

QUANT_METHOD = "compressed-tensors"
FORMAT = "float-quantized"
MIXED = "mixed-precision"  # a top-level format whose groups each name their own
SCALE = ".weight_scale"
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WHERE = "quantization_config."
_ABSENT = object()

Stored = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (codes float8_e4m3fn [N, K], scales f32 [N])


def read_config(config_file: Path) -> dict | None:
    """config.json's quantization_config, checked; None where it has none."""
    q = read_json_object(config_file, ExportError).get("quantization_config")
    if q is None:
        return None
    try:
        _check_config(q)
    except ExportError as e:
        raise ExportError(f"{config_file}: {e}") from None
    return q


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _want(d: dict, key: str, where: str, ok, what: str, default=_ABSENT):
    """d[key] if ok(d[key]) (`default` standing in where the key is absent or null), else one line naming the field."""
    value = d.get(key)
    if value is None:
        if default is _ABSENT:
            raise ExportError(f"{where}{key} is missing (expected {what})")
        value = default
    if not ok(value):
        raise ExportError(f"{where}{key}: {_show(value)} is not read (expected {what})")
    return value


def _object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ExportError(f"{where}: {_show(value)} is not a JSON object")
    return value


def _check_config(q) -> None:
    w = _WHERE
    _object(q, "quantization_config")
    _want(q, "quant_method", w, lambda v: v == QUANT_METHOD, f"{QUANT_METHOD!r}")
    top = _want(q, "format", w, lambda v: v in (FORMAT, MIXED), f"{FORMAT!r}: fp8 weights, stored as fp8")
    _want(q, "quantization_status", w, lambda v: v == "compressed", "'compressed'", default="compressed")
    _want(q, "kv_cache_scheme", w, lambda v: v is None, "null: a KV cache in the model's dtype", default=None)
    _want(q, "sparsity_config", w, lambda v: not v, "null or {}: dense weights", default={})
    _want(q, "ignore", w, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of names", [])
    groups = _object(_want(q, "config_groups", w, lambda v: bool(v), "a non-empty object"), w + "config_groups")
    for name, group in groups.items():
        where = f"{w}config_groups.{name}"
        g = _object(group, where)
        _want(
            g, "format", where + ".", lambda v: v == FORMAT, f"{FORMAT!r}", default=_ABSENT if top == MIXED else FORMAT
        )
        _want(g, "targets", where + ".", lambda v: isinstance(v, list) and v and all(isinstance(x, str) for x in v),
              "a non-empty list of names")  # fmt: skip
        _check_weights(_object(_want(g, "weights", where + ".", bool, "an object"), where + ".weights"), where)
        acts = g.get("input_activations")
        if acts is not None:  # static activation scales would be tensors this runner does not read
            a, at = _object(acts, where + ".input_activations"), where + ".input_activations."
            _want(a, "type", at, lambda v: v == "float", "'float'")
            _want(a, "num_bits", at, lambda v: v == 8, "8")
            _want(a, "dynamic", at, lambda v: v is True, "true: per-token scales made at run time, none stored")
        _want(g, "output_activations", where + ".", lambda v: v is None, "null", default=None)


def _check_weights(weights: dict, where: str) -> None:
    at = where + ".weights."
    _want(weights, "num_bits", at, lambda v: v == 8, "8")
    _want(weights, "type", at, lambda v: v == "float", "'float': e4m3")
    _want(weights, "symmetric", at, lambda v: v is True, "true", default=True)
    _want(weights, "strategy", at, lambda v: v == "channel", "'channel': one scale per output channel")
    _want(weights, "group_size", at, lambda v: v is None, "null", default=None)
    _want(weights, "block_structure", at, lambda v: v is None, "null", default=None)
    _want(weights, "dynamic", at, lambda v: v is False, "false: scales stored with the weights", default=False)


def _is_fp8(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.element_size() == 1


def dequantize_state(
    state: dict[str, torch.Tensor], origins: dict[str, Path], config_file: Path, config: dict | None
) -> tuple[dict[str, torch.Tensor], Stored]:
    """(the state with each fp8 weight dequantised to float32 and its scale taken out, the codes and scales by
    module name as the file spells it). `config`: read_config's; without one, an fp8 tensor is an error."""
    scales = sorted(k for k in state if k.endswith(SCALE))
    fp8 = sorted(k for k, v in state.items() if _is_fp8(v))
    if config is None:
        if fp8 or scales:
            k = (fp8 or scales)[0]
            raise ExportError(
                f"{origins.get(k, config_file)}: {k} is an fp8 weight or its scale, but {config_file} has no "
                f"quantization_config (an FP8 checkpoint is read with compressed-tensors' {FORMAT!r} one)"
            )
        return state, {}
    out, stored = dict(state), {}
    for key in scales:
        module = key[: -len(SCALE)]
        q, s = state.get(module + ".weight"), state[key]
        where = origins.get(key, config_file)
        if q is None:
            raise ExportError(f"{where}: {key} has no {module}.weight beside it")
        stored[module] = (q, _check_pair(module, q, s, where, origins.get(module + ".weight", where)))
        out[module + ".weight"] = dequantize(q, stored[module][1], torch.float32)
        del out[key]
    orphan = next((k for k in fp8 if k.removesuffix(".weight") not in stored), None)
    if orphan is not None:
        raise ExportError(f"{origins.get(orphan, config_file)}: {orphan} is fp8 with no weight_scale beside it")
    if not stored:
        raise ExportError(f"{config_file}: quantization_config says {FORMAT}, but no weight is fp8 with a weight_scale")
    return out, stored


def _check_pair(module: str, q: torch.Tensor, s: torch.Tensor, where: Path, q_where: Path) -> torch.Tensor:
    """The scales of `module` as float32 [N], after checking both tensors; one line naming the file otherwise."""
    if q.dtype != FP8 or q.dim() != 2:
        raise ExportError(f"{q_where}: {module}.weight is {q.dtype} {list(q.shape)}, expected a float8_e4m3fn matrix")
    n = q.shape[0]
    if s.dtype not in SCALE_DTYPES or tuple(s.shape) not in ((n, 1), (n,)):
        raise ExportError(
            f"{where}: {module}{SCALE} is {s.dtype} {list(s.shape)}, expected float32 or bf16 [{n}, 1]: one scale "
            "per output channel"
        )
    scale = s.float().reshape(n)
    if not bool(torch.isfinite(scale).all() and (scale >= 0).all()):
        raise ExportError(f"{where}: {module}{SCALE} holds a scale that is negative, infinite or NaN")
    if bool(torch.isnan(q.float()).any()):
        raise ExportError(f"{q_where}: {module}.weight holds NaN codes")
    return scale


def fuse(stored: Stored, model: nn.Module) -> Stored:
    """`stored` by our module names: each fused layer's parts (q/k/v, gate/up) concatenated, rows then scales, as
    the model concatenates its weight (models/fused.py). A fused layer only partly fp8 is dropped: its dequantised
    weight is quantised again, should fp8 be asked for."""
    out = dict(stored)
    for name, _ in model.named_modules():
        for fused, parts in FUSED.items():
            if name.endswith("." + fused):
                stem = name[: -len(fused.rpartition(".")[2])]
                pieces = [out.pop(stem + p, None) for p in parts]
                if all(p is not None for p in pieces):
                    out[name] = (torch.cat([q for q, _ in pieces]), torch.cat([s for _, s in pieces]))
    return out
