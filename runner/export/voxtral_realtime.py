"""Voxtral Realtime's export: an HF checkpoint or a preset -> the three streaming step methods through the shared
pipeline (compile cache, self-check against eager, atomic publish), for a batch of B streams, 1 <= B <= S:

    preprocessor   waveform f32 [B, 1520] -> mel f32 [B, n_mels, 8]             (one position: 80 ms + STFT edges)
    encoder_step   mel f32 [B, n_mels, 8], position int64 [B] -> audio [B, 1, dim]  conv tails + encoder K/V rings
    decoder_step   token int64 [B, 1], audio [B, 1, dim], position int64 [B], delay f32 [B] -> logits f32 [B, V]
                                                                                    decoder K/V rings
The batch dim is dynamic (one compiled program for every B); every other shape is static: a stream is one
position per step, and the rings bound its state whatever its length. The state has S rows (`--max-streams`,
allocated by the runtime at load): batch row b is stream slot b. The streaming constants (left/right padding,
delay) come from tekken.json's `audio` section, as mistral-common reads them.
"""

from __future__ import annotations

import gc
import hashlib
import json
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config

from runner.bundle import StateSpec
from runner.errors import ExportError
from runner.export.checkpoint import ModelSource, hf_weight_files, no_weights, read_weights
from runner.export.methods import MethodPlan, TracedSlots, dtype_name, method_spec
from runner.export.pipeline import (
    DTYPES,
    ExportOptions,
    ExportReport,
    build_bundle,
    prepare,
    source_digest,
)
from runner.export.registry import ExportFamily, Loaded, LoadRequest, register
from runner.families.voxtral import Tekken
from runner.families.voxtral_realtime import METHODS, NAME, SPECIAL_TOKENS
from runner.fixtures import fixtures_dir
from runner.models.state import empty_model, load_state
from runner.models.voxtral_realtime import (
    DecoderState,
    DecoderStep,
    EncoderState,
    EncoderStep,
    StreamingLogMel,
    VoxtralRealtime,
    step_window,
)
from runner.models.voxtral_realtime_config import RealtimeConfig, preset

SOURCE_FILES = ("models/voxtral_realtime.py", "models/voxtral_realtime_config.py", "export/voxtral_realtime.py")
TINY_DIR = fixtures_dir() / "voxtral-realtime-tiny"  # config.json (HF layout) + tekken.json with streaming config
OFFLINE_STREAMING_BUFFER_TOKENS = 10  # mistral-common's allowance for the longest word, in right padding


# save_pretrained writes the 4.x layout (`language_model.model.*`, `language_model.lm_head.*`: transformers'
# qwen2_audio conversion mapping, reversed); in memory the keys are `model.*` and `lm_head.*`.
_KEY_PREFIXES = (("model.", ""), ("language_model.model.", "language_model."), ("language_model.lm_head.", "lm_head."))


def _normalise_key(k: str) -> str:
    for old, new in _KEY_PREFIXES:
        if k.startswith(old):
            k = new + k[len(old) :]
    return k


def load_checkpoint(ckpt: str | Path, dtype: torch.dtype = torch.float32) -> tuple[VoxtralRealtime, ModelSource]:
    """What `VoxtralRealtimeForConditionalGeneration.save_pretrained` writes: config.json + safetensors (either key
    layout). `lm_head.weight`, tied to the embeddings, is not needed; if present it must equal them."""
    ckpt = Path(ckpt)
    if not (ckpt / "config.json").is_file():
        raise ExportError(f"{ckpt}: missing config.json")
    config = RealtimeConfig.from_hf_file(ckpt / "config.json")
    files = hf_weight_files(ckpt)
    if not files:
        raise no_weights(ckpt)
    raw, digest = read_weights(files)
    state = {_normalise_key(k): v for k, v in raw.items()}
    head = state.pop("lm_head.weight", None)
    emb = state.get("language_model.embed_tokens.weight")
    if head is not None and emb is not None and not torch.equal(head, emb):
        raise ExportError(f"{ckpt}: lm_head.weight differs from the embeddings it is tied to")
    model = VoxtralRealtime(config)
    load_state(model, state, source=str(ckpt))
    return model.to(dtype).eval(), ModelSource("checkpoint", ckpt.resolve().name, digest)


def random_model(name: str, seed: int, dtype: torch.dtype, device: str) -> tuple[VoxtralRealtime, ModelSource]:
    config = preset(name)
    digest = hashlib.sha256(json.dumps([config.to_dict(), seed, device, str(dtype)], sort_keys=True).encode())
    model = empty_model(lambda: VoxtralRealtime(config))
    model = model.to_empty(device=device).to(dtype).init_weights(seed)
    return model.eval(), ModelSource("random-init", name, digest.hexdigest(), seed)


