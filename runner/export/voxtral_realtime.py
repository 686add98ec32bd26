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

import dataclasses
import gc
import hashlib
import json
import logging
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config

from runner.bundle import StateSpec
from runner.errors import ExportError, RunnerError
from runner.export.checkpoint import (
    ModelSource,
    check_host_memory,
    hf_weight_files,
    host_memory,
    no_weights,
    read_weights,
)
from runner.export.methods import MethodPlan, TracedSlots, dtype_name, method_spec
from runner.export.options import DTYPES, ExportOptions
from runner.export.pipeline import ExportReport, build_bundle, prepare, source_digest
from runner.export.registry import ExportFamily, Loaded, LoadRequest, register
from runner.export.self_check import LOAD_HEADROOM
from runner.families.voxtral import Tekken
from runner.families.voxtral_realtime import METHODS, NAME, SPECIAL_TOKENS
from runner.fixtures import fixtures_dir
from runner.json_file import TOKENIZER_MAX_BYTES, read_json_object
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
from runner.models.voxtral_realtime_config import ADA_DIM, CONV_STRIDE, RealtimeConfig, preset
from runner.runtime.weights import free_device_bytes

log = logging.getLogger(__name__)

SOURCE_FILES = ("models/voxtral_realtime.py", "models/voxtral_realtime_config.py", "export/voxtral_realtime.py")
TINY_DIR = fixtures_dir() / "voxtral-realtime-tiny"  # config.json (HF layout) + tekken.json with streaming config
OFFLINE_STREAMING_BUFFER_TOKENS = 10  # mistral-common's allowance for the longest word, in right padding
MAX_PAD_POSITIONS = 1 << 12  # a delay or left padding of more (over 5 minutes) is not a streaming config


# save_pretrained writes the 4.x layout (`language_model.model.*`, `language_model.lm_head.*`: transformers'
# qwen2_audio conversion mapping, reversed); in memory the keys are `model.*` and `lm_head.*`.
_KEY_PREFIXES = (("model.", ""), ("language_model.model.", "language_model."), ("language_model.lm_head.", "lm_head."))


def _normalise_key(k: str) -> str:
    for old, new in _KEY_PREFIXES:
        if k.startswith(old):
            k = new + k[len(old) :]
    return k


def load_checkpoint(
    ckpt: str | Path, dtype: torch.dtype = torch.float32, tokenizer: Path | None = None
) -> tuple[VoxtralRealtime, ModelSource]:
    """What `VoxtralRealtimeForConditionalGeneration.save_pretrained` writes: config.json + safetensors (either key
    layout). `lm_head.weight`, tied to the embeddings, is not needed; if present it must equal them. The config
    and the `tokenizer` file, if named, are checked before any weight is read."""
    ckpt = Path(ckpt)
    if not (ckpt / "config.json").is_file():
        raise ExportError(f"{ckpt}: missing config.json")
    config = RealtimeConfig.from_hf_file(ckpt / "config.json")
    files = hf_weight_files(ckpt)
    if not files:
        raise no_weights(ckpt)
    if tokenizer is not None:
        Tekken.from_file(tokenizer)
    check_host_memory(ckpt / "config.json", param_count(config), host_memory())
    raw, digest = read_weights(files)
    state = {_normalise_key(k): v for k, v in raw.items()}
    head = state.pop("lm_head.weight", None)
    emb = state.get("language_model.embed_tokens.weight")
    if head is not None and emb is not None and not torch.equal(head, emb):
        raise ExportError(f"{ckpt}: lm_head.weight differs from the embeddings it is tied to")
    model = VoxtralRealtime(config)
    load_state(model, state, source=str(ckpt))
    return model.to(dtype).eval(), ModelSource("checkpoint", ckpt.resolve().name, digest)


def param_count(c: RealtimeConfig) -> int:
    """The model's parameters (runner/models/voxtral_realtime.py's modules; the output projection is the
    embeddings), counted from its config alone."""
    a, t = c.audio, c.text
    convs = a.n_mels * a.dim * 3 + a.dim + a.dim * a.dim * 3 + a.dim
    qkv = 3 * a.n_heads * a.head_dim
    audio_layer = a.dim * qkv + qkv + a.n_heads * a.head_dim * a.dim + a.dim + 3 * a.dim * a.ffn_dim + 3 * a.dim
    projector = a.dim * c.downsample_factor * t.dim + t.dim * t.dim
    attention = t.dim * (t.n_heads + 2 * t.n_kv_heads) * t.head_dim + t.n_heads * t.head_dim * t.dim
    text_layer = attention + 3 * t.dim * t.ffn_dim + 2 * t.dim + 2 * ADA_DIM * t.dim
    text = t.vocab_size * t.dim + t.n_layers * text_layer + t.dim
    return convs + a.n_layers * audio_layer + a.dim + projector + text


