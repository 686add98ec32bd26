"""A fourth family, defined here only: a two-layer model (one linear layer turns eight mel frames into an audio
position, one turns a position into logits) registered from this test in the three registries (run time, export,
eager reference), then exported, inspected and run through the CLI. No shared file knows its name: adding a family
is its own code plus one registration per registry."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.export import Dim

from runner import families, reference
from runner.app.cli import main
from runner.audio import CHUNK_LENGTH, N_FRAMES, N_SAMPLES, PROMPT_ROOM, TOKENS_PER_CHUNK, load_audio
from runner.audio_chunks import audio_windows
from runner.bundle import METHOD_NAMES, read_manifest
from runner.export import registry
from runner.export.checkpoint import FIXTURES, ModelSource
from runner.export.methods import MethodPlan, dim, dtype_name, method_spec, preprocessor_plan
from runner.export.options import DTYPES, ExportOptions
from runner.export.pipeline import build_bundle, prepare
from runner.families.base import Capabilities
from runner.families.voxtral.tokenizer import Tekken
from runner.models.methods import Methods
from runner.reference.engine import EagerEngine
from runner.runtime.prompt import AudioSegment, Prompt, TextSegment

NAME = "two-layer-toy"
PRESET = "toy-two-layer"
FRAMES_PER_POSITION = N_FRAMES // TOKENS_PER_CHUNK  # 8 mel frames -> one audio position
AUDIO = Path(__file__).resolve().parents[2] / "fixtures" / "audio" / "speech.wav"


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 1024
    dim: int = 32
    n_mels: int = 80

    def to_dict(self) -> dict:  # the manifest's config: the sizes `inspect` shows
        text = {"vocab_size": self.vocab_size, "dim": self.dim, "n_layers": 1, "n_heads": 1, "n_kv_heads": 1}
        return {"text": text, "audio": {"dim": self.dim, "n_layers": 1, "n_mels": self.n_mels}, "toy": asdict(self)}


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.encoder = nn.Linear(FRAMES_PER_POSITION * config.n_mels, config.dim)  # layer 1
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size)  # layer 2

    def setup_caches(self, max_seq_len: int, dtype: torch.dtype) -> None:
        """No cache: each position's logits come from that position alone."""

    def reset_caches(self) -> None:
        pass


class AudioEncoder(nn.Module):
    def __init__(self, model: ToyModel):
        super().__init__()
        self.encoder, self.n_mels = model.encoder, model.config.n_mels

    def forward(self, mel):  # [k, n_mels, 3000] -> [1, k * 375, dim]
        frames = mel.transpose(1, 2).reshape(1, -1, FRAMES_PER_POSITION * self.n_mels)
        return self.encoder(frames)


class TokenEmbedding(nn.Module):
    def __init__(self, model: ToyModel):
        super().__init__()
        self.embed = model.embed

    def forward(self, ids):
        return self.embed(ids)


class TextDecoder(nn.Module):
    def __init__(self, model: ToyModel):
        super().__init__()
        self.head = model.head

    def forward(self, embeds, cache_position, every_position: bool = False):
        logits = self.head(embeds[0] + 0 * cache_position[:, None].to(embeds.dtype))
        return logits.float() if every_position else logits[-1:].float()


def toy_methods(model: ToyModel) -> Methods:
    from runner.models.mel import LogMelSpectrogram

    pre = LogMelSpectrogram(model.config.n_mels).to(model.head.weight.device)
    return Methods(pre, AudioEncoder(model), TokenEmbedding(model), TextDecoder(model))


# ---------------------------------------------------------------- export: its registry entry


def load(request: registry.LoadRequest) -> registry.Loaded:
    torch.manual_seed(request.seed)
    model = ToyModel(ToyConfig())
    digest = hashlib.sha256(json.dumps([asdict(model.config), request.seed]).encode()).hexdigest()
    return registry.Loaded(
        request.preset, model, ModelSource("random-init", PRESET, digest, request.seed), FIXTURES / "tekken.json"
    )


