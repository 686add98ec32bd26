"""Random-weight bundles travel without their weights: the manifest records how they were drawn (preset, seed, the
generator: torch's version and device type) and every weight file's sha256, and a consuming job draws them again
here, checks each file against the manifest before it is moved into place, and only then is anything loaded.

A 3B random-init bundle is 9.35 GB of weights and a few hundred MB of `.so`: the weights are what an artifact
upload, two downloads and a `fetch` would move. Regenerating them on the GPU takes seconds.

A bundle whose weights are converted from a pinned package (Whisper tiny.en: `model.source.package` names the
distribution, its version and the converted file's sha256) travels without them too: they are converted again
from the installed package (its files checked against the pin before a byte is parsed), then checked against the
manifest the same way. A package that is not installed, or not the pinned one, is one line naming what to install.

Weight files already there are checked against their digests as well: one that differs (a flipped byte, a cut
download) is drawn again and replaced (renamed over, never written into); a link is refused, never written
through (the file it points to may be someone else's). What this reports as there or drawn passes
ci_scripts/check_bundle.py. Nothing imports torch until there is something to draw.

    python -m runner export --regenerate DIR
"""

from __future__ import annotations

import os
from pathlib import Path

from runner.bundle import MANIFEST_NAME, FileEntry, Manifest, read_manifest, safe_member, weight_files
from runner.digests import DigestCache, sha256_file
from runner.errors import BundleError, RunnerError
from runner.manifest_fields import MAX_SEED, PACKAGE, RANDOM_INIT, in_range

MISSING = "missing"


