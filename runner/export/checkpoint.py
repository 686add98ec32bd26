"""Where Voxtral's weights come from: a checkpoint directory, or a preset with random init.

A checkpoint directory holds `tekken.json` and either the HF files (config.json and `model.safetensors`, or
sharded `model-0000x-of-0000y.safetensors` + index, in any layout `HF_LAYOUTS` names) or Mistral's own
`params.json` + `consolidated.safetensors` (runner/export/mistral_format.py). When both are there, the HF files
are read. Only safetensors is read: no pickle, ever. An FP8 checkpoint (compressed-tensors, float-quantized) is read
dequantised, its fp8 layers kept beside the model for `--quant fp8` (runner/export/fp8_checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runner.digests import sha256_file
from runner.errors import ExportError
from runner.export import fp8_checkpoint, mistral_format
from runner.families.voxtral import AUDIO_TOKEN, Tekken
from runner.fixtures import fixtures_dir
from runner.json_file import read_json_object
from runner.models.state import empty_model, load_state
from runner.models.voxtral import Voxtral
from runner.models.voxtral_config import VoxtralConfig, preset

FIXTURES = fixtures_dir()  # the checkout's fixtures/, or the installed copy
TINY_CHECKPOINT = FIXTURES / "voxtral-tiny"  # config.json (tokenizer: fixtures/tekken.json); weights are seeded
TINY_SEED = 0
FLOAT32_BYTES = 4

# The key layouts HF-format Voxtral checkpoints come in, as (prefix in the file, prefix in ours) pairs. Ours is
# the published one (mistralai/Voxtral-Mini-3B-2507's model-*.safetensors), which save_pretrained writes in
# transformers 4.5x and 5.25 too. Measured: 5.17's save_pretrained nests the text model once more; transformers
# 5 names keys in memory as the third layout does. A checkpoint is read in whichever layout names most of the
# keys the config asks for, so one stray key is reported as itself, not as a different layout.
HF_LAYOUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "published": (),
    "transformers-5.17": (("language_model.model.model.", "language_model.model."),),
    "transformers-in-memory": (
        ("model.audio_tower.", "audio_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """What the bundle's weights are, recorded in the manifest and hashed into the compile cache key."""

    kind: str  # "checkpoint" | "random-init" | "package"
    name: str  # checkpoint dir name or preset name
    weights_digest: str
    seed: int | None = None
    generator: str | None = None  # random-init: what drew the weights (runner/export/regenerate.py draws them again)
    # package: the pinned distribution the weights are converted from, {name, version, file, sha256}
    # (runner/export/regenerate.py converts them again from the installed package)
    package: dict[str, str] | None = None
    # an FP8 checkpoint's codes and scales by our module names (the model holds them dequantised), which
    # `--quant fp8` stores as they are; not part of the record (the digest already names the files)
    fp8: fp8_checkpoint.Stored | None = field(default=None, compare=False, hash=False, repr=False)

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "name": self.name, "weights_digest": self.weights_digest, "seed": self.seed}
        d |= {"generator": self.generator} if self.generator else {}
        return d | ({"package": dict(self.package)} if self.package else {})


def _rename(key: str, pairs: tuple[tuple[str, str], ...], backward: bool = False) -> str:
    for file_prefix, ours in pairs:
        old, new = (ours, file_prefix) if backward else (file_prefix, ours)
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def _hf_layout(keys, expected: set[str]) -> tuple[tuple[str, str], ...]:
    """The layout under which most of the file's keys are ones the config asks for (ties: the published one)."""
    return max(HF_LAYOUTS.values(), key=lambda pairs: len({_rename(k, pairs) for k in keys} & expected))


