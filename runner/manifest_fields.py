"""The manifest's fields by type and range, checked when it is read (runner/bundle.py): a field of the wrong type
or a missing one is a one-line BundleError naming the field, never a TypeError deep in the runtime or `inspect`.

Only the fields the runner reads are checked; others (a family's own, a newer exporter's) pass untouched.
"""

from __future__ import annotations

import math
from typing import Any

from runner.audio import CHUNK_LENGTH, MAX_SECONDS
from runner.digests import is_digest


class FieldError(ValueError):
    """A manifest field of the wrong type, out of range or missing; the message names it (`model.max_seq_len`)."""


TENSOR_DTYPES = frozenset(
    {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}
)
MODEL_DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")

# model fields: the runtime and `inspect` read these; a bundle of any family has them, and a prompted one (its
# methods include an audio encoder, which takes whole 30 s chunks) also the chunk fields
_MODEL_REQUIRED = ("family", "required_methods", "config", "max_seq_len", "tokenizer", "special_tokens")
_CHUNKED = ("max_audio_chunks", "tokens_per_chunk")
CHUNKED_METHOD = "audio_encoder"
# The largest sizes a bundle may declare, and `export` build: what loading or regenerating a bundle allocates from
# (1e12 positions of KV cache would be a MemoryError deep in torch, not a line naming the field).
MAX_AUDIO_CHUNKS = MAX_SECONDS // CHUNK_LENGTH  # 480: the longest audio the runner reads, in one prompt
MAX_SEQ_LEN = 1 << 18  # positions: the default context of MAX_AUDIO_CHUNKS (runner/audio.py context_for) fits
MAX_BATCH = 1024  # sequences one batched decode step takes
MAX_STREAMS = 1024  # stream slots of a streaming bundle
MAX_SEED = 2**63 - 1  # torch.manual_seed's int64
MAX_CONFIG_SIZE = 1 << 24  # a width, a layer count or a vocabulary: far past any model's
_POSITIVE = {
    "max_seq_len": MAX_SEQ_LEN,
    "max_audio_chunks": MAX_AUDIO_CHUNKS,
    "n_mels": 1024,
    "max_recording_chunks": MAX_AUDIO_CHUNKS + 1,  # the recording and 30 s of zeros (runtime/features.py)
    "max_batch": MAX_BATCH,
    "max_streams": MAX_STREAMS,
}
_FLAGS = ("pdl", "multilingual", "prefill_pieces")
# model.source.kind of weights a bundle may travel without, made again from the manifest's record
# (runner/export/regenerate.py): drawn from a seed, or converted from a pinned package (model.source.package)
RANDOM_INIT, PACKAGE = "random-init", "package"
_PACKAGE_FIELDS = ("name", "version", "file", "sha256")
_NAMES = ("family", "tokenizer_type")
# config.text / config.audio: the sizes `inspect` shows (required) and the others (checked when present)
_CONFIG_REQUIRED = {"text": ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads"), "audio": ("dim", "n_layers")}
_CONFIG_SIZES = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "n_mels",
                 "max_source_positions", "max_target_positions")  # fmt: skip


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def is_int(v: Any, least: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def in_range(v: Any, least: int, most: int) -> bool:
    return is_int(v, least) and v <= most


def need(ok: bool, where: str, value: Any, what: str) -> None:
    if not ok:
        raise FieldError(f"{where} is {_show(value)}, expected {what}")


def _get(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise FieldError(f"{where}.{key} is missing" if where else f"{key} is missing")
    return d[key]


def check_top(d: dict) -> None:
    """The manifest's own fields (format and version are checked before this)."""
    need(isinstance(_get(d, "torch_version", ""), str) and d["torch_version"], "torch_version", d["torch_version"],
         "a torch version string")  # fmt: skip
    need(_get(d, "device", "") in DEVICES, "device", d["device"], " or ".join(DEVICES))
    need(d.get("gpu_arch") is None or isinstance(d["gpu_arch"], str), "gpu_arch", d.get("gpu_arch"), "null or 'sm_NN'")
    need(_get(d, "dtype", "") in MODEL_DTYPES, "dtype", d["dtype"], " or ".join(MODEL_DTYPES))
    need(isinstance(d.get("created_by", ""), str), "created_by", d.get("created_by"), "a string")
    need(isinstance(_get(d, "methods", ""), dict), "methods", d["methods"], "an object of method name -> method")
    need(isinstance(_get(d, "files", ""), dict), "files", d["files"], "an object of file name -> size and sha256")
    check_model(_get(d, "model", ""))


def check_model(m: Any) -> None:
    need(isinstance(m, dict), "model", m, "an object")
    for key in _NAMES:
        if key in m:
            need(isinstance(m[key], str), f"model.{key}", m[key], "a string")
    for key in _MODEL_REQUIRED:
        _get(m, key, "model")
    required = m["required_methods"]
    need(isinstance(required, list) and all(isinstance(x, str) and x for x in required), "model.required_methods",
         required, "a list of method names")  # fmt: skip
    for key in _CHUNKED if CHUNKED_METHOD in required else ():
        _get(m, key, "model")
    for key, most in _POSITIVE.items():
        if key in m:
            need(in_range(m[key], 1, most), f"model.{key}", m[key], f"a whole number from 1 to {most:,}")
    if "tokens_per_chunk" in m:
        need(is_int(m["tokens_per_chunk"]), "model.tokens_per_chunk", m["tokens_per_chunk"], "a whole number >= 0")
    need(isinstance(m["tokenizer"], str) and m["tokenizer"], "model.tokenizer", m["tokenizer"], "a file name")
    for key in _FLAGS:
        if key in m:
            need(isinstance(m[key], bool), f"model.{key}", m[key], "true or false")
    tokens = m["special_tokens"]
    need(isinstance(tokens, dict), "model.special_tokens", tokens, "an object of name -> token id")
    for name, tid in tokens.items():
        need(is_int(tid), f"model.special_tokens.{name}", tid, "a token id >= 0")
    if "source" in m:
        src = m["source"]
        need(isinstance(src, dict), "model.source", src, "an object")
        for key in ("kind", "name", "weights_digest"):
            if src.get(key) is not None:
                need(isinstance(src[key], str), f"model.source.{key}", src[key], "a string")
        if src.get("kind") == PACKAGE or "package" in src:
            _check_package(_get(src, "package", "model.source"))
    for key in ("compile_seconds", "compile_cached"):
        if key in m:
            need(isinstance(m[key], dict), f"model.{key}", m[key], "an object of method name -> value")
    _check_record(m, "capacity", _CAPACITY, required=("audio_seconds", "audio_positions"))
    if m.get("quant"):  # null or {}: unquantised
        scheme = m["quant"].get("scheme") if isinstance(m["quant"], dict) else None
        _check_record(m, "quant", _QUANT, required=_FP8_REQUIRED if scheme == "fp8" else tuple(_QUANT))
    _check_config(m["config"])


# records other parts of the runner write and read (runtime capacity, `inspect`, the eager reference): the fields
# they read, by type; a record's other fields pass
_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number")
_CAPACITY = {"audio_seconds": _INT, "audio_positions": _INT, "answer_positions": _INT}
_QUANT = {
    "scheme": (lambda v: isinstance(v, str), "a string"),
    "group_size": (lambda v: is_int(v, 1), "a whole number >= 1"),
    "symmetric": (lambda v: isinstance(v, bool), "true or false"),
    "scale_dtype": (lambda v: v in TENSOR_DTYPES, "a dtype name"),
    "modules": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of names"),
    "n_linear": (lambda v: is_int(v), "a whole number >= 0"),
}
_FP8_REQUIRED = tuple(k for k in _QUANT if k != "group_size")  # one scale per output channel: no groups


def _check_record(m: dict, key: str, fields: dict, required: tuple[str, ...]) -> None:
    if key not in m:
        return
    r = m[key]
    need(isinstance(r, dict), f"model.{key}", r, "an object")
    for name in required:
        _get(r, name, f"model.{key}")
    for name, (ok, what) in fields.items():
        if name in r:
            need(ok(r[name]), f"model.{key}.{name}", r[name], what)


def _check_package(p: Any) -> None:
    """The pinned distribution a bundle's weights are converted from: its name and version, and the converted
    file's path inside it and sha256."""
    need(isinstance(p, dict), "model.source.package", p, "an object with name, version, file and sha256")
    for key in _PACKAGE_FIELDS:
        v = _get(p, key, "model.source.package")
        need(isinstance(v, str) and v, f"model.source.package.{key}", v, "a non-empty string")
    need(is_digest(p["sha256"]), "model.source.package.sha256", p["sha256"], "a sha256 (64 lowercase hex digits)")


def _check_config(c: Any) -> None:
    need(isinstance(c, dict), "model.config", c, "an object with text and audio")
    for tower, required in _CONFIG_REQUIRED.items():
        t = _get(c, tower, "model.config")
        need(isinstance(t, dict), f"model.config.{tower}", t, "an object")
        for key in required:
            _get(t, key, f"model.config.{tower}")
        for key in _CONFIG_SIZES:
            if key in t:
                need(in_range(t[key], 1, MAX_CONFIG_SIZE), f"model.config.{tower}.{key}", t[key],
                     f"a whole number from 1 to {MAX_CONFIG_SIZE:,}")  # fmt: skip
        for key in ("rope_theta", "norm_eps"):
            if key in t:
                v = t[key]
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                need(ok, f"model.config.{tower}.{key}", v, "a finite number > 0")


def check_dtype(where: str, v: Any) -> str:
    need(v in TENSOR_DTYPES, where, v, f"a dtype ({', '.join(sorted(TENSOR_DTYPES))})")
    return v


def check_shape(where: str, shape: Any, dynamic: bool = True) -> list:
    """A list of dims: a whole number >= 0, or (`dynamic`) {"min": a, "max": b[, "multiple": m]} with a <= b."""
    need(isinstance(shape, list), where, shape, "a list of dimensions")
    for i, d in enumerate(shape):
        at = f"{where}[{i}]"
        if is_int(d):
            continue
        need(dynamic and isinstance(d, dict), at, d, "a whole number >= 0" + (" or {min, max}" if dynamic else ""))
        lo, hi, mult = d.get("min"), d.get("max"), d.get("multiple", 1)
        need(is_int(lo) and is_int(hi) and lo <= hi and is_int(mult, 1), at, d,
             "{min, max[, multiple]}: whole numbers, min <= max, multiple >= 1")  # fmt: skip
    return list(shape)


def check_name(where: str, v: Any) -> str:
    need(isinstance(v, str) and v != "", where, v, "a non-empty string")
    return v
