"""Where Voxtral's weights come from: an HF checkpoint directory, or a preset with random init.

A checkpoint directory is what `VoxtralForConditionalGeneration.save_pretrained(DIR)` writes (config.json and
`model.safetensors` or sharded `model-0000x-of-0000y.safetensors` + index) plus `tekken.json`. Only safetensors
is read: no pickle, ever.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runner.bundle import sha256_file
from runner.errors import ExportError
from runner.fixtures import fixtures_dir
from runner.models.state import load_state
from runner.models.voxtral import Voxtral
from runner.models.voxtral_config import VoxtralConfig, preset

FIXTURES = fixtures_dir()  # the checkout's fixtures/, or the installed copy
TINY_CHECKPOINT = FIXTURES / "voxtral-tiny"  # config.json (tokenizer: fixtures/tekken.json); weights are seeded
TINY_SEED = 0

# transformers 5 may name keys as the in-memory model does; save_pretrained writes the 4.x layout we use.
_KEY_PREFIXES = (
    ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)


@dataclass(frozen=True)
class ModelSource:
    """What the bundle's weights are, recorded in the manifest and hashed into the compile cache key."""

    kind: str  # "checkpoint" | "random-init"
    name: str  # checkpoint dir name or preset name
    weights_digest: str
    seed: int | None = None
    generator: str | None = None  # random-init: what drew the weights (runner/export/regenerate.py draws them again)

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "name": self.name, "weights_digest": self.weights_digest, "seed": self.seed}
        return d | ({"generator": self.generator} if self.generator else {})


def _normalise_key(k: str) -> str:
    for old, new in _KEY_PREFIXES:
        if k.startswith(old):
            return new + k[len(old) :]
    return k


def _weight_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ExportError(f"{index}: malformed index ({e})") from None
        return [ckpt / s for s in shards]
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in ckpt.glob("*.bin"))
        hint = f" (found {', '.join(bins)}: pickle checkpoints are not read; re-save with safetensors)" if bins else ""
        raise ExportError(f"{ckpt}: no .safetensors weights{hint}")
    return files


def load_checkpoint(ckpt: str | Path, dtype: torch.dtype = torch.float32) -> tuple[Voxtral, ModelSource, Path]:
    """Returns the eager model with the checkpoint's weights, its source record, and its tekken.json."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: checkpoint directory not found")
    for need in ("config.json", "tekken.json"):
        if not (ckpt / need).is_file():
            raise ExportError(f"{ckpt}: missing {need}")
    config = VoxtralConfig.from_hf_file(ckpt / "config.json")
    files = _weight_files(ckpt)
    state: dict[str, torch.Tensor] = {}
    digest = hashlib.sha256()
    for f in files:
        if not f.is_file():
            raise ExportError(f"{f}: shard named in the index is missing")
        digest.update(sha256_file(f).encode())
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    state[_normalise_key(k)] = sf.get_tensor(k)
        except Exception as e:  # safetensors' own error types
            raise ExportError(f"{f}: cannot read safetensors ({e})") from None
    model = Voxtral(config)
    load_state(model, state, source=str(ckpt))
    source = ModelSource("checkpoint", ckpt.resolve().name, digest.hexdigest())
    return model.to(dtype).eval(), source, ckpt / "tekken.json"


def random_model(
    preset_name: str, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[Voxtral, ModelSource]:
    """A preset with seeded random weights, initialised directly on `device` in `dtype` (a 3B model built
    in fp32 on the host first would cost minutes and 19 GB). The device's generator is part of the identity."""
    config = preset(preset_name)
    digest = hashlib.sha256(
        json.dumps([config.to_dict(), seed, device, str(dtype)], sort_keys=True).encode()
    ).hexdigest()
    with torch.device("meta"):
        model = Voxtral(config)
    model = model.to_empty(device=device).to(dtype).init_weights(seed)
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
