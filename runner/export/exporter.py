"""Export Voxtral into a bundle: one torch.export + AOTInductor `.so` per method, weight files, `model.pte`.

Weights are kept out of the `.so` (`package_constants_in_so=False`) and written as safetensors keyed by each
constant's FQN; the runtime binds them into the container at init. The exporter runs every compiled method
through our own delegate and compares it with eager before it publishes anything; it builds in a temp dir
and renames at the end, so a failed export leaves no half bundle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.export import Dim

from runner import __version__
from runner.audio import N_SAMPLES, TOKENS_PER_CHUNK
from runner.bundle import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    MethodSpec,
    StateSpec,
    TensorSpec,
    cache_dir,
    file_entries,
    write_manifest,
)
from runner.errors import ExportError
from runner.export.checkpoint import ModelSource
from runner.export.mel import LogMelSpectrogram, export_mel
from runner.export.model import Voxtral
from runner.tokenizer import Tekken

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Per-dtype tolerance of the exported-vs-eager self-check, relative to the reference's largest magnitude.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
SPECIAL_TOKENS = {
    "bos": "<s>",
    "eos": "</s>",
    "inst": "[INST]",
    "inst_end": "[/INST]",
    "audio": "[AUDIO]",
    "begin_audio": "[BEGIN_AUDIO]",
    "transcribe": "[TRANSCRIBE]",
}
SOURCE_FILES = (
    "export/model.py",
    "export/decode_step.py",
    "export/kernels.py",
    "export/exporter.py",
    "export/mel.py",
    "export/config.py",
    "audio.py",
)


@dataclass(frozen=True)
class ExportOptions:
    device: str = "cpu"
    dtype: str = "fp32"
    max_seq_len: int = 1024
    max_audio_chunks: int = 2
    debug: bool = False  # DEBUG=1: AOTI debug compile, generated sources kept next to the bundle
    cache_dir: Path | None = None
    check: bool = True


@dataclass
class ExportReport:
    compile_seconds: dict[str, float] = field(default_factory=dict)
    cached: dict[str, bool] = field(default_factory=dict)
    max_error: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- the four methods as modules


class AudioEncoderMethod(nn.Module):
    def __init__(self, m: Voxtral):
        super().__init__()
        self.audio_tower, self.multi_modal_projector = m.audio_tower, m.multi_modal_projector
        self.group = m.config.audio.ffn_dim

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h = self.audio_tower(mel)
        return self.multi_modal_projector(h.reshape(1, -1, self.group))


class TokenEmbeddingMethod(nn.Module):
    def __init__(self, m: Voxtral):
        super().__init__()
        self.embed_tokens = m.language_model.model.embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


def _dim(lo: int, hi: int, multiple: int = 1) -> dict:
    return {"min": lo, "max": hi, **({"multiple": multiple} if multiple > 1 else {})}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def method_spec(name: str, inputs, outputs, state: dict[str, StateSpec] | None = None) -> MethodSpec:
    """A method's manifest entry: `<name>.so` and `<name>.safetensors`; inputs/outputs as (name, dtype, shape)."""
    return MethodSpec(
        name,
        f"{name}.so",
        f"{name}.safetensors",
        [TensorSpec(*x) for x in inputs],
        [TensorSpec(*x) for x in outputs],
        state or {},
    )


def kv_cache_state(n_layers: int, shape: list[int], dtype: torch.dtype) -> dict[str, StateSpec]:
    """The decoder's per-layer K and V cache buffers, as the text_decoder method's state."""
    return {
        f"layers.{i}.self_attn.kv_cache.{kv}": StateSpec(list(shape), _dtype_name(dtype))
        for i in range(n_layers)
        for kv in ("k_cache", "v_cache")
    }