def hf_weight_files(ckpt: Path) -> list[Path]:
    """model.safetensors, or the shards its index names (never a pickle; Mistral's consolidated files left out)."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, ExportError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ExportError(f"{index}: malformed index (weight_map is not a JSON object)")
        shards = set(weight_map.values())
        bad = next((s for s in shards if not isinstance(s, str) or Path(s).name != s or s in ("", ".", "..")), None)
        if bad is not None:  # a name outside the directory would read a file the checkpoint does not hold
            raise ExportError(f"{index}: malformed index (shard {bad!r} is not a file name in the checkpoint)")
        return [ckpt / s for s in sorted(shards)]
    # Mistral's consolidated*.safetensors may sit beside the HF files (the hub repository has both)
    consolidated = set(ckpt.glob(mistral_format.WEIGHTS_GLOB))
    return sorted(p for p in ckpt.glob("*.safetensors") if p not in consolidated)


def no_weights(ckpt: Path) -> ExportError:
    bins = sorted(p.name for p in ckpt.glob("*.bin"))
    hint = f" (found {', '.join(bins)}: pickle checkpoints are not read; re-save with safetensors)" if bins else ""
    return ExportError(f"{ckpt}: no .safetensors weights{hint}")


def read_weights(files: list[Path], origins: dict[str, Path] | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the files, and a digest of the files (not of the tensors); `origins`, if given, is told
    which file holds each tensor."""
    state: dict[str, torch.Tensor] = {}
    digest = hashlib.sha256()
    for f in files:
        if not f.is_file():
            raise ExportError(f"{f}: shard named in the index is missing")
        digest.update(sha256_file(f).encode())
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    state[k] = sf.get_tensor(k)
                    if origins is not None:
                        origins[k] = f
        except Exception as e:  # safetensors' own error types
            raise ExportError(f"{f}: cannot read safetensors ({e})") from None
    return state, digest.hexdigest()


def param_count(config: VoxtralConfig) -> int:
    """The model's parameters (runner/models/voxtral.py's modules), counted from its config alone: what a
    checkpoint's config asks to allocate, known before anything is."""
    a, t = config.audio, config.text
    convs = a.n_mels * a.dim * 3 + a.dim + a.dim * a.dim * 3 + a.dim
    audio_layer = 4 * a.dim * a.dim + 4 * a.dim + 4 * a.dim + 2 * a.dim * a.ffn_dim + a.ffn_dim + a.dim
    audio = convs + a.max_source_positions * a.dim + a.n_layers * audio_layer + 2 * a.dim
    projector = a.ffn_dim * t.dim + t.dim * t.dim
    attention = t.dim * (t.n_heads + 2 * t.n_kv_heads) * t.head_dim + t.n_heads * t.head_dim * t.dim
    text_layer = attention + 3 * t.dim * t.ffn_dim + 2 * t.dim
    return audio + projector + 2 * t.vocab_size * t.dim + t.n_layers * text_layer + t.dim