def export_toy(model: ToyModel, source, tokenizer: Path, out: Path, opts: ExportOptions, progress=None):
    model, meta = prepare(model, source, opts, EXPORT)
    tok = Tekken.from_file(tokenizer)
    K, S, H, V = opts.max_audio_chunks, opts.max_seq_len, model.config.dim, model.config.vocab_size
    meta |= {
        "max_audio_chunks": K,
        "tokens_per_chunk": TOKENS_PER_CHUNK,
        "capacity": {
            "audio_seconds": K * CHUNK_LENGTH,
            "audio_positions": K * TOKENS_PER_CHUNK,
            "answer_positions": S - K * TOKENS_PER_CHUNK - PROMPT_ROOM,
        },
        "tokenizer": "tekken.json",
        "special_tokens": {"bos": tok.bos_id, "eos": tok.eos_id, "audio": tok.special_id("[AUDIO]")},
    }
    dev, name = torch.device(opts.device), dtype_name(DTYPES[opts.dtype])
    g = torch.Generator().manual_seed(1)
    mel = torch.randn(1, model.config.n_mels, N_FRAMES, generator=g).to(dev)
    emb = lambda s: torch.randn(1, s, H, generator=g).to(dev)  # noqa: E731
    seq, m = Dim("seq", min=1, max=S), toy_methods(model)
    plans = [
        preprocessor_plan(model.config.n_mels, dev, K, [(torch.zeros(N_SAMPLES, device=dev),)]),
        MethodPlan(
            "audio_encoder", m.audio_encoder, (mel,), None,
            method_spec("audio_encoder", [("mel", name, [1, model.config.n_mels, N_FRAMES])],
                        [("audio_embeds", name, [1, TOKENS_PER_CHUNK, H])]),
            [(mel,)],
        ),
        MethodPlan(
            "token_embedding", m.token_embedding, (torch.tensor([[1, 2, 3]], device=dev),), ({1: seq},),
            method_spec("token_embedding", [("ids", "int64", [1, dim(1, S)])], [("embeds", name, [1, dim(1, S), H])]),
            [(torch.tensor([[5, 6]], device=dev),)],
        ),
        MethodPlan(
            "text_decoder", m.text_decoder, (emb(3), torch.arange(3, device=dev)), ({1: seq}, {0: seq}),
            method_spec("text_decoder", [("embeds", name, [1, dim(1, S), H]), ("cache_position", "int64", [dim(1, S)])],
                        [("logits", "float32", [1, V])]),
            [(emb(4), torch.arange(4, device=dev))],
        ),
    ]  # fmt: skip
    key = {"family": NAME, "sources": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}
    return build_bundle(model, plans, source, tokenizer, meta, out, opts, progress, key)


EXPORT = registry.ExportFamily(NAME, presets=(PRESET,), load=load, export=export_toy, methods=METHOD_NAMES)


# ---------------------------------------------------------------- run time and the eager reference


class ToyFamily:
    name = NAME
    capabilities = Capabilities()
    cross_attention = False

    def __init__(self, tokenizer: Tekken):
        self.tokenizer, self.audio_id = tokenizer, tokenizer.special_id("[AUDIO]")

    @classmethod
    def from_bundle(cls, bundle_dir: Path, model: dict) -> ToyFamily:
        return cls(Tekken.from_file(Path(bundle_dir) / model["tokenizer"]))

    def prompts(self, audio_path, prompt, language, max_audio_chunks: int) -> list[Prompt]:
        bos, transcribe = (self.tokenizer.bos_id,), (self.tokenizer.special_id("[TRANSCRIBE]"),)
        windows = audio_windows(load_audio(audio_path), max_audio_chunks)
        return [[TextSegment(bos), AudioSegment(w), TextSegment(transcribe)] for w in windows]


def eager_toy(bundle_dir: Path, manifest, device: str | None = None) -> EagerEngine:
    device = device or manifest.device
    model = ToyModel(ToyConfig(**manifest.model["config"]["toy"])).to(device)
    methods = toy_methods(model)
    for name in manifest.methods:  # each method's weights file, keyed by its module's FQNs
        getattr(methods, name).load_state_dict(
            load_file(str(bundle_dir / manifest.methods[name].weights), device=device)
        )
    return EagerEngine(
        methods, device=device, max_seq_len=manifest.model["max_seq_len"],
        max_audio_chunks=manifest.model["max_audio_chunks"], encoder_dtype=torch.float32, reset=lambda: None,
    )  # fmt: skip


@pytest.fixture
def toy_registered(monkeypatch):
    """The toy family in all three registries for this test only (each registry's table restored after)."""
    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))
    monkeypatch.setattr(registry, "REGISTERED", dict(registry.REGISTERED))
    monkeypatch.setattr(reference, "EAGER", dict(reference.EAGER))
    families.register(ToyFamily)
    registry.register(EXPORT)
    reference.register(NAME, eager_toy)


def test_a_family_defined_in_a_test_exports_inspects_and_runs_through_the_cli(toy_registered, tmp_path, capsys):
    out = tmp_path / "toy"
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["export", "--preset", PRESET, "--max-audio-chunks", "1", "--out", str(out), *cache]) == 0
    m = read_manifest(out)
    assert m.model["family"] == NAME and m.model["required_methods"] == list(METHOD_NAMES)
    assert list(m.methods) == list(METHOD_NAMES)
    capsys.readouterr()

    assert main(["inspect", str(out)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert f"model: {NAME} from random-init {PRESET}" in shown and "text_decoder" in shown

    args = ["run", "--bundle", str(out), "--audio", str(AUDIO), "--max-new-tokens", "4", "--json"]
    assert main([*args, "--reference", "eager"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tokens"] and len(record["tokens"]) <= 4


def test_the_toy_family_is_unknown_once_unregistered(tmp_path):
    """The registrations were the test's own: without them the preset is unknown, as any other."""
    assert PRESET not in registry.preset_names() and NAME not in families.FAMILIES