@dataclass
class MethodPlan:
    name: str
    module: nn.Module
    example: tuple[torch.Tensor, ...]
    dynamic_shapes: object
    spec: MethodSpec
    check_inputs: list[tuple[torch.Tensor, ...]]  # self-check inputs (more than one shape per method)
    reference: nn.Module | None = None  # what the self-check compares with, if not `module` run eagerly


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
    mel_dims = [_dim(1, K), c.audio.n_mels, 3000]
    decoder = model.decoder()
    state = kv_cache_state(c.text.n_layers, [1, c.text.n_kv_heads, S, c.text.head_dim], dtype)
    small = min(2, K)
    return [
        MethodPlan(
            "preprocessor",
            LogMelSpectrogram(c.audio.n_mels).to(dev),
            (),
            None,
            method_spec(
                "preprocessor",
                [("waveform", "float32", [_dim(N_SAMPLES, K * N_SAMPLES, N_SAMPLES)])],
                [("mel", "float32", [_dim(1, K), c.audio.n_mels, 3000])],
            ),
            [(wave(1),), (wave(small),)],
        ),
        MethodPlan(
            "audio_encoder",
            AudioEncoderMethod(model),
            (mel(min(2, K)),),
            ({0: chunks},),
            method_spec(
                "audio_encoder",
                [("mel", _dtype_name(dtype), mel_dims)],
                [("audio_embeds", _dtype_name(dtype), [1, _dim(TOKENS_PER_CHUNK, K * TOKENS_PER_CHUNK), H])],
            ),
            [(mel(small),), (mel(1),)],
        ),
        MethodPlan(
            "token_embedding",
            TokenEmbeddingMethod(model),
            (ids(3),),
            ({1: seq},),
            method_spec(
                "token_embedding",
                [("ids", "int64", [1, _dim(1, S)])],
                [("embeds", _dtype_name(dtype), [1, _dim(1, S), H])],
            ),
            [(ids(5),), (ids(1),)],
        ),
        MethodPlan(
            "text_decoder",
            decoder,
            (emb(3), torch.arange(3, device=dev)),
            ({1: seq}, {0: seq}),
            method_spec(
                "text_decoder",
                [("embeds", _dtype_name(dtype), [1, _dim(1, S), H]), ("cache_position", "int64", [_dim(1, S)])],
                [("logits", "float32", [1, c.text.vocab_size])],
                state,
            ),
            # prefill then one decode step: the second call only matches if the KV cache was mutated
            [(emb(7), torch.arange(7, device=dev)), (emb(1), torch.tensor([7], device=dev))],
        ),
        MethodPlan(
            "text_decoder_step",
            decode_step_module(model, opts.device),
            (emb(1), torch.tensor([3], device=dev)),
            None,  # static: one token
            replace(
                method_spec(
                    "text_decoder_step",
                    [("embeds", _dtype_name(dtype), [1, 1, H]), ("cache_position", "int64", [1])],
                    [("logits", "float32", [1, c.text.vocab_size])],
                    state,
                ),
                weights="text_decoder.safetensors",  # the same module: one copy of the weights and the KV cache
            ),
            # three steps from an empty cache, each attending to the ones before, against the written-out decoder
            [(emb(1), torch.tensor([i], device=dev)) for i in range(3)],
            reference=decoder,
        ),
    ]


def decode_step_module(model: Voxtral, device: str) -> nn.Module:
    """The decoder for one token: the Triton kernels on CUDA; elsewhere, or for a head size the attention kernel
    cannot tile (a power of two >= 16: tl.dot's minimum), the decoder itself, exported at S = 1."""
    d = model.config.text.head_dim
    if torch.device(device).type == "cuda" and d >= 16 and d & (d - 1) == 0:
        from runner.export.decode_step import DecodeStep  # imports Triton

        return DecodeStep(model.config.text, model.language_model)
    return model.decoder()


def _decode_kernels_wait(device: str) -> bool:
    """Whether text_decoder_step's kernels are compiled with griddepcontrol.wait (on an sm_90+ GPU unless
    VOXTRAL_RUNNER_PDL=0): the manifest's `pdl`, without which the runtime keeps every graph edge plain
    (runner/pdl.py)."""
    if torch.device(device).type != "cuda":
        return False
    from runner.export import kernels  # imports Triton

    return kernels.pdl_supported(torch.empty(0, device=device))


# ---------------------------------------------------------------- compile, with a cache