def random_model(name: str, seed: int, dtype: torch.dtype, device: str) -> tuple[VoxtralRealtime, ModelSource]:
    config = preset(name)
    digest = hashlib.sha256(json.dumps([config.to_dict(), seed, device, str(dtype)], sort_keys=True).encode())
    model = empty_model(lambda: VoxtralRealtime(config))
    model = model.to_empty(device=device).to(dtype).init_weights(seed)
    return model.eval(), ModelSource("random-init", name, digest.hexdigest(), seed)


def streaming_constants(tekken_path: Path, samples_per_token: int) -> dict:
    """tekken.json's streaming audio config -> the manifest's padding and delay, in positions."""
    audio = read_json_object(tekken_path, ExportError, TOKENIZER_MAX_BYTES).get("audio") or {}
    if not isinstance(audio, dict):
        raise ExportError(f"{tekken_path}: its audio config is not a JSON object")
    try:
        if audio.get("transcription_format") != "streaming":
            raise ExportError(f"{tekken_path}: its audio config is not for streaming (transcription_format)")
        delay_samples = int(float(audio["transcription_delay_ms"]) / 1000 * audio.get("sampling_rate", 16000))
        if delay_samples % samples_per_token:
            raise ExportError(f"{tekken_path}: transcription_delay_ms is not a whole number of positions")
        delay = delay_samples // samples_per_token
        left = int(audio["streaming_n_left_pad_tokens"])
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise ExportError(f"{tekken_path}: cannot read its streaming audio config ({e})") from None
    for name, positions in (("transcription_delay_ms", delay), ("streaming_n_left_pad_tokens", left)):
        if not 0 <= positions <= MAX_PAD_POSITIONS:
            raise ExportError(f"{tekken_path}: audio.{name} is {positions} positions (0 to {MAX_PAD_POSITIONS})")
    return {
        "num_delay_tokens": delay,
        "n_left_pad_tokens": left,
        "n_right_pad_tokens": delay + 1 + OFFLINE_STREAMING_BUFFER_TOKENS,
    }


DEFAULT_STREAMS = {"cuda": 64, "cpu": 8}  # stream slots, at most: each holds its state on the device from load
CHECK_STREAMS = 2  # the eager model's slots during the self-check: batches of 1 and 2, rows at other positions
# Beside the weights and the state while a step compiles: the trace's activations, Inductor's benchmark buffers,
# the allocator's fragmentation.
COMPILE_HEADROOM = 4 << 30


def state_bytes_per_stream(c: RealtimeConfig, dtype: torch.dtype) -> tuple[int, int]:
    """One stream slot's state in bytes, (encoder_step's, decoder_step's): models/voxtral_realtime.py's
    EncoderState (the convolutions' tails, each layer's K/V ring over its window and one step's frames) and
    DecoderState (each layer's K/V ring over its window)."""
    a, t = c.audio, c.text
    ring = a.sliding_window - 1 + c.downsample_factor
    enc = a.n_mels * 2 + a.dim * (3 - CONV_STRIDE) + a.n_layers * 2 * a.n_heads * ring * a.head_dim
    dec = t.n_layers * 2 * t.n_kv_heads * t.sliding_window * t.head_dim
    size = torch.empty((), dtype=dtype).element_size()
    return enc * size, dec * size


