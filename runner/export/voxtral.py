"""Voxtral's export: its five methods planned over one model (the decoder twice: `text_decoder` for any
prompt length, `text_decoder_step` for one token, on CUDA the Triton decode kernels), then the shared pipeline.
With `--max-batch N` > 1 a sixth, `text_decoder_batch`: one token for each of B <= N sequences in their own slots."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config
from torch import nn
from torch.export import Dim

from runner.audio import CHUNK_LENGTH, MIN_ANSWER_ROOM, N_SAMPLES, PROMPT_ROOM, TOKENS_PER_CHUNK, context_for
from runner.bundle import BATCH_METHOD, BATCH_STATE_PREFIX, METHOD_NAMES, StateSpec
from runner.errors import ExportError, RunnerError
from runner.export.checkpoint import (
    FIXTURES,
    TINY_CHECKPOINT,
    ModelSource,
    load_checkpoint,
    random_model,
    write_tiny_checkpoint,
)
from runner.export.methods import (
    MethodPlan,
    TracedSlots,
    dim,
    dtype_name,
    kv_cache_state,
    method_spec,
    preprocessor_plan,
)
from runner.export.options import DTYPES, ExportOptions
from runner.export.pipeline import ExportReport, build_bundle, prepare, source_digest
from runner.export.quant import apply_quant
from runner.export.registry import ExportFamily, Loaded, LoadRequest, Redraw, register
from runner.families.voxtral import NAME, SPECIAL_TOKENS, Tekken
from runner.models import fp8_linear, voxtral
from runner.models.quant_linear import QuantLinear
from runner.models.voxtral import Voxtral
from runner.models.voxtral_batch import BatchDecoder, SlotCaches
from runner.models.voxtral_config import PRESETS

# Hashed into the compile-cache key beside the pipeline's own sources: editing these must recompile.
SOURCE_FILES = (
    "models/voxtral.py",
    "models/voxtral_config.py",
    "models/voxtral_batch.py",
    "export/voxtral.py",
    "export/decode_step.py",
    "export/kernels.py",
    "export/kernels_attention.py",
    "export/kernels_prefill.py",
    "export/kernels_batch.py",
    "export/kernels_int4.py",
    "export/kernels_fp8.py",
    "export/quant.py",
    "models/quant_linear.py",
    "models/fp8_linear.py",
)
# What `--quant int4` / `fp8` replaces: the decoder's linear layers (fnmatch patterns over the model's module names).
QUANT_MODULES = ("language_model.model.layers.*", "language_model.lm_head")
SEEDED_PRESET = "tiny"  # its weights are seeded, written once as a real checkpoint and loaded through the loader


def plan_methods(model: Voxtral, opts: ExportOptions) -> list[MethodPlan]:
    c, dev, dtype = model.config, torch.device(opts.device), DTYPES[opts.dtype]
    K, S, H = opts.max_audio_chunks, opts.max_seq_len, c.text.dim
    g = torch.Generator().manual_seed(1234)
    wave = lambda k: (torch.randn(k * N_SAMPLES, generator=g) * 0.1).to(dev)  # noqa: E731
    mel = lambda k: torch.randn(k, c.audio.n_mels, 3000, generator=g).to(dev, dtype)  # noqa: E731
    ids = lambda s: torch.randint(0, c.text.vocab_size, (1, s), generator=g).to(dev)  # noqa: E731
    emb = lambda s: (torch.randn(1, s, H, generator=g) * 0.5).to(dev, dtype)  # noqa: E731
    # one chunk at most: a static chunk dim (torch.export refuses Dim(min=1, max=1))
    chunks, seq = (Dim("chunks", min=1, max=K) if K > 1 else Dim.STATIC), Dim("seq", min=1, max=S)
    m = voxtral.methods(model)
    state = kv_cache_state(c.text.n_layers, [1, c.text.n_kv_heads, S, c.text.head_dim], dtype)
    small = min(2, K)
    batched = [batch_plan(model, opts, state)] if opts.max_batch > 1 else []
    return [
        preprocessor_plan(c.audio.n_mels, dev, K, [(wave(1),), (wave(small),)]),
        encoder_plan(model, opts, m.audio_encoder, mel, chunks),
        MethodPlan(
            "token_embedding",
            m.token_embedding,
            (ids(3),),
            ({1: seq},),
            method_spec(
                "token_embedding",
                [("ids", "int64", [1, dim(1, S)])],
                [("embeds", dtype_name(dtype), [1, dim(1, S), H])],
            ),
            [(ids(5),), (ids(1),)],
        ),
        prefill_plan(model, opts, state, emb, seq, m.text_decoder),
        step_plan(model, opts, state, emb, m.text_decoder),
        *batched,
    ]


def encoder_plan(model: Voxtral, opts: ExportOptions, written_out: nn.Module, mel, chunks) -> MethodPlan:
    """audio_encoder: on CUDA its residual adds and LayerNorms through the Triton op of kernels_prefill.py (one pass
    over each row; Inductor's fused kernel read them twice), with the written-out encoder as its fallback."""
    c, dtype, K = model.config, DTYPES[opts.dtype], opts.max_audio_chunks
    small = min(2, K)
    plan = MethodPlan(
        "audio_encoder",
        written_out,
        (mel(small),),
        ({0: chunks},),
        method_spec(
            "audio_encoder",
            [("mel", dtype_name(dtype), [dim(1, K), c.audio.n_mels, 3000])],
            [("audio_embeds", dtype_name(dtype), [1, dim(TOKENS_PER_CHUNK, K * TOKENS_PER_CHUNK), c.text.dim])],
        ),
        [(mel(small),), (mel(1),)],
    )
    if torch.device(opts.device).type != "cuda":
        return plan
    from runner.export import kernels_prefill  # imports Triton

    fallback = replace(plan, key_extra={"fallback": "written-out"})
    module = voxtral.AudioEncoderMethod(model, kernels_prefill.KERNELS)
    return replace(plan, module=module, reference=written_out, fallback=fallback)


def prefill_plan(model: Voxtral, opts: ExportOptions, state, emb, seq, reference: nn.Module) -> MethodPlan:
    """text_decoder: a prompt into an empty cache, attending to the prompt alone, so the cost follows the prompt,
    not the cache. On CUDA through the Triton flash attention and SiLU · up (torch 2.11 CUDA could not export the
    written-out prompt-only form for a dynamic length), with the whole-cache decoder as its
    fallback: should the op not compile, the export still gives a bundle, and `model.fallbacks` says so. On CUDA
    with a head size the op cannot tile, the whole-cache decoder itself: the same answer, at the cache's cost.
    An int4 model's prefill dequantises its weights through the Triton op of kernels_int4.py on CUDA; an fp8 model's
    multiplies on the fp8 tensor cores (fp8_linear.scaled_mm) on an sm_89+ GPU, its fallbacks a chain
    (`scaled_mm_prefill`)."""
    c, dev, dtype, S = model.config.text, torch.device(opts.device), DTYPES[opts.dtype], opts.max_seq_len
    tiles = _triton_tiles(model, opts.device)
    if tiles:
        from runner.export import kernels_prefill  # imports Triton

        module = model.prefiller(kernels_prefill.KERNELS)
    else:
        module = model.decoder() if dev.type == "cuda" else model.prefiller()
    plan = MethodPlan(
        "text_decoder",
        module,
        (emb(3), torch.arange(3, device=dev)),
        ({1: seq}, {0: seq}),
        method_spec(
            "text_decoder",
            [("embeds", dtype_name(dtype), [1, dim(1, S), c.dim]), ("cache_position", "int64", [dim(1, S)])],
            [("logits", "float32", [1, c.vocab_size])],
            state,
        ),
        # against the decoder that attends to the cache; the step after it only matches if the cache was written
        [(emb(7), torch.arange(7, device=dev))],
        reference=reference,
    )
    if tiles:
        plan.fallback = replace(plan, module=model.decoder(), key_extra={"fallback": "whole-cache"})
        if any(isinstance(x, QuantLinear) for x in module.modules()):
            from runner.export import kernels_int4  # imports Triton

            # the int4 weights dequantised by the Triton op (the fallback keeps plain torch's)
            plan.export = lambda: kernels_int4.export_dequantizing(module, plan.example, plan.dynamic_shapes)
    if fp8_linear.scaled_mm_serves(opts.device, module):
        scaled_mm_prefill(plan)
    return plan


def scaled_mm_prefill(plan: MethodPlan) -> None:
    """The prefill's fp8 layers on the fp8 tensor cores (`_scaled_mm`), checked against the eager reference computing
    the same: the activations' rounding to e4m3 alone parts a deep random-init decoder from the dequantised eager
    one by more than the check's tolerance, and the check is of the compile. With e4m3 activations a deep
    random-init decoder moves by about the tolerance when its input moves by one bf16 rounding, so a compile's
    different rounding can fail a correct prefill (benchmarks/NOTES.md): a failed check, like a failed compile,
    takes the next link of a chain, each held to the dequantised reference:
      1. the prompt's GEMMs through kernels_fp8's op over the codes (no activation rounded: bf16's tolerance);
      2. the plan as it was, dequantising its weights (the weights' bf16 copy written and read per prompt);
      3. that plan's own fallback (on CUDA the whole-cache decoder, which attends over the whole cache)."""
    from runner.export import kernels_fp8  # imports Triton

    module = plan.module
    dequantised = replace(plan, key_extra={"fallback": "dequantised"})  # its fallback: the plan's, as it was
    plan.fallback = replace(
        plan,
        key_extra={"fp8": "fp8_mm"},
        export=lambda: _export_through(module, plan, kernels_fp8.widened),
        fallback=dequantised,
        fallback_on_mismatch=True,
    )
    plan.key_extra = {"fp8": "scaled_mm"}
    plan.fallback_on_mismatch = True
    plan.export = lambda: _export_through(module, plan, fp8_linear.scaled_mm)
    plan.reference = ScaledReference(plan.reference or module)


class ScaledReference(nn.Module):
    """`inner` run eagerly with its fp8 layers through `scaled_mm`, as the prefill `_export_through` it compiles."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        with fp8_linear.scaled_prefill(self.inner):
            return self.inner(*args)


def _export_through(module: nn.Module, plan: MethodPlan, matmul) -> torch.export.ExportedProgram:
    """torch.export of the prefill with its fp8 layers through `matmul` (the eager model keeps dequantising)."""
    with fp8_linear.matmul_through(module, matmul):
        return torch.export.export(module, plan.example, dynamic_shapes=plan.dynamic_shapes, strict=False)


def step_plan(model: Voxtral, opts: ExportOptions, state, emb, reference: nn.Module) -> MethodPlan:
    """text_decoder_step: one token into the cache text_decoder wrote, naming its weights file (one copy of the
    weights and the KV cache serves both). On CUDA the Triton decode kernels (and aten's tinygemm for int4 layers),
    with the decoder itself at S = 1 as the fallback: should a kernel not compile under this torch, the export
    still gives a bundle (slower steps), and `model.fallbacks` says so."""
    c, dev, dtype = model.config.text, torch.device(opts.device), DTYPES[opts.dtype]
    plan = MethodPlan(
        "text_decoder_step",
        decode_step_module(model, opts.device, opts.pdl),
        (emb(1), torch.tensor([3], device=dev)),
        None,  # static: one token
        replace(
            method_spec(
                "text_decoder_step",
                [("embeds", dtype_name(dtype), [1, 1, c.dim]), ("cache_position", "int64", [1])],
                [("logits", "float32", [1, c.vocab_size])],
                state,
            ),
            weights="text_decoder.safetensors",  # the same module: one copy of the weights and the KV cache
        ),
        # three steps from an empty cache, each attending to the ones before, against the written-out decoder
        [(emb(1), torch.tensor([i], device=dev)) for i in range(3)],
        reference=reference,
    )
    if _triton_tiles(model, opts.device):
        plan.fallback = replace(plan, module=model.decoder(), key_extra={"fallback": "decoder"})
    return plan


CHECK_SLOTS = 2  # the eager model's slots for the self-check: batches of 1 and 2, rows at other positions


def batch_plan(model: Voxtral, opts: ExportOptions, state) -> MethodPlan:
    """text_decoder_batch: embeds [B, 1, H], cache_position [B] -> logits [B, V], B = 1..max_batch, over a slot
    cache of max_batch rows (its own state; the runtime copies prefilled prompts into it). The plain decoder at a
    dynamic B (Inductor's GEMMs: at B > 1 the weights are read once for B tokens, which is the point); on CUDA its
    attention is the Triton op over each row's valid positions (kernels_batch.py), the written-out step its
    fallback. Traced over a slot cache of max_batch rows that lives only while it compiles; the self-check's eager
    side keeps CHECK_SLOTS (at 3B, max_batch slots of cache twice over would not fit beside the model)."""
    c, dev, dtype, n = model.config.text, torch.device(opts.device), DTYPES[opts.dtype], opts.max_batch
    g = torch.Generator().manual_seed(4321)
    emb = lambda b: (torch.randn(b, 1, c.dim, generator=g) * 0.5).to(dev, dtype)  # noqa: E731
    pos = lambda *p: torch.tensor(p, dtype=torch.int64, device=dev)  # noqa: E731
    batch = {"min": 1, "max": n}
    eager = BatchDecoder(c, model.language_model, SlotCaches(c, CHECK_SLOTS, opts.max_seq_len, dtype, dev))
    slot_state = {  # the slot caches, max_batch rows each (their FQNs: BATCH_STATE_PREFIX + the batch-1 cache's)
        k: StateSpec([n, *t.shape[1:]], dtype_name(t.dtype))
        for k, t in eager.named_buffers()
        if k.startswith(BATCH_STATE_PREFIX)
    }

    traced = TracedSlots(BATCH_STATE_PREFIX)  # the slot caches (max_batch rows of the whole context)

    def export(attend=None):
        caches = SlotCaches(c, n, opts.max_seq_len, dtype, dev)
        module = traced.add(BatchDecoder(c, model.language_model, caches, attend))
        b = Dim("batch", min=1, max=n)
        # 2 rows: 1 would specialise B; size-oblivious tracing keeps the program general where the trace would
        # guard on B != 1 (as the realtime steps and the mel's chunk dim), and so does the compile (size_oblivious)
        with fx_config.patch(backed_size_oblivious=True):
            return torch.export.export(module, (emb(2), pos(0, 0)), dynamic_shapes=({0: b}, {0: b}), strict=False)

    # one row alone, then two at different positions (row 1 starts later and ends apart), against eager
    steps = [(0,), (1, 0), (2, 1), (3, 2), (4, 7)]
    plan = MethodPlan(
        BATCH_METHOD,
        eager,
        (emb(2), pos(0, 0)),
        None,
        replace(
            method_spec(
                BATCH_METHOD,
                [("embeds", dtype_name(dtype), [batch, 1, c.dim]), ("cache_position", "int64", [batch])],
                [("logits", "float32", [batch, c.vocab_size])],
                slot_state | state,  # the batch-1 cache too: the module reaches it (its layers), its graph does not
            ),
            weights="text_decoder.safetensors",  # the decoder's weights, one copy; the slot cache is its own state
        ),
        [(emb(len(p)), pos(*p)) for p in steps],
        export=export,
        key_extra={"max_batch": n},
        release=traced.release,
        size_oblivious=True,
    )
    if _triton_tiles(model, opts.device):  # each row's own positions through the Triton op; the whole slot else
        from runner.export import kernels_batch  # imports Triton

        fallback = replace(plan, key_extra={"max_batch": n, "fallback": "written-out"})
        plan = replace(plan, export=lambda: export(kernels_batch.attend), fallback=fallback)
    return plan


def _triton_tiles(model: Voxtral, device: str) -> bool:
    """Whether the Triton attention kernels serve this export: CUDA, and a head size they can tile (a power of two
    >= 16: tl.dot's minimum)."""
    d = model.config.text.head_dim
    return torch.device(device).type == "cuda" and d >= 16 and d & (d - 1) == 0


def decode_step_module(model: Voxtral, device: str, pdl: bool = True) -> nn.Module:
    """The decoder for one token: the Triton kernels on CUDA; elsewhere, or for a head size the attention kernel
    cannot tile, the decoder itself, exported at S = 1."""
    if _triton_tiles(model, device):
        from runner.export.decode_step import DecodeStep  # imports Triton

        return DecodeStep(model.config.text, model.language_model, pdl=decode_kernels_wait(device, pdl))
    return model.decoder()


def decode_kernels_wait(device: str, pdl: bool) -> bool:
    """Whether text_decoder_step's kernels are compiled with griddepcontrol.wait (asked for, on an sm_90+ GPU):
    the manifest's `pdl`, without which the runtime keeps every graph edge plain (runner/runtime/pdl.py)."""
    if not pdl or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    from runner.export import kernels  # imports Triton

    return kernels.pdl_supported(torch.empty(0, device=device))


def export_voxtral(
    model: Voxtral, source: ModelSource, tekken_path: Path, out: Path, opts: ExportOptions, progress=None
) -> ExportReport:
    """Build the bundle into `out` (replaced atomically). `progress(method, phase)` is told what runs."""
    K, S = opts.max_audio_chunks, opts.max_seq_len
    if K * TOKENS_PER_CHUNK + PROMPT_ROOM + MIN_ANSWER_ROOM > S:
        raise ExportError(
            f"--max-seq-len {S} cannot hold {K} audio chunks ({K * TOKENS_PER_CHUNK} positions), a prompt "
            f"({PROMPT_ROOM}) and an answer ({MIN_ANSWER_ROOM} at least); for {K} chunks the default is {context_for(K)}"
        )
    tok = Tekken.from_file(tekken_path)
    special = {k: tok.special_id(v) for k, v in SPECIAL_TOKENS.items()}
    if special["audio"] != model.config.audio_token_id:
        raise ExportError(
            f"{tekken_path}: [AUDIO] is id {special['audio']}, config.json says {model.config.audio_token_id}"
        )
    if tok.vocab_size > model.config.text.vocab_size:
        raise ExportError(
            f"{tekken_path}: {tok.vocab_size} tokens do not fit the model's vocab ({model.config.text.vocab_size})"
        )

    model, meta = prepare(model, source, opts, EXPORT)
    quant = apply_quant(model, EXPORT, opts.quant, stored=source.fp8)  # before planning: every method sees them
    if opts.quant == "fp8":  # what text_decoder's plan does with them (`fallbacks` names it if its fallback was built)
        quant["prefill"] = "scaled_mm" if fp8_linear.scaled_mm_serves(opts.device, model) else "dequantised"
    meta |= {
        "quant": quant,
        "max_audio_chunks": K,
        "tokens_per_chunk": TOKENS_PER_CHUNK,
        "capacity": capacity(K, S),
        "tokenizer": "tekken.json",
        "special_tokens": special,
        "pdl": decode_kernels_wait(opts.device, opts.pdl),
        "max_batch": opts.max_batch,  # > 1: text_decoder_batch decodes up to this many sequences at once
        # text_decoder takes a prompt from any position (in pieces, `--prefill-chunk`): on CUDA its attention is
        # the op over the cache's [0, position] or the whole-cache decoder; the CPU's attends to the prompt alone
        "prefill_pieces": torch.device(opts.device).type == "cuda",
    }
    plans = plan_methods(model, opts)
    return build_bundle(model, plans, source, tekken_path, meta, out, opts, progress, family_key(opts))


def capacity(chunks: int, max_seq_len: int) -> dict:
    """How much audio one prompt takes (the manifest's `capacity`): longer audio is transcribed in windows."""
    return {
        "audio_seconds": chunks * CHUNK_LENGTH,
        "audio_positions": chunks * TOKENS_PER_CHUNK,
        "answer_positions": max_seq_len - chunks * TOKENS_PER_CHUNK - PROMPT_ROOM,  # after the longest prompt
    }


def family_key(opts: ExportOptions) -> dict:
    """What Voxtral's compiled methods depend on beyond the pipeline: its sources and whether the kernels wait."""
    return {"sources": source_digest(SOURCE_FILES), "pdl": decode_kernels_wait(opts.device, opts.pdl)}


def load(request: LoadRequest) -> Loaded:
    """A checkpoint directory (with its tekken.json), a preset with --random-init, or the seeded tiny preset."""
    if request.checkpoint is not None:
        model, source, tokenizer = load_checkpoint(request.checkpoint)
        return Loaded(request.checkpoint.resolve().name, model, source, tokenizer)
    name = request.preset
    if request.random_init:
        model, source = random_model(name, request.seed, DTYPES[request.dtype], request.device)
        return Loaded(name, model, source, FIXTURES / "tekken.json")
    if name == SEEDED_PRESET:
        ckpt = write_tiny_checkpoint(Path(request.cache_dir) / "checkpoints" / TINY_CHECKPOINT.name)
        model, source, tokenizer = load_checkpoint(ckpt)
        return Loaded(name, model, source, tokenizer)
    raise RunnerError(f"--preset {name}: no weights; pass --checkpoint DIR or --random-init")


EXPORT = register(
    ExportFamily(
        NAME,
        presets=tuple(PRESETS),
        load=load,
        export=export_voxtral,
        methods=METHOD_NAMES,
        any_checkpoint=True,
        batching=True,
        quant_modules=QUANT_MODULES,
        redraw=Redraw(random_model, plan_methods),
    )
)
