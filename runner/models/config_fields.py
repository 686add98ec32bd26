"""The checks on a config file's fields, made before any model is built from them: each number the model builder
takes must be a whole number (not a bool, a float or a string) within a bound, each real number positive and
finite, each section a JSON object. An error names the field as the file spells it."""

from __future__ import annotations

import math
from dataclasses import fields

from runner.errors import ExportError

# Our field name -> (least, most). The bounds admit every published model many times over and refuse a config that
# would build for minutes and take the machine's memory before anything else is checked.
LIMITS: dict[str, tuple[int, int]] = {
    "n_mels": (1, 1024),
    "dim": (1, 1 << 17),
    "ffn_dim": (1, 1 << 18),
    "n_layers": (1, 1024),
    "n_heads": (1, 1024),
    "n_kv_heads": (1, 1024),
    "head_dim": (1, 2048),
    "vocab_size": (1, 1 << 22),
    "max_source_positions": (1, 1 << 20),
    "sliding_window": (1, 1 << 20),
    "downsample_factor": (1, 64),
    "num_delay_tokens": (0, 1 << 12),
    "audio_token_id": (0, (1 << 22) - 1),
}
REALS = ("rope_theta", "norm_eps")  # positive and finite


def section(doc: dict, key: str, where: str = "") -> dict:
    """doc[key] as a dict: absent or null is empty; anything else but an object is an error naming it."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ExportError(f"{where}{key}: {_show(value)} is not a JSON object")
    return value


def whole(value, name: str, field: str) -> int:
    """`value` if it is an int within LIMITS[field], else an error naming `name`."""
    least, most = LIMITS[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExportError(f"{name}: {_show(value)} is not a whole number")
    if not least <= value <= most:
        raise ExportError(f"{name}: {value} is out of range ({least} to {most})")
    return value


def real(value, name: str) -> float:
    """`value` as a float if it is a positive finite number, else an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ExportError(f"{name}: {_show(value)} is not a positive number")
    return float(value)


def read_whole(d: dict, where: str, keys: tuple[str, ...], field: str, default):
    """The first of `keys` present and not null in `d`, checked as `field`; `default` when none is."""
    for key in keys:
        if d.get(key) is not None:
            return whole(d[key], where + key, field)
    return default


def read_real(d: dict, where: str, key: str, default: float) -> float:
    return default if d.get(key) is None else real(d[key], where + key)


def divides(value: int, name: str, by: int, by_name: str) -> None:
    """A head count that must divide a width or another head count."""
    if value % by:
        raise ExportError(f"{name} ({value}) is not a multiple of {by_name} ({by}): head counts must divide it")


def read_heads(d: dict, where: str, dim: int, default_heads: int) -> tuple[int, int, int]:
    """A decoder's attention heads from an HF text section: (heads, KV heads, head dim), each checked (KV heads
    divide the heads; the head dim, given or dim // heads, even for the rotary embeddings)."""
    heads = read_whole(d, where, ("num_attention_heads",), "n_heads", default_heads)
    kv_heads = read_whole(d, where, ("num_key_value_heads",), "n_kv_heads", heads)
    divides(heads, where + "num_attention_heads", kv_heads, where + "num_key_value_heads")
    head_dim = read_whole(d, where, ("head_dim",), "head_dim", None)
    if head_dim is None and dim // heads < 2:
        raise ExportError(f"{where}hidden_size ({dim}) is less than 2 x {where}num_attention_heads ({heads})")
    head_dim = head_dim or dim // heads
    if head_dim % 2:
        raise ExportError(f"{where}head_dim: {head_dim} is odd (rotary embeddings pair its dims)")
    return heads, kv_heads, head_dim


def check_tower(tower, where: str) -> None:
    """Every field of a config dataclass within its bound (the configs that come from elsewhere than a file: a
    preset, a bundle's manifest)."""
    for f in fields(tower):
        value = getattr(tower, f.name)
        if f.name in LIMITS:
            whole(value, f"{where}{f.name}", f.name)
        elif f.name in REALS:
            real(value, f"{where}{f.name}")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__} {text[:37]}..."