def host_memory() -> int | None:
    """What this machine's memory can hold: psutil's available memory where psutil is installed, else the
    physical memory (a bound that never refuses what freeing the page cache would make room for); None where
    neither is known."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_host_memory(config_file: Path, params: int, available: int | None) -> None:
    """The model `config_file` describes is built in float32 on the host, its checkpoint's tensors read beside it:
    refused before either if the float32 weights alone exceed what the host holds."""
    need = params * FLOAT32_BYTES
    if available is not None and need > available:
        raise ExportError(
            f"{config_file}: describes a model of {params / 1e9:.3g} B parameters ({need / 2**30:.1f} GiB in "
            f"float32), more than this machine's {available / 2**30:.1f} GiB of memory"
        )


def _load_hf(ckpt: Path, files: list[Path]) -> tuple[Voxtral, str, fp8_checkpoint.Stored]:
    config_file = ckpt / "config.json"
    config = VoxtralConfig.from_hf_file(config_file)
    quantization = fp8_checkpoint.read_config(config_file)
    check_host_memory(config_file, param_count(config), host_memory())
    model = Voxtral(config)
    origins: dict[str, Path] = {}
    state, digest = read_weights(files, origins)
    state, stored = fp8_checkpoint.dequantize_state(state, origins, config_file, quantization)
    pairs = _hf_layout(state, set(model.to_hf_layout(model.state_dict())))
    renamed = {_rename(k, pairs): k for k in state}
    if len(renamed) < len(state):
        raise ExportError(f"{ckpt}: the weights name some tensors twice (mixed key layouts)")
    load_state(
        model,
        {k: state[name] for k, name in renamed.items()},
        source=str(ckpt),
        spell=lambda k: renamed.get(k) or _rename(k, pairs, backward=True),
    )
    return model, digest, fp8_checkpoint.fuse({_rename(k, pairs): v for k, v in stored.items()}, model)


def _load_mistral(ckpt: Path, files: list[Path], tokenizer: Tekken) -> tuple[Voxtral, str]:
    params_file = ckpt / mistral_format.PARAMS
    params = read_json_object(params_file, ExportError)
    audio_id = tokenizer.special_id(AUDIO_TOKEN)
    try:
        config = mistral_format.config_from_params(params, audio_id)
    except ExportError as e:
        raise ExportError(f"{params_file}: {e}") from None
    check_host_memory(params_file, param_count(config), host_memory())
    model = Voxtral(config)
    origins: dict[str, Path] = {}
    state, digest = read_weights(files, origins)
    fp8_checkpoint.dequantize_state(state, origins, params_file, None)  # fp8 tensors: refused, never read as floats
    hf, names = mistral_format.to_hf_state(state, config)
    load_state(model, hf, source=str(ckpt), spell=lambda k: names.get(k) or mistral_format.mistral_name(k))
    return model, digest


def load_checkpoint(ckpt: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Voxtral, ModelSource, Path]:
    """Returns the eager model with the checkpoint's weights, its source record, and its tekken.json."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: checkpoint directory not found")
    tekken = ckpt / "tekken.json"
    if not tekken.is_file():
        raise ExportError(f"{ckpt}: missing tekken.json")
    has_config, has_params = (ckpt / "config.json").is_file(), (ckpt / mistral_format.PARAMS).is_file()
    hf_files = hf_weight_files(ckpt) if has_config else []
    mistral_files = sorted(ckpt.glob(mistral_format.WEIGHTS_GLOB)) if has_params else []
    if not has_config and not has_params:
        raise ExportError(f"{ckpt}: missing config.json (or Mistral's {mistral_format.PARAMS})")
    if not hf_files and not mistral_files:
        raise no_weights(ckpt)
    tokenizer = Tekken.from_file(tekken)  # a bad one is refused before minutes of loading weights
    stored = None
    if hf_files:
        model, digest, stored = _load_hf(ckpt, hf_files)
    else:
        model, digest = _load_mistral(ckpt, mistral_files, tokenizer)
    source = ModelSource("checkpoint", ckpt.resolve().name, digest, fp8=stored or None)
    return model.to(dtype).eval(), source, tekken


def random_model(
    preset_name: str, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[Voxtral, ModelSource]:
    """A preset with seeded random weights, initialised directly on `device` in `dtype` (a 3B model built
    in fp32 on the host first would cost minutes and 19 GB). The device's generator is part of the identity.

    Built on the meta device and cast to `dtype` there (free), so the only allocation is the weights, once, in
    their final dtype on their final device: to_empty before the cast allocated fp32 first (the 24B preset:
    97 GB instead of 48.5 GB on the GPU). The numbers are the same either way: init_weights draws each tensor
    in fp32 and copies it into the parameter, whatever the parameter's dtype."""
    config = preset(preset_name)
    digest = hashlib.sha256(
        json.dumps([config.to_dict(), seed, device, str(dtype)], sort_keys=True).encode()
    ).hexdigest()
    model = empty_model(lambda: Voxtral(config)).to(dtype).to_empty(device=device).init_weights(seed)
    return model.eval(), ModelSource("random-init", preset_name, digest, seed, generator_id(device))


def generator_id(device: str) -> str:
    """What draws random_model's weights: the same seed gives the same numbers only on the same torch and device
    type (CUDA's Philox and the CPU's Mersenne Twister differ). Recorded, so the weights can be drawn again."""
    return f"torch {torch.__version__} {torch.device(device).type}"


def write_tiny_checkpoint(dest: Path) -> Path:
    """Materialise the embedded default: fixtures' config.json + tekken.json and seeded weights, in the
    layout save_pretrained writes, so the tiny bundle goes through the real checkpoint loader."""
    dest = Path(dest)
    weights = dest / "model.safetensors"
    if weights.is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    config = VoxtralConfig.from_hf_file(TINY_CHECKPOINT / "config.json")
    model = Voxtral(config).init_weights(TINY_SEED)
    shutil.copyfile(TINY_CHECKPOINT / "config.json", dest / "config.json")
    shutil.copyfile(FIXTURES / "tekken.json", dest / "tekken.json")
    tmp = dest / "model.safetensors.tmp"
    hf = model.to_hf_layout(model.state_dict())
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(weights)
    return dest