def source_digest(files: tuple[str, ...] = SOURCE_FILES) -> str:
    """sha256 over source files (paths relative to runner/): part of the compile-cache key."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in files:
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def cache_key(model: nn.Module, source: ModelSource, opts: ExportOptions, method: str, namespace: str = "") -> str:
    """Everything the compiled `.so` depends on; `namespace` adds a family's own sources."""
    blob = json.dumps(
        {
            "config": model.config.to_dict(),
            "weights": source.weights_digest,
            "dtype": opts.dtype,
            "device": opts.device,
            "torch": torch.__version__,
            "max_seq_len": opts.max_seq_len,
            "max_audio_chunks": opts.max_audio_chunks,
            "source": source_digest(),
            "namespace": namespace,
            "method": method,
            "debug": opts.debug,
            "format": FORMAT_VERSION,
            "pdl": _decode_kernels_wait(opts.device),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def default_cache_dir() -> Path:
    return cache_dir()


def _export(plan: MethodPlan, opts: ExportOptions) -> torch.export.ExportedProgram:
    if plan.name == "preprocessor":
        return export_mel(plan.module, opts.max_audio_chunks)
    return torch.export.export(plan.module, plan.example, dynamic_shapes=plan.dynamic_shapes, strict=False)


@contextlib.contextmanager
def _one_object_per_kernel():
    """AOTInductor before torch 2.13 embeds each kernel binary as `<cubin>.o`, its symbols renamed to the kernel's
    name. When two kernel names share one cubin (the same Triton kernel, specialised alike, at two call sites:
    seen with the cache-writing attention of the 3B step), the second object overwrites the first and is linked
    twice: "multiple definition of `___attention_kernel_N_start'". Each kernel name gets its own copy of the
    cubin here. torch 2.13 embeds all binaries in one batched object, named per kernel, and calls this function
    only as its fallback."""
    from torch._inductor import codecache

    original = getattr(codecache, "convert_cubin_to_obj", None)
    if original is None:
        yield
        return

    def convert(cubin_file: str, kernel_name: str, ld: str, objcopy: str) -> str:
        own = f"{cubin_file[: -len('.cubin')] if cubin_file.endswith('.cubin') else cubin_file}.{kernel_name}.cubin"
        shutil.copyfile(cubin_file, own)
        return original(own, kernel_name, ld, objcopy)

    codecache.convert_cubin_to_obj = convert
    try:
        yield
    finally:
        codecache.convert_cubin_to_obj = original


def compile_method(plan: MethodPlan, opts: ExportOptions, workdir: Path, debug_dir: Path | None) -> Path:
    """torch.export + AOTInductor; returns the path of the method's `.so` (weights not embedded)."""
    with torch.no_grad():
        ep = _export(plan, opts)
    configs = {"aot_inductor.package_constants_in_so": False, "aot_inductor.debug_compile": opts.debug}
    if opts.device == "cuda":
        # Kernel binaries go inside the .so: by default it loads .cubin files from the compile directory, which
        # exists only on the machine that exported (seen: "CUDA driver error: file not found" elsewhere).
        configs["aot_inductor.embed_kernel_binary"] = True
    with _one_object_per_kernel():
        package = torch._inductor.aoti_compile_and_package(
            ep, package_path=str(workdir / f"{plan.name}.pt2"), inductor_configs=configs
        )
    with zipfile.ZipFile(package) as z:
        libs = [n for n in z.namelist() if n.endswith(".so")]
        if len(libs) != 1:
            raise ExportError(f"{plan.name}: expected one .so in the AOTI package, found {libs}")
        so = workdir / f"{plan.name}.so"
        with z.open(libs[0]) as src, open(so, "wb") as dst:
            shutil.copyfileobj(src, dst)
        if debug_dir is not None:  # the seed's DEBUG option: keep the generated C++ next to the bundle
            for n in z.namelist():
                if n.endswith((".cpp", ".h", ".json")):
                    (debug_dir / plan.name).mkdir(parents=True, exist_ok=True)
                    (debug_dir / plan.name / Path(n).name).write_bytes(z.read(n))
    return so


def method_weights(plan: MethodPlan) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the method module except the state the runtime allocates."""
    sd = dict(plan.module.named_parameters())
    sd.update((k, b) for k, b in plan.module.named_buffers() if k not in plan.spec.state)
    return {k: v.detach().contiguous() for k, v in sd.items()}


# ---------------------------------------------------------------- the whole export


def export_bundle(
    model: Voxtral, source: ModelSource, tekken_path: Path, out: Path, opts: ExportOptions, progress=None
) -> ExportReport:
    """Build the bundle into `out` (replaced atomically). `progress(method, phase)` is told what runs."""
    dtype = DTYPES[opts.dtype]
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda: no CUDA device visible to torch")
    if opts.max_audio_chunks * TOKENS_PER_CHUNK + 16 > opts.max_seq_len:
        raise ExportError(
            f"--max-seq-len {opts.max_seq_len} cannot hold {opts.max_audio_chunks} audio chunks "
            f"({opts.max_audio_chunks * TOKENS_PER_CHUNK} tokens) plus a prompt"
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

    model = model.to(device=opts.device, dtype=dtype).eval()
    model.setup_caches(opts.max_seq_len, dtype)
    meta = {
        "family": "voxtral",
        "config": model.config.to_dict(),
        "source": source.to_dict(),
        "max_seq_len": opts.max_seq_len,
        "max_audio_chunks": opts.max_audio_chunks,
        "tokens_per_chunk": TOKENS_PER_CHUNK,
        "tokenizer": "tekken.json",
        "special_tokens": special,
        "pdl": _decode_kernels_wait(opts.device),
    }
    return build_bundle(model, plan_methods(model, opts), source, tekken_path, meta, out, opts, progress)


def build_bundle(
    model: nn.Module,
    plans: list[MethodPlan],
    source: ModelSource,
    tokenizer_path: Path,
    meta: dict,
    out: Path,
    opts: ExportOptions,
    progress=None,
    cache_namespace: str = "",
    weights_filter=None,
) -> ExportReport:
    """What every family shares: compile each method (or take it from the cache), write its weights, the
    tokenizer (as `meta["tokenizer"]`) and the manifest into a staging directory, run every method against
    eager, then publish. `weights_filter(method, fqn)` may drop weights a method does not use."""
    from runner.program import Program  # runtime code; the exporter may use it, never the other way round

    out, dtype = Path(out), DTYPES[opts.dtype]
    cache_root = Path(opts.cache_dir or default_cache_dir()) / "compiled"
    report = ExportReport()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        debug_dir = stage / "debug" if opts.debug else None
        written: dict[str, set[str]] = {}  # weights file -> its FQNs
        for plan in plans:
            key = cache_key(model, source, opts, plan.name, cache_namespace)
            cached = cache_root / key / f"{plan.name}.so"
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
                tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")  # concurrent exports: unique name
                shutil.copyfile(stage / f"{plan.name}.so", tmp)
                tmp.replace(cached)
            report.compile_seconds[plan.name] = round(time.perf_counter() - t0, 2)
            weights = {
                k: v for k, v in method_weights(plan).items() if weights_filter is None or weights_filter(plan.name, k)
            }
            if plan.spec.weights in written:  # a second method over one module (text_decoder_step): names only
                if written[plan.spec.weights] != set(weights):
                    raise ExportError(f"{plan.name}: its weights differ from those in {plan.spec.weights}")
            else:
                save_file({k: v.cpu() for k, v in weights.items()}, str(stage / plan.spec.weights))
                written[plan.spec.weights] = set(weights)
            if progress:
                done = "cached" if report.cached[plan.name] else f"compiled in {report.compile_seconds[plan.name]:.1f}s"
                progress(plan.name, done)
        shutil.copyfile(tokenizer_path, stage / meta["tokenizer"])

        files = sorted(p.name for p in stage.iterdir() if p.is_file())
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            torch_version=torch.__version__,
            device=opts.device,
            gpu_arch=_gpu_arch() if opts.device == "cuda" else None,
            dtype=_dtype_name(dtype),
            model={**meta, "compile_seconds": report.compile_seconds},
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
                    report.max_error[plan.name] = self_check(program, plan, model, dtype)
        stage.chmod(0o755)  # mkdtemp makes it private; a bundle is a normal directory
        _publish(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return report


def self_check(program, plan: MethodPlan, model: Voxtral, dtype: torch.dtype) -> float:
    """Run the compiled method and eager on the same inputs; abort the export on a mismatch."""
    method = program.methods[plan.name]
    worst = 0.0
    if plan.spec.state:  # a stateful method (the decoder's KV cache): both sides start empty
        model.reset_caches()
        program.reset_state()
    with torch.no_grad():
        for inputs in plan.check_inputs:
            want = (plan.reference or plan.module)(*inputs)
            got = method(*inputs)[0]
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ExportError(
                    f"{plan.name}: exported output {got.dtype}{list(got.shape)} != eager {want.dtype}{list(want.shape)}"
                )
            scale = want.float().abs().max().item() or 1.0
            err = (got.float() - want.float()).abs().max().item() / scale
            worst = max(worst, err)
            if not err <= TOLERANCE[dtype]:
                raise ExportError(
                    f"{plan.name}: exported output differs from eager: max relative error "
                    f"{err:.3g} > {TOLERANCE[dtype]:g} for input shapes "
                    f"{[list(x.shape) for x in inputs]}"
                )
    model.reset_caches()
    return worst


def _gpu_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _publish(stage: Path, out: Path) -> None:
    """Replace `out` with the finished stage; the old bundle is removed only after the new one is in place."""
    old = None
    if out.exists():
        if not (out / MANIFEST_NAME).is_file() and any(out.iterdir()):
            raise ExportError(f"{out}: exists and is not a bundle; refusing to replace it")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    stage.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