def bytes_needed(c: RealtimeConfig, dtype: torch.dtype, streams: int) -> int:
    """The device memory an export of `streams` slots takes at its peak (W: the weights in `dtype`; E, D: one
    slot's encoder and decoder state), the larger of
      compiling a step: W + CHECK_STREAMS x (E + D) (the eager reference's state) + 2 x streams x max(E, D) (the
        step's traced state, which AOTInductor clones: aoti.release_compile_copies) + COMPILE_HEADROOM;
      loading the bundle for the self-check: W (the eager model, which stays where the bundle's weights fit beside
        it: self_check.make_room) + CHECK_STREAMS x (E + D) + W (the bundle's) + streams x (E + D) (both steps'
        state, as `run` allocates it) + self_check.LOAD_HEADROOM."""
    weights = param_count(c) * torch.empty((), dtype=dtype).element_size()
    enc, dec = state_bytes_per_stream(c, dtype)
    eager = weights + CHECK_STREAMS * (enc + dec)
    compiling = eager + 2 * streams * max(enc, dec) + COMPILE_HEADROOM
    loading = eager + weights + streams * (enc + dec) + LOAD_HEADROOM
    return max(compiling, loading)


def streams_that_fit(c: RealtimeConfig, dtype: torch.dtype, most: int, free: int) -> int:
    """The most stream slots, up to `most`, whose export fits in `free` bytes (bytes_needed); 0: not even one."""
    least, most = 0, most
    while least < most:  # bytes_needed grows with the slots
        mid = (least + most + 1) // 2
        least, most = (mid, most) if bytes_needed(c, dtype, mid) <= free else (least, mid - 1)
    return least


def device_free_bytes(model: torch.nn.Module, device: str) -> int | None:
    """The export device's free memory, counting the model's tensors already on it as free (bytes_needed counts
    the weights); None off CUDA, where the slots are not sized."""
    if torch.device(device).type != "cuda":
        return None
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if t.is_cuda)
    return free_device_bytes() + held


def max_streams(opts: ExportOptions, config: RealtimeConfig | None = None, free: int | None = None) -> int:
    """The export's stream slots: --max-streams, refused if its export does not fit in `free` bytes; without it,
    the most up to the device's default that fit (all of them where `free` is None: off CUDA)."""
    n = opts.max_streams if opts.max_streams is not None else DEFAULT_STREAMS[opts.device]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ExportError(f"--max-streams {n}: a whole number, at least 1")
    if config is None or free is None:
        return n
    dtype = DTYPES[opts.dtype]
    fit = streams_that_fit(config, dtype, n, free)
    if fit == n:
        return n
    have = f"{free / 2**30:.1f} GiB of {opts.device} memory free"
    if fit == 0:
        need = bytes_needed(config, dtype, 1) / 2**30
        raise ExportError(f"voxtral-realtime: {have}; an export of even 1 stream slot needs {need:.1f} GiB")
    if opts.max_streams is not None:
        raise ExportError(f"--max-streams {n}: does not fit ({have}); {fit} stream slots fit")
    log.warning("%d stream slots, not the default %d: %d fit (%s)", fit, n, fit, have)
    return fit


def _export(traced: TracedSlots, make_module, example: tuple, batched: list[int | None], streams: int):
    """torch.export of make_module() (built after the previous trace's state is freed: at the largest sizes two
    steps' state would not fit at once) with dim 0 of every input in `batched` (an index per input, None: static)
    dynamic in 1..streams. The example has 2 rows (1 would specialise the dim); size-oblivious tracing keeps the
    program general where the trace would guard on B != 1 (as the Voxtral mel's chunk dim), and so does the compile
    (the plans' size_oblivious)."""
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
            size_oblivious=True,
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
            size_oblivious=True,
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
            size_oblivious=True,
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
    streams = max_streams(opts, model.config, device_free_bytes(model, opts.device))
    opts = dataclasses.replace(opts, max_streams=streams)  # the methods are planned for the slots that fit
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


def is_realtime_checkpoint(ckpt: Path) -> bool:
    try:
        return read_json_object(Path(ckpt) / "config.json").get("model_type") == "voxtral_realtime"
    except RunnerError:
        return False  # the Voxtral loader says what is wrong with it


def load(request: LoadRequest) -> Loaded:
    """A checkpoint (with its tekken.json), or a preset with seeded weights (tiny-realtime always; the real size
    only with --random-init)."""
    checkpoint, dtype = request.checkpoint, DTYPES[request.dtype]
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        if not (checkpoint / "tekken.json").is_file():
            raise ExportError(f"{checkpoint}: missing tekken.json")
        model, source = load_checkpoint(checkpoint, dtype, tokenizer=checkpoint / "tekken.json")
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
        claims_checkpoint=is_realtime_checkpoint,
        streams=True,
    )
)
