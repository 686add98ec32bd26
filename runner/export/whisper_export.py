"""Export Whisper into a bundle with the same exporter pieces as Voxtral (compile_method, the compile cache,
the exported-vs-eager self-check, the atomic publish), and the eager engine that reads a Whisper bundle back.

Methods (names and order as a Voxtral bundle, so Program, delegate and `inspect` are unchanged):
    preprocessor     waveform f32 [480000] -> mel f32 [1, n_mels, 3000]            (one 30 s window)
    audio_encoder    mel [1, n_mels, 3000] -> cross_kv [L, 2, H, 1500, D]
    token_embedding  ids int64 [1, S] -> embeds [1, S, d]                            (S = 1..448)
    text_decoder     embeds [1, S, d], cache_position [S], cross_kv -> logits f32 [1, vocab]; KV cache in place
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.export import Dim

from runner.audio import N_FRAMES, N_SAMPLES
from runner.bundle import Manifest
from runner.errors import ExportError
from runner.export.checkpoint import ModelSource, load_state
from runner.export.exporter import (
    DTYPES,
    ExportOptions,
    ExportReport,
    MethodPlan,
    _dim,
    _dtype_name,
    build_bundle,
    kv_cache_state,
    method_spec,
    source_digest,
)
from runner.export.mel import LogMelSpectrogram
from runner.export.whisper_model import Whisper, WhisperConfig, WhisperMethods
from runner.multimodal import decode_token
from runner.whisper import FAMILY, SPECIAL_TOKENS, TOKENIZER_TYPE, WhisperTokenizer

PRESET = "whisper-tiny.en"
TOKENIZER_FILE = "tokenizer.json"
# Hashed into the compile-cache key beside the exporter's own sources: editing these must recompile.
SOURCE_FILES = ("export/whisper_model.py", "export/whisper_export.py", "export/model.py", "export/mel.py")
# Parameters a method module reaches but its graph does not use (the decoder's cross K/V projections run in
# audio_encoder): left out of that method's weight file.
UNUSED = {"text_decoder": ("encoder_attn.k_proj.", "encoder_attn.v_proj.")}


def plan_methods(model: Whisper, opts: ExportOptions) -> list[MethodPlan]:
    c, dev, dtype = model.config, torch.device(opts.device), DTYPES[opts.dtype]
    S, d, t = opts.max_seq_len, c.text.dim, c.text
    kv_shape = [t.n_layers, 2, t.n_heads, c.audio.max_source_positions, t.head_dim]
    g = torch.Generator().manual_seed(1234)
    wave = lambda: (torch.randn(N_SAMPLES, generator=g) * 0.1).to(dev)  # noqa: E731
    mel = lambda: torch.randn(1, c.audio.n_mels, N_FRAMES, generator=g).to(dev, dtype)  # noqa: E731
    ids = lambda s: torch.randint(0, t.vocab_size, (1, s), generator=g).to(dev)  # noqa: E731
    emb = lambda s: (torch.randn(1, s, d, generator=g) * 0.5).to(dev, dtype)  # noqa: E731
    kv = (torch.randn(kv_shape, generator=g) * 0.5).to(dev, dtype)
    seq = Dim("seq", min=1, max=S)
    m = WhisperMethods.of(model)
    name = _dtype_name(dtype)
    state = kv_cache_state(t.n_layers, [1, t.n_heads, S, t.head_dim], dtype)
    mel_shape = [1, c.audio.n_mels, N_FRAMES]
    return [
        MethodPlan(
            "preprocessor",
            LogMelSpectrogram(c.audio.n_mels).to(dev),
            (),
            None,
            method_spec("preprocessor", [("waveform", "float32", [N_SAMPLES])], [("mel", "float32", mel_shape)]),
            [(wave(),)],
        ),
        MethodPlan(
            "audio_encoder",
            m.audio_encoder,
            (mel(),),
            None,
            method_spec("audio_encoder", [("mel", name, mel_shape)], [("cross_kv", name, kv_shape)]),
            [(mel(),)],
        ),
        MethodPlan(
            "token_embedding",
            m.token_embedding,
            (ids(3),),
            ({1: seq},),
            method_spec("token_embedding", [("ids", "int64", [1, _dim(1, S)])], [("embeds", name, [1, _dim(1, S), d])]),
            [(ids(5),), (ids(1),)],
        ),
        MethodPlan(
            "text_decoder",
            m.text_decoder,
            (emb(3), torch.arange(3, device=dev), kv),
            ({1: seq}, {0: seq}, None),
            method_spec(
                "text_decoder",
                [
                    ("embeds", name, [1, _dim(1, S), d]),
                    ("cache_position", "int64", [_dim(1, S)]),
                    ("cross_kv", name, kv_shape),
                ],
                [("logits", "float32", [1, t.vocab_size])],
                state,
            ),
            # prefill then one decode step: the second call only matches if the KV cache was mutated
            [(emb(7), torch.arange(7, device=dev), kv), (emb(1), torch.tensor([7], device=dev), kv)],
        ),
    ]


def export_whisper_bundle(
    model: Whisper, source: ModelSource, tokenizer_path: Path, out: Path, opts: ExportOptions, progress=None
) -> ExportReport:
    """Build a Whisper bundle into `out` (replaced atomically), checked against eager before it is published."""

    out, dtype, t = Path(out), DTYPES[opts.dtype], model.config.text
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda: no CUDA device visible to torch")
    opts = replace(opts, max_seq_len=min(opts.max_seq_len, t.max_target_positions), max_audio_chunks=1)
    tok = WhisperTokenizer(tokenizer_path, t.vocab_size)
    special = {k: tok.special_id(v) for k, v in SPECIAL_TOKENS.items()}
    model = model.to(device=opts.device, dtype=dtype).eval()
    model.setup_caches(opts.max_seq_len, dtype)
    meta = {
        "family": FAMILY,
        "config": model.config.to_dict(),
        "source": source.to_dict(),
        "max_seq_len": opts.max_seq_len,
        "max_audio_chunks": 1,  # per encoder call; the runner walks longer audio window by window
        "tokens_per_chunk": 0,  # the audio is cross-attended: it takes no decoder positions
        "n_mels": model.config.audio.n_mels,
        "multilingual": t.vocab_size >= 51865,  # openai/whisper's rule: .en models have 51864 ids
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_type": TOKENIZER_TYPE,
        "special_tokens": special,
    }
    return build_bundle(
        model,
        plan_methods(model, opts),
        source,
        tokenizer_path,
        meta,
        out,
        opts,
        progress,
        cache_namespace="whisper:" + source_digest(SOURCE_FILES),
        weights_filter=lambda method, fqn: not any(u in fqn for u in UNUSED.get(method, ())),
    )


# ---------------------------------------------------------------- reading a bundle back (eager reference)


def whisper_from_bundle(bundle_dir: Path, manifest, device: str = "cpu") -> Whisper:
    """The eager Whisper with exactly the bundle's weights, mapped back from each method's FQNs."""
    config = WhisperConfig.from_dict(manifest.model["config"])
    dtype = getattr(torch, manifest.dtype)
    state: dict[str, torch.Tensor] = {}
    files = {m: load_file(str(Path(bundle_dir) / manifest.methods[m].weights), device=device) for m in manifest.methods}
    for k, v in files["audio_encoder"].items():
        head, _, rest = k.partition(".")
        if head in ("cross_k", "cross_v"):
            i, _, param = rest.partition(".")
            state[f"decoder.layers.{i}.encoder_attn.{head[-1]}_proj.{param}"] = v
        else:
            state[k] = v
    for m in ("token_embedding", "text_decoder"):
        state.update({f"decoder.{k}": v for k, v in files[m].items()})
    model = Whisper(config)
    load_state(model, state, source=str(bundle_dir))
    model = model.to(device=device, dtype=dtype).eval()
    model.setup_caches(manifest.model["max_seq_len"], dtype)
    return model


class WhisperEagerEngine:
    """The eager model behind the same interface as runner.whisper.WhisperEngine (`--reference eager`)."""

    def __init__(self, bundle_dir: Path, manifest: Manifest, device: str | None = None):
        device = device or manifest.device
        self._setup(whisper_from_bundle(bundle_dir, manifest, device=device), device)

    @classmethod
    def from_model(cls, model: Whisper, device: str = "cpu") -> WhisperEagerEngine:
        """Over an eager model with its caches set up (tests, and references without a bundle)."""
        engine = cls.__new__(cls)
        engine._setup(model, device)
        return engine

    def _setup(self, model: Whisper, device: str) -> None:
        self.device, self.model = device, model
        self.methods = WhisperMethods.of(model)
        self.mel = LogMelSpectrogram(model.config.audio.n_mels).to(device)
        self.max_seq_len = model.decoder.layers[0].self_attn.kv_cache.k_cache.shape[2]
        self.max_audio_chunks = 1
        self.encoder_dtype = model.decoder.embed_tokens.weight.dtype
        self.cross_kv: torch.Tensor | None = None

    @torch.inference_mode()
    def preprocess(self, wave):
        return self.mel(wave)

    @torch.inference_mode()
    def encode(self, mel):
        self.cross_kv = self.methods.audio_encoder(mel)
        return self.cross_kv

    @torch.inference_mode()
    def embed(self, ids):
        return self.methods.token_embedding(ids)

    @torch.inference_mode()
    def decode(self, embeds, pos):
        return self.methods.text_decoder(embeds, pos, self.cross_kv)

    def reset(self):
        self.model.reset_caches()

    def decode_token(self, token, pos):
        return decode_token(self, token, pos)
