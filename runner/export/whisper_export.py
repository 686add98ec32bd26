"""Export Whisper into a bundle with the same exporter pieces as Voxtral (compile_method, the compile cache,
the exported-vs-eager self-check, the atomic publish), and the eager engine that reads a Whisper bundle back.

Methods (names and order as a Voxtral bundle, so Program, delegate and `inspect` are unchanged):
    preprocessor     waveform f32 [480000] -> mel f32 [1, n_mels, 3000]            (one 30 s window)
    audio_encoder    mel [1, n_mels, 3000] -> cross_kv [L, 2, H, 1500, D]
    token_embedding  ids int64 [1, S] -> embeds [1, S, d]                            (S = 1..448)
    text_decoder     embeds [1, S, d], cache_position [S], cross_kv -> logits f32 [1, vocab]; KV cache in place
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.export import Dim

from runner import __version__
from runner.audio import N_FRAMES, N_SAMPLES
from runner.bundle import FORMAT_VERSION, Manifest, MethodSpec, StateSpec, TensorSpec, file_entries, write_manifest
from runner.errors import ExportError
from runner.export.checkpoint import ModelSource, load_state
from runner.export.exporter import (
    DTYPES,
    ExportOptions,
    ExportReport,
    MethodPlan,
    _dim,
    _dtype_name,
    _gpu_arch,
    _publish,
    cache_key,
    compile_method,
    default_cache_dir,
    method_weights,
    self_check,
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
    state = {
        f"layers.{i}.self_attn.kv_cache.{k}": StateSpec([1, t.n_heads, S, t.head_dim], name)
        for i in range(t.n_layers)
        for k in ("k_cache", "v_cache")
    }

    def spec(method, inputs, outputs, state=None):
        return MethodSpec(
            method,
            f"{method}.so",
            f"{method}.safetensors",
            [TensorSpec(*x) for x in inputs],
            [TensorSpec(*x) for x in outputs],
            state or {},
        )

    mel_shape = [1, c.audio.n_mels, N_FRAMES]
    return [
        MethodPlan(
            "preprocessor",
            LogMelSpectrogram(c.audio.n_mels).to(dev),
            (),
            None,
            spec("preprocessor", [("waveform", "float32", [N_SAMPLES])], [("mel", "float32", mel_shape)]),
            [(wave(),)],
        ),
        MethodPlan(
            "audio_encoder",
            m.audio_encoder,
            (mel(),),
            None,
            spec("audio_encoder", [("mel", name, mel_shape)], [("cross_kv", name, kv_shape)]),
            [(mel(),)],
        ),
        MethodPlan(
            "token_embedding",
            m.token_embedding,
            (ids(3),),
            ({1: seq},),
            spec("token_embedding", [("ids", "int64", [1, _dim(1, S)])], [("embeds", name, [1, _dim(1, S), d])]),
            [(ids(5),), (ids(1),)],
        ),
        MethodPlan(
            "text_decoder",
            m.text_decoder,
            (emb(3), torch.arange(3, device=dev), kv),
            ({1: seq}, {0: seq}, None),
            spec(
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


def _sources_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in SOURCE_FILES:
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def export_whisper_bundle(
    model: Whisper, source: ModelSource, tokenizer_path: Path, out: Path, opts: ExportOptions, progress=None
) -> ExportReport:
    """Build a Whisper bundle into `out` (replaced atomically), checked against eager before it is published."""
    from runner.program import Program

    out, dtype, t = Path(out), DTYPES[opts.dtype], model.config.text
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda: no CUDA device visible to torch")
    opts = replace(opts, max_seq_len=min(opts.max_seq_len, t.max_target_positions), max_audio_chunks=1)
    tok = WhisperTokenizer(tokenizer_path, t.vocab_size)
    special = {k: tok.special_id(v) for k, v in SPECIAL_TOKENS.items()}
    model = model.to(device=opts.device, dtype=dtype).eval()
    model.setup_caches(opts.max_seq_len, dtype)
    plans = plan_methods(model, opts)
    cache_root = Path(opts.cache_dir or default_cache_dir()) / "compiled"
    extra = _sources_digest()
    report = ExportReport()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        debug_dir = stage / "debug" if opts.debug else None
        for plan in plans:
            key = hashlib.sha256((cache_key(model, source, opts, plan.name) + extra).encode()).hexdigest()[:32]
            cached = cache_root / f"whisper-{key}" / f"{plan.name}.so"
            t0 = time.perf_counter()
            report.cached[plan.name] = cached.is_file()
            if cached.is_file():
                shutil.copyfile(cached, stage / f"{plan.name}.so")
            else:
                if progress:
                    progress(plan.name, "compiling")
                with tempfile.TemporaryDirectory(dir=stage) as work:
                    shutil.copyfile(compile_method(plan, opts, Path(work), debug_dir), stage / f"{plan.name}.so")
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
                shutil.copyfile(stage / f"{plan.name}.so", tmp)
                tmp.replace(cached)
            report.compile_seconds[plan.name] = round(time.perf_counter() - t0, 2)
            unused = UNUSED.get(plan.name, ())
            weights = {k: v.cpu() for k, v in method_weights(plan).items() if not any(u in k for u in unused)}
            save_file(weights, str(stage / plan.spec.weights))
            if progress:
                done = "cached" if report.cached[plan.name] else f"compiled in {report.compile_seconds[plan.name]:.1f}s"
                progress(plan.name, done)
        shutil.copyfile(tokenizer_path, stage / TOKENIZER_FILE)
        files = sorted(p.name for p in stage.iterdir() if p.is_file())
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            torch_version=torch.__version__,
            device=opts.device,
            gpu_arch=_gpu_arch() if opts.device == "cuda" else None,
            dtype=_dtype_name(dtype),
            model={
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
                "compile_seconds": report.compile_seconds,
            },
            methods={p.name: p.spec for p in plans},
            files=file_entries(stage, files),
            created_by=f"runner {__version__}",
        )
        write_manifest(stage, manifest)
        if opts.check:
            if progress:
                progress("all", "checking against eager")
            with Program.load(stage, device=opts.device) as program:
                for plan in plans:
                    if plan.name == "text_decoder":
                        model.reset_caches()
                        program.reset_state()
                    report.max_error[plan.name] = self_check(program, plan, model, dtype)
        stage.chmod(0o755)
        _publish(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return report


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
