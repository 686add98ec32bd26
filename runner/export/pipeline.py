"""The export pipeline every family shares: each method compiled into its own `.so` (runner/export/aoti.py) through
a compile cache, its weights beside it, a failed compile replaced by the plan's fallback, the manifest, a
self-check of every compiled method through our own delegate against eager, and an atomic publish.

The bundle is built in a staging directory and renamed into place at the end, so a failed export leaves no half
bundle. A family's exporter (runner/export/voxtral.py, whisper.py) plans the methods.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from runner import __version__
from runner.bundle import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    file_entries,
    read_manifest,
    verify_bundle,
    write_manifest,
)
from runner.digests import DigestCache, sha256_file
from runner.errors import BundleError, ExportError
from runner.export.aoti import compile_method, release_compile_copies, write_weights
from runner.export.checkpoint import ModelSource
from runner.export.compile_cache import CompileCache
from runner.export.methods import COMPILE_ALLOWANCE, MethodPlan, bytes_needed, dtype_name
from runner.export.options import DTYPES, ExportOptions
from runner.export.registry import ExportFamily, taking
from runner.export.self_check import Mismatch, check_bundle
from runner.publish import (
    DEBUG_NAME,
    DEBUG_RECORD,
    absolute_destination,
    check_destination,
    check_free_space,
    disk_full,
    free_bytes,
    make_stage,
    publish,
    size_text,
)

log = logging.getLogger(__name__)

# Hashed into every compile-cache key (paths relative to runner/); a family adds its own.
PIPELINE_SOURCES = (
    "export/pipeline.py",
    "export/options.py",
    "export/aoti.py",
    "export/methods.py",
    "models/mel.py",
    "audio.py",
)


@dataclass
class ExportReport:
    compile_seconds: dict[str, float] = field(default_factory=dict)
    cached: dict[str, bool] = field(default_factory=dict)
    max_error: dict[str, float] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)  # method -> why its plan's fallback was compiled
    up_to_date: bool = False  # --out already held the bundle these inputs build: left as it was


# ---------------------------------------------------------------- compile, with a cache


def source_digest(files: tuple[str, ...]) -> str:
    """sha256 over source files (paths relative to runner/): part of the compile-cache key."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in files:
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def cache_key(model: nn.Module, source: ModelSource, opts: ExportOptions, method: str, family: dict) -> str:
    """Everything the compiled `.so` depends on: the pipeline's own sources, and `family`: what the family's
    exporter adds (its sources, its switches)."""
    blob = json.dumps(
        {
            "config": model.config.to_dict(),
            "weights": source.weights_digest,
            "dtype": opts.dtype,
            "device": opts.device,
            "torch": torch.__version__,
            "max_seq_len": opts.max_seq_len,
            "max_audio_chunks": opts.max_audio_chunks,
            "source": source_digest(PIPELINE_SOURCES),
            "family": family,
            "method": method,
            "debug": opts.debug,
            "quant": opts.quant,
            "format": FORMAT_VERSION,
            **({"max_autotune": True} if method in opts.max_autotune else {}),  # absent: the keys stay as they were
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def prepare(model: nn.Module, source: ModelSource, opts: ExportOptions, family: ExportFamily) -> tuple[nn.Module, dict]:
    """The eager model on the export's device and dtype with its KV cache, and the manifest's `model` fields every
    family has; the family's exporter adds its own. An option the family does not take is refused first."""
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda: no CUDA device visible to torch")
    check_options(opts, family)
    dtype = DTYPES[opts.dtype]
    model = model.to(device=opts.device, dtype=dtype).eval()
    model.setup_caches(opts.max_seq_len, dtype)
    meta = {
        "family": family.name,
        "required_methods": list(family.methods),
        "config": model.config.to_dict(),
        "source": source.to_dict(),
        "max_seq_len": opts.max_seq_len,
    }
    return model, meta


def check_options(opts: ExportOptions, family: ExportFamily) -> None:
    """A flag the family would ignore (and the CLI would still name the bundle after, `-int4`) is an error."""
    name = family.name
    if opts.max_batch > 1 and not family.batching:
        raise ExportError(
            f"--max-batch {opts.max_batch}: a {name} bundle has no batched decode step "
            f"(only {taking(lambda f: f.batching)} bundles take --max-batch > 1)"
        )
    if opts.quant != "none" and not family.quant_modules:
        raise ExportError(
            f"--quant {opts.quant}: a {name} bundle has no quantised path (only "
            f"{taking(lambda f: bool(f.quant_modules))} bundles take --quant)"
        )
    if opts.max_streams is not None and not family.streams:
        raise ExportError(
            f"--max-streams: a {name} bundle has no stream slots (only {taking(lambda f: f.streams)} bundles take it)"
        )


def build_bundle(
    model: nn.Module,
    plans: list[MethodPlan],
    source: ModelSource,
    tokenizer_path: Path,
    meta: dict,
    out: Path,
    opts: ExportOptions,
    progress=None,
    family_key: dict | None = None,
    weights_filter=None,
) -> ExportReport:
    """What every family shares: compile each method (or take it from the cache), write its weights, the
    tokenizer (as `meta["tokenizer"]`) and the manifest into a staging directory, run every method against
    eager, then publish. `family_key` is what the family's compiled code depends on beyond the pipeline (its
    sources, its switches), hashed into the cache key; `weights_filter(method, fqn)` may drop weights a method
    does not use. `opts.cancel` is checked between methods and before publishing."""
    out = absolute_destination(Path(out))
    methods = MethodCompiler(model, list(plans), source, opts, family_key or {}, progress)
    inputs = inputs_key({p.name: methods.key(p) for p in methods.plans}, meta, tokenizer_path, opts)
    if up_to_date(out, inputs, methods.digests):
        return ExportReport(up_to_date=True)
    check_destination(out, merge=opts.force)  # before minutes of compiling: nothing of the user's is replaced
    stage = make_stage(out)
    try:
        needed = bytes_needed(methods.plans, weights_filter)
        check_free_space(stage, out, needed, "the bundle (its weights and compiled methods)")
        methods.compile_all(stage, out, weights_filter)
        shutil.copyfile(tokenizer_path, stage / meta["tokenizer"])
        write_manifest(stage, bundle_manifest(stage, meta, inputs, methods, progress))
        if opts.check:
            if progress:
                progress("all", "checking against eager")
            methods.report.max_error = methods.check(stage, out, meta, inputs)
        kept = publish(stage, out, cancel=opts.cancel, merge=opts.force)  # checks for a stop right before
        if kept is not None:
            log.warning("%s: files that appeared in the old bundle meanwhile were kept in %s", out, kept)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return methods.report


class MethodCompiler:
    """Each method's `.so` into a staging directory, from the compile cache or compiled (then cached), its
    weights beside it; a plan whose compile fails is replaced by the first of its chain of fallbacks that
    compiles, and the report says why."""

    def __init__(self, model, plans: list[MethodPlan], source, opts: ExportOptions, family_key: dict, progress):
        unknown = sorted(set(opts.max_autotune) - {p.name for p in plans})
        if unknown:
            raise ExportError(
                f"--max-autotune {','.join(unknown)}: no such method (these are: {', '.join(p.name for p in plans)})"
            )
        self.model, self.plans, self.source, self.opts = model, plans, source, opts
        self.family_key, self.progress = family_key, progress
        self.cache = CompileCache(opts.cache_root / "compiled")
        self.digests = DigestCache(opts.cache_root / "digests.json")
        self.report = ExportReport()
        self.mismatches: dict[str, int] = {}  # method -> its fallbacks taken on a failed self-check

    def key(self, plan: MethodPlan) -> str:
        return cache_key(self.model, self.source, self.opts, plan.name, {**self.family_key, **plan.key_extra})

    def compile_all(self, stage: Path, out: Path, weights_filter) -> None:
        debug_dir = stage / "debug" if self.opts.debug else None
        written: dict[str, set[str]] = {}  # weights file -> its FQNs
        for i, plan in enumerate(self.plans):
            self.opts.cancel.check()
            t0 = time.perf_counter()
            plan, cached = self.first_that_compiles(plan, stage, out, debug_dir)
            self.plans[i], self.report.cached[plan.name] = plan, cached
            self.report.compile_seconds[plan.name] = round(time.perf_counter() - t0, 2)
            write_weights(plan, stage, written, weights_filter)
            if self.progress:
                seconds = self.report.compile_seconds[plan.name]
                self.progress(plan.name, "cached" if self.report.cached[plan.name] else f"compiled in {seconds:.1f}s")

    def first_that_compiles(
        self, plan: MethodPlan, stage: Path, out: Path, debug_dir: Path | None
    ) -> tuple[MethodPlan, bool]:
        """The first plan down `plan`'s chain of fallbacks whose `.so` is cached or compiles, and whether it was
        cached; each failure on the way is recorded (fallback_for, which raises where the chain must stop)."""
        while True:
            try:
                return plan, self.fetch_or_compile(plan, stage, debug_dir)
            except Exception as e:
                plan = self.fallback_for(plan, e, stage, out)

    def fetch_or_compile(self, plan: MethodPlan, stage: Path, debug_dir: Path | None) -> bool:
        """The method's `.so` into the stage, from the compile cache or compiled (then cached): whether cached."""
        key = self.key(plan)  # a fallback has its own key, under the same method name
        so = stage / plan.spec.library
        sources = debug_dir / plan.name if debug_dir is not None else None  # a debug compile's, kept cached too
        if self.cache.fetch(key, plan.name, so, sources):
            return True
        if self.progress:
            self.progress(plan.name, "compiling")
        with tempfile.TemporaryDirectory(dir=stage) as work:
            shutil.copyfile(compile_method(plan, self.opts, Path(work), debug_dir), so)
        release_compile_copies()
        if plan.release is not None:
            plan.release()
        self.cache.store(key, plan.name, so, sources)
        return False

    def check(self, stage: Path, out: Path, meta: dict, inputs: str) -> dict[str, float]:
        """check_bundle on the stage. Where a plan that may fall back on a mismatch (`fallback_on_mismatch`) differs
        from eager, the first of its fallbacks that compiles goes into the stage, the manifest is written again and
        every method checked again; any other mismatch fails the export."""
        dtype, device = DTYPES[self.opts.dtype], self.opts.device
        while True:
            try:
                return check_bundle(stage, self.plans, self.model, dtype, device, self.opts.cache_dir, self.progress)
            except Mismatch as e:
                i = next(i for i, p in enumerate(self.plans) if p.name == e.method)
                plan = self.plans[i]
                moved = any(p.device.type != torch.device(device).type for p in self.model.parameters())
                if not plan.fallback_on_mismatch or plan.fallback is None or moved or self.opts.cancel.requested:
                    raise  # the eager model moved to the host (make_room) cannot trace a device fallback
                log.warning("%s; compiling its fallback", e)
                if self.progress:
                    self.progress(plan.name, "differs from eager; compiling the fallback")
                self.record_fallback(plan.name, f"self-check: {e.detail}")
                # a library of its own name: the checked one stays mapped in this process under the old name
                # (glibc hands back a loaded library by path; writing over it would rewrite mapped code)
                n = self.mismatches[plan.name] = self.mismatches.get(plan.name, 0) + 1
                fallback = with_library(plan.fallback, f"{plan.name}.fallback{n if n > 1 else ''}.so")
                (stage / plan.spec.library).unlink()
                self.plans[i], self.report.cached[plan.name] = self.first_that_compiles(fallback, stage, out, None)
                (stage / MANIFEST_NAME).unlink()  # the manifest lists the stage's files: not its old self
                write_manifest(stage, bundle_manifest(stage, meta, inputs, self, self.progress))

    def fallback_for(self, plan: MethodPlan, e: Exception, stage: Path, out: Path) -> MethodPlan:
        """The plan to compile after `plan`'s compile raised `e`, or `e` again: a full disk, no fallback, or a
        stop requested (whatever then unwinds is the stop's, not a compile to recover from)."""
        free = free_bytes(stage)  # torch's archive writer reports a full disk as a bad position, hence the space
        if disk_full(e) or free < COMPILE_ALLOWANCE:
            raise ExportError(
                f"{plan.name}: No space left on device while it was compiled or copied into the bundle "
                f"({size_text(free)} free now beside {out}); free some space or choose another --out"
            ) from e
        if plan.fallback is None or self.opts.cancel.requested:
            raise e
        why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        log.warning("%s did not compile (%s); compiling its fallback", plan.name, why)
        if self.progress:
            self.progress(plan.name, f"did not compile ({why}); compiling the fallback")
        self.record_fallback(plan.name, why)
        return plan.fallback

    def record_fallback(self, method: str, why: str) -> None:
        """Why `method`'s fallback was taken, after why an earlier one was, if any."""
        earlier = self.report.fallbacks.get(method)
        self.report.fallbacks[method] = f"{earlier}; then {why}" if earlier else why


def with_library(plan: MethodPlan, library: str) -> MethodPlan:
    """`plan` and the fallbacks after it, their `.so` named `library`."""
    fallback = with_library(plan.fallback, library) if plan.fallback is not None else None
    return replace(plan, spec=replace(plan.spec, library=library), fallback=fallback)


def bundle_manifest(stage: Path, meta: dict, inputs: str, methods: MethodCompiler, progress) -> Manifest:
    """The manifest of the files in the stage, each made readable by all first."""
    # One mode for everything, on purpose: a bundle is code and data to share, readable by all and written by
    # its owner (safetensors writes weights 0600). Before hashing: chmod changes ctime, which the digest cache's
    # key holds.
    for p in (stage, *stage.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    files = sorted(p.name for p in stage.iterdir() if p.is_file())
    if progress:  # a large model's weights take a while
        size = sum((stage / f).stat().st_size for f in files)
        progress("all", f"hashing {len(files)} files ({size / 1e9:.1f} GB) for the manifest")
    opts, report = methods.opts, methods.report
    # a debug build's sources are recorded as the bundle's own: a later export may replace only those
    debug = sorted(p.relative_to(stage).as_posix() for p in (stage / DEBUG_NAME).rglob("*") if p.is_file())
    return Manifest(
        format_version=FORMAT_VERSION,
        torch_version=torch.__version__,
        device=opts.device,
        gpu_arch=_gpu_arch() if opts.device == "cuda" else None,
        dtype=dtype_name(DTYPES[opts.dtype]),
        model={
            **meta,
            "compile_seconds": report.compile_seconds,
            "compile_cached": report.cached,
            # a bundle with a fallback records no inputs: the next export tries the plan's own compile again
            **({"fallbacks": report.fallbacks} if report.fallbacks else {"inputs": inputs}),
            **({"max_autotune": list(opts.max_autotune)} if opts.max_autotune else {}),
            **({DEBUG_RECORD: debug} if debug else {}),
        },
        methods={p.name: p.spec for p in methods.plans},
        files=file_entries(stage, files, digests=methods.digests),
        created_by=f"runner {__version__}",
    )


def inputs_key(keys: dict[str, str], meta: dict, tokenizer_path: Path, opts: ExportOptions) -> str:
    """What a whole bundle is built from: each method's compile-cache key (the model config, the weights' digest,
    the options, torch, the code), the manifest's model fields, the tokenizer, and whether it was checked."""
    blob = {"methods": keys, "model": meta, "tokenizer": sha256_file(tokenizer_path), "check": opts.check}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:32]


def up_to_date(out: Path, inputs: str, digests: DigestCache) -> bool:
    """`out` holds the bundle that `inputs` build, every file as its manifest says (a file unchanged since it was
    last hashed is not hashed again): exporting again would write the same bundle."""
    try:
        return read_manifest(out).model.get("inputs") == inputs and verify_bundle(out, digests=digests) is not None
    except (BundleError, OSError):
        return False


def _gpu_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"