def regenerate(bundle_dir: str | os.PathLike, progress=None, digests: DigestCache | None = None) -> list[str]:
    """Draw a random-init bundle's weights again into `bundle_dir`: the files missing and those whose bytes are not
    the manifest's; returns the files written (none when all are there and verified). Each is written beside its
    final name, checked against the manifest's sha256, then renamed into place: a mismatch leaves nothing behind
    and raises RunnerError with one line. `digests` remembers verified files (default: the user cache's)."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    todo = weights_to_draw(bundle_dir, manifest, digests or DigestCache())
    if not todo:
        return []
    family = _check_can_regenerate(bundle_dir, manifest, todo)
    tensors = _draw(bundle_dir, manifest, family, progress)
    written = []
    for name, why in todo.items():
        _put(bundle_dir, name, tensors[name], manifest.files[name].sha256)
        written.append(name)
        if progress:
            progress(name, "regenerated, sha256 matches the manifest" + ("" if why == MISSING else f" (was: {why})"))
    return written


def weights_to_draw(bundle_dir: Path, manifest: Manifest, digests: DigestCache) -> dict[str, str]:
    """The manifest's weight files that must be drawn, each with why: missing, or the file there is not the one
    the manifest pins. A link, or anything but a regular file, is refused: regenerate replaces only weight files."""
    todo = {}
    for name in weight_files(manifest):
        entry = manifest.files.get(name)
        if entry is None:
            raise BundleError(f"{bundle_dir / MANIFEST_NAME}: the weights {name} are not listed in files")
        if (bundle_dir / name).is_symlink():
            raise BundleError(
                f"{bundle_dir / name}: a link; --regenerate writes no weights through a link (the file it points to "
                "may be yours): put the file itself there, or remove the link to draw it"
            )
        why = _wrong(safe_member(bundle_dir, name), entry, digests)  # safe_member: no link on the way, no `..`
        if why:
            todo[name] = why
    digests.save()
    return todo


def _wrong(path: Path, entry: FileEntry, digests: DigestCache) -> str | None:
    """What is wrong with the weight file at `path` (None: it is the manifest's). A remembered digest that
    disagrees is hashed again before it counts: the cache is only a cache."""
    if not path.exists():
        return MISSING
    if not path.is_file():
        raise BundleError(f"{path}: not a regular file; --regenerate replaces only weight files")
    size = path.stat().st_size
    if size != entry.size:
        return f"size {size}, the manifest's is {entry.size}"
    if digests.known(path) == entry.sha256:
        return None
    got = sha256_file(path)
    digests.remember(path, got)
    return None if got == entry.sha256 else "sha256 did not match the manifest"


def _draw(bundle_dir: Path, manifest: Manifest, family, progress) -> dict[str, dict]:
    """Every weight file's tensors, the model drawn again as the manifest records it (torch imported here)."""
    import torch

    from runner.export.methods import method_weights
    from runner.export.options import ExportOptions
    from runner.export.pipeline import prepare
    from runner.export.quant import GROUP_SIZE, apply_quant

    source, meta = manifest.model["source"], manifest.model
    for key in ("max_seq_len", "max_audio_chunks"):  # their ranges were checked as the manifest was read
        if key not in meta:
            raise BundleError(f"{bundle_dir / MANIFEST_NAME}: model.{key} is missing; the weights are drawn for it")
    quant = meta.get("quant")  # a quantised bundle's weights are the drawn model quantised as its record says
    dtype = {"float32": "fp32", "bfloat16": "bf16"}[manifest.dtype]
    opts = ExportOptions(
        device=manifest.device,
        dtype=dtype,
        max_seq_len=meta["max_seq_len"],
        max_audio_chunks=meta["max_audio_chunks"],
        check=False,
        pdl=bool(meta.get("pdl", False)),
    )
    if source["kind"] == PACKAGE:
        model, drawn = _convert(bundle_dir, source["package"], family, progress)
    else:
        if progress:
            progress("weights", f"drawing {source['name']} (seed {source['seed']}) on {manifest.device}")
        model, drawn = family.redraw.random_model(
            source["name"], source["seed"], torch.bfloat16 if dtype == "bf16" else torch.float32, manifest.device
        )
    if drawn.weights_digest != source["weights_digest"]:
        what = "the package's weights are" if source["kind"] == PACKAGE else f"the preset {source['name']!r} is"
        raise RunnerError(
            f"{bundle_dir}: {what} not the one this bundle was made from (its config changed since); export it again"
        )
    model, _ = prepare(model, drawn, opts, family)
    if quant:
        apply_quant(model, family, quant["scheme"], quant.get("group_size", GROUP_SIZE))  # fp8: no groups
    tensors = {}
    for plan in family.redraw.plan_methods(model, opts):  # the family's methods give each weight file's tensors
        tensors.setdefault(plan.spec.weights, method_weights(plan, family.redraw.weights_filter))
    return tensors


def _convert(bundle_dir: Path, package: dict, family, progress):
    """(model, its source record): converted again from the installed package the manifest pins; one line naming
    what to install where it is missing or not the pinned one."""
    if progress:
        progress("weights", f"converting {package['file']} of {package['name']} {package['version']} again")
    try:
        return family.redraw.package_model(package)
    except RunnerError as e:
        raise RunnerError(
            f"{bundle_dir}: its weights are converted from {package['name']} {package['version']}: {e}"
        ) from None


def _put(bundle_dir: Path, name: str, tensors: dict, want: str) -> None:
    """Write `tensors` beside `name`, check the digest, then rename over it (a file there is replaced, not
    written into: a hard link to it elsewhere keeps its bytes)."""
    from safetensors.torch import save_file

    path = bundle_dir / name
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp))
        got = sha256_file(tmp)
        if got != want:
            raise RunnerError(
                f"{path}: the regenerated weights do not match the manifest (sha256 {got[:12]}…, want {want[:12]}…); "
                "this machine draws other numbers: export the bundle here instead"
            )
        tmp.chmod(0o644)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_can_regenerate(bundle_dir: Path, manifest: Manifest, todo: dict[str, str]):
    """The family that draws these weights again; one line why not where they cannot be."""
    from runner.export import registry
    from runner.export.checkpoint import generator_id

    name, why = next(iter(todo.items()))
    source = manifest.model.get("source") if isinstance(manifest.model, dict) else None
    kind = source.get("kind") if isinstance(source, dict) else None
    if kind not in (RANDOM_INIT, PACKAGE):
        raise RunnerError(
            f"{bundle_dir}: weights {why} ({name}), and they come from {kind or 'an unknown source'}, not random "
            "init or a pinned package: only random-init weights can be drawn again, and a pinned package's "
            "converted again; fetch the bundle with its weights"
        )
    _check_source(bundle_dir, source)
    family = registry.family(manifest.model["family"])
    way = "package_model" if kind == PACKAGE else "random_model"
    if family.redraw is None or getattr(family.redraw, way) is None:
        able = registry.taking(lambda f: f.redraw is not None and getattr(f.redraw, way) is not None)
        raise RunnerError(
            f"{bundle_dir}: the weights of a {family.name} bundle from {kind} cannot be made again (only "
            f"{able or 'no'} bundles'); fetch the bundle with its weights"
        )
    made_by, here = source.get("generator"), generator_id(manifest.device)
    if kind == RANDOM_INIT and made_by != here:  # a package's are converted, not drawn: no generator to match
        raise RunnerError(
            f"{bundle_dir}: its weights were drawn by {made_by or 'an older exporter'}; this machine has {here}, "
            "which gives other numbers for the same seed: regenerate them with that torch on that device, or export "
            "the bundle here"
        )
    _check_quant(bundle_dir, manifest)
    return family


def _check_source(bundle_dir: Path, source: dict) -> None:
    """The record random_model is called with: a preset name, a seed torch takes, the digest to compare (a
    package's record, `model.source.package`, was checked as the manifest was read)."""
    seed = [] if source["kind"] == PACKAGE else [
        ("seed", lambda v: in_range(v, 0, MAX_SEED), f"a whole number from 0 to {MAX_SEED}")
    ]  # fmt: skip
    for key, ok, what in (
        ("name", lambda v: isinstance(v, str) and v, "a preset name"),
        *seed,
        ("weights_digest", lambda v: isinstance(v, str), "a sha256"),
    ):
        if not ok(source.get(key)):
            raise BundleError(
                f"{bundle_dir / MANIFEST_NAME}: model.source.{key} is {source.get(key)!r}, expected {what}"
            )


def _check_quant(bundle_dir: Path, manifest: Manifest) -> None:
    import torch

    from runner.models.quant_linear import check_layout

    if quant := manifest.model.get("quant"):
        try:
            check_layout(quant)
        except BundleError as e:
            raise RunnerError(f"{bundle_dir}: {e}") from None
    if manifest.device == "cuda" and not torch.cuda.is_available():
        raise RunnerError(f"{bundle_dir}: its weights were drawn on CUDA; this machine has no CUDA device")
