"""Random-weight bundles travel without their weights: the manifest records how they were drawn (preset, seed, the
generator: torch's version and device type) and every weight file's sha256, and a consuming job draws them again
here, checks each file against the manifest before it is moved into place, and only then is anything loaded.

A 3B random-init bundle is 9.35 GB of weights and a few hundred MB of `.so`: the weights are what an artifact
upload, two downloads and a `fetch` would move. Regenerating them on the GPU takes seconds.

    python -m runner export --regenerate DIR
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from runner.bundle import Manifest, missing_weights, read_manifest
from runner.digests import sha256_file
from runner.errors import BundleError, RunnerError
from runner.export import registry
from runner.export.checkpoint import generator_id
from runner.export.methods import method_weights
from runner.export.pipeline import ExportOptions, prepare
from runner.export.quant import apply_quant
from runner.models.quant_linear import check_layout

RANDOM_INIT = "random-init"  # ModelSource.kind of random_model's weights


def regenerate(bundle_dir: str | os.PathLike, progress=None) -> list[str]:
    """Draw a random-init bundle's weights again into `bundle_dir`; returns the files written (none when all are
    there). Each is written beside its final name, checked against the manifest's sha256, then renamed into place:
    a mismatch leaves nothing behind and raises RunnerError with one line."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    missing = missing_weights(bundle_dir, manifest)
    if not missing:
        return []
    family = _check_can_regenerate(bundle_dir, manifest)
    source, meta = manifest.model["source"], manifest.model
    quant = meta.get("quant")  # an int4 bundle's weights are the drawn model quantised as its record says
    dtype = {"float32": "fp32", "bfloat16": "bf16"}[manifest.dtype]
    opts = ExportOptions(
        device=manifest.device,
        dtype=dtype,
        max_seq_len=meta["max_seq_len"],
        max_audio_chunks=meta["max_audio_chunks"],
        check=False,
        pdl=bool(meta.get("pdl", False)),
    )
    if progress:
        progress("weights", f"drawing {source['name']} (seed {source['seed']}) on {manifest.device}")
    model, drawn = family.redraw.random_model(
        source["name"], source["seed"], torch.bfloat16 if dtype == "bf16" else torch.float32, manifest.device
    )
    if drawn.weights_digest != source["weights_digest"]:
        raise RunnerError(
            f"{bundle_dir}: the preset {source['name']!r} is not the one this bundle was made from (its config "
            "changed since); export it again"
        )
    model, _ = prepare(model, drawn, opts, family)
    if quant:
        apply_quant(model, family, quant["scheme"], quant["group_size"])
    tensors = {}
    for plan in family.redraw.plan_methods(model, opts):  # the family's methods give each weight file's tensors
        tensors.setdefault(plan.spec.weights, method_weights(plan))
    written = []
    for name in missing:
        tmp = bundle_dir / f".{name}.{os.getpid()}.tmp"
        try:
            save_file({k: v.cpu() for k, v in tensors[name].items()}, str(tmp))
            got, want = sha256_file(tmp), manifest.files[name].sha256
            if got != want:
                raise RunnerError(
                    f"{bundle_dir / name}: the regenerated weights do not match the manifest (sha256 {got[:12]}…, "
                    f"want {want[:12]}…); this machine draws other numbers: export the bundle here instead"
                )
            tmp.chmod(0o644)
            tmp.replace(bundle_dir / name)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(name)
        if progress:
            progress(name, "regenerated, sha256 matches the manifest")
    return written


def _check_can_regenerate(bundle_dir: Path, manifest: Manifest) -> registry.ExportFamily:
    source = manifest.model.get("source") if isinstance(manifest.model, dict) else None
    if not isinstance(source, dict) or source.get("kind") != RANDOM_INIT:
        kind = source.get("kind") if isinstance(source, dict) else None
        raise RunnerError(
            f"{bundle_dir}: weights missing, and they come from {kind or 'an unknown source'}, not random init: "
            "only random-init weights can be drawn again; fetch the bundle with its weights"
        )
    family = registry.family(manifest.model["family"])
    if family.redraw is None:
        raise RunnerError(
            f"{bundle_dir}: the weights of a {family.name} bundle cannot be drawn again (only "
            f"{registry.taking(lambda f: f.redraw is not None)} bundles'); fetch the bundle with its weights"
        )
    made_by, here = source.get("generator"), generator_id(manifest.device)
    if made_by != here:
        raise RunnerError(
            f"{bundle_dir}: its weights were drawn by {made_by or 'an older exporter'}; this machine has {here}, "
            "which gives other numbers for the same seed: regenerate them with that torch on that device, or export "
            "the bundle here"
        )
    if quant := manifest.model.get("quant"):
        try:
            check_layout(quant)
        except BundleError as e:
            raise RunnerError(f"{bundle_dir}: {e}") from None
    if manifest.device == "cuda" and not torch.cuda.is_available():
        raise RunnerError(f"{bundle_dir}: its weights were drawn on CUDA; this machine has no CUDA device")
    return family