def streaming_constants(tekken_path: Path, samples_per_token: int) -> dict:
    """tekken.json's streaming audio config -> the manifest's padding and delay, in positions."""
    try:
        audio = json.loads(Path(tekken_path).read_text()).get("audio") or {}
        if audio.get("transcription_format") != "streaming":
            raise ExportError(f"{tekken_path}: its audio config is not for streaming (transcription_format)")
        delay_samples = int(float(audio["transcription_delay_ms"]) / 1000 * audio.get("sampling_rate", 16000))
        if delay_samples % samples_per_token:
            raise ExportError(f"{tekken_path}: transcription_delay_ms is not a whole number of positions")
        delay = delay_samples // samples_per_token
        left = int(audio["streaming_n_left_pad_tokens"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{tekken_path}: cannot read its streaming audio config ({e})") from None
    return {
        "num_delay_tokens": delay,
        "n_left_pad_tokens": left,
        "n_right_pad_tokens": delay + 1 + OFFLINE_STREAMING_BUFFER_TOKENS,
    }


DEFAULT_STREAMS = {"cuda": 64, "cpu": 8}  # stream slots: each holds its state on the device from load
CHECK_STREAMS = 2  # the eager model's slots during the self-check: batches of 1 and 2, rows at other positions


def max_streams(opts: ExportOptions) -> int:
    n = opts.max_streams if opts.max_streams is not None else DEFAULT_STREAMS[opts.device]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ExportError(f"--max-streams {n}: a whole number, at least 1")
    return n


def _export(traced: TracedSlots, make_module, example: tuple, batched: list[int | None], streams: int):
    """torch.export of make_module() (built after the previous trace's state is freed: at the largest sizes two
    steps' state would not fit at once) with dim 0 of every input in `batched` (an index per input, None: static)
    dynamic in 1..streams. The example has 2 rows (1 would specialise the dim); size-oblivious tracing keeps the
    program general where the trace would guard on B != 1 (as the Voxtral mel's chunk dim)."""
    traced.release()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    module = traced.add(make_module())
    if streams == 1:
        return torch.export.export(module, tuple(x[:1] if b is not None else x for x, b in zip(example, batched)))
    dim = torch.export.Dim("streams", min=1, max=streams)
    shapes = tuple({0: dim} if b is not None else None for b in batched)
    with fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(module, example, dynamic_shapes=shapes, strict=False)


def plan_methods(model: VoxtralRealtime, opts: ExportOptions) -> list[MethodPlan]:
    """The three methods over the model's weights. The eager model keeps CHECK_STREAMS slots (its steps are the
    self-check's reference); each step is traced over a state of max_streams slots that lives only while it
    compiles (at 4B, 64 slots of both steps' state beside the eager model's would not fit the GPU twice)."""
    c, dev, dtype = model.config, torch.device(opts.device), DTYPES[opts.dtype]
    n_mels, frames, dim, name = c.audio.n_mels, c.mel_frames_per_token, c.text.dim, dtype_name(dtype)
    s = max_streams(opts)
    g = torch.Generator().manual_seed(1234)
    wave = lambda b=2: (torch.randn(b, step_window(frames), generator=g) * 0.1).to(dev)  # noqa: E731
    mel = lambda b=2: torch.randn(b, n_mels, frames, generator=g).to(dev)  # noqa: E731
    pos = lambda *p: torch.tensor(p, dtype=torch.int64, device=dev)  # noqa: E731
    tok = lambda b=2: torch.randint(0, c.text.vocab_size, (b, 1), generator=g).to(dev)  # noqa: E731
    audio = lambda b=2: (torch.randn(b, 1, dim, generator=g) * 0.5).to(dev, dtype)  # noqa: E731
    delay = lambda b=2: torch.full((b,), float(c.num_delay_tokens), device=dev)  # noqa: E731
    batch = {"min": 1, "max": s}
    pre = StreamingLogMel(n_mels).to(dev)
    enc, dec = EncoderStep(model), DecoderStep(model)
    pairs = _check_positions(c, s)
    state = {"encoder_step": _state_specs(enc, s), "decoder_step": _state_specs(dec, s)}
    traced = TracedSlots("state.")  # each step's state of max_streams rows: freed once compiled
    # the largest state first, the preprocessor (no state) last: each step's traced state is freed once it is
    # compiled, so the decoder's is gone before the self-check loads the program with its own state
    return [
        MethodPlan(
            "decoder_step",
            dec,
            (tok(), audio(), pos(0, 0), delay()),
            None,
            method_spec(
                "decoder_step",
                [
                    ("token", "int64", [batch, 1]),
                    ("audio", name, [batch, 1, dim]),
                    ("position", "int64", [batch]),
                    ("delay", "float32", [batch]),
                ],
                [("logits", "float32", [batch, c.text.vocab_size])],
                state["decoder_step"],
            ),
            [(tok(len(p)), audio(len(p)), pos(*p), delay(len(p))) for p in pairs],
            export=lambda: _export(
                traced,
                lambda: DecoderStep(model, DecoderState(c, s, dtype, dev)),
                (tok(), audio(), pos(0, 0), delay()),
                [0] * 4,
                s,
            ),
            release=traced.release,
        ),
        MethodPlan(
            "encoder_step",
            enc,
            (mel(), pos(0, 0)),
            None,
            method_spec(
                "encoder_step",
                [("mel", "float32", [batch, n_mels, frames]), ("position", "int64", [batch])],
                [("audio", name, [batch, 1, dim])],
                state["encoder_step"],
            ),
            [(mel(len(p)), pos(*p)) for p in pairs],
            export=lambda: _export(
                traced, lambda: EncoderStep(model, EncoderState(c, s, dtype, dev)), (mel(), pos(0, 0)), [0, 0], s
            ),
            release=traced.release,
        ),
        MethodPlan(
            "preprocessor",
            pre,
            (wave(),),
            None,
            method_spec(
                "preprocessor",
                [("waveform", "float32", [batch, step_window(frames)])],
                [("mel", "float32", [batch, n_mels, frames])],
            ),
            [(wave(1),), (wave(2)[: min(2, s)],)],
            export=lambda: _export(traced, lambda: pre, (wave(),), [0], s),
        ),
    ]


def _check_positions(c: RealtimeConfig, streams: int) -> list[tuple[int, ...]]:
    """The self-check's positions: in order, then far past both windows (the rings wrap, and the masks must
    follow); one stream alone, and two at different positions (row 1 starts later); batches of 2 only where the
    export has 2 slots."""
    far = 4 + max(c.audio.sliding_window, c.text.sliding_window)
    return [(0,), (1, 0), (2, 1), (3,), (far, far - 7)] if streams > 1 else [(0,), (1,), (2,), (3,), (far,)]


def _state_specs(step: torch.nn.Module, streams: int) -> dict[str, StateSpec]:
    """The step's state buffers as the runtime allocates them: `streams` rows."""
    return {
        f"state.{k}": StateSpec([streams, *t.shape[1:]], dtype_name(t.dtype)) for k, t in step.state.named_buffers()
    }


def export_voxtral_realtime(
    model: VoxtralRealtime, source: ModelSource, tekken_path: Path, out: Path, opts: ExportOptions, progress=None
) -> ExportReport:
    tok = Tekken.from_file(tekken_path)
    special = {k: tok.special_id(v) for k, v in SPECIAL_TOKENS.items()}
    if tok.vocab_size > model.config.text.vocab_size:
        raise ExportError(
            f"{tekken_path}: {tok.vocab_size} tokens do not fit the model's vocab ({model.config.text.vocab_size})"
        )
    stream = streaming_constants(tekken_path, model.config.samples_per_token)
    streams = max_streams(opts)
    model, meta = prepare(model, source, opts, EXPORT)
    model.setup_caches(dtype=DTYPES[opts.dtype], streams=min(CHECK_STREAMS, streams))
    meta |= stream | {
        "mel_frames_per_token": model.config.mel_frames_per_token,
        "max_streams": streams,
        "tokenizer": "tekken.json",
        "special_tokens": special,
    }
    key = {"family": NAME, "sources": source_digest(SOURCE_FILES), "max_streams": streams}
    return build_bundle(model, plan_methods(model, opts), source, tekken_path, meta, out, opts, progress, key)


# ---------------------------------------------------------------- what `export` starts from

PRESET_NAMES = ("tiny-realtime", "voxtral-mini-4b-realtime")
SEEDED_PRESET = "tiny-realtime"  # the others need --random-init or a checkpoint
BUNDLE_PREFIX = "voxtral-"


def is_realtime_checkpoint(ckpt: Path) -> bool:
    try:
        return json.loads((Path(ckpt) / "config.json").read_text()).get("model_type") == "voxtral_realtime"
    except (OSError, ValueError, AttributeError):
        return False  # the Voxtral loader says what is wrong with it


def load(request: LoadRequest) -> Loaded:
    """A checkpoint (with its tekken.json), or a preset with seeded weights (tiny-realtime always; the real size
    only with --random-init)."""
    checkpoint, dtype = request.checkpoint, DTYPES[request.dtype]
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        if not (checkpoint / "tekken.json").is_file():
            raise ExportError(f"{checkpoint}: missing tekken.json")
        model, source = load_checkpoint(checkpoint, dtype)
        return Loaded(checkpoint.resolve().name, model, source, checkpoint / "tekken.json")
    name = request.preset
    if name != SEEDED_PRESET and not request.random_init:
        raise ExportError(f"--preset {name}: no weights; pass --checkpoint DIR or --random-init")
    model, source = random_model(name, request.seed, dtype, request.device)
    return Loaded(name, model, source, TINY_DIR / "tekken.json")


EXPORT = register(
    ExportFamily(
        NAME,
        presets=PRESET_NAMES,
        load=load,
        export=export_voxtral_realtime,
        methods=METHODS,
        bundle_prefix=BUNDLE_PREFIX,
        claims_checkpoint=is_realtime_checkpoint,
        streams=True,
    )
)
