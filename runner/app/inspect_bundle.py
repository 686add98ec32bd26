"""The `inspect` verb: a bundle's manifest (its model, capacity, batch, quantisation, methods and files), verified
unless --no-verify, as text or the raw JSON."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", type=Path, help="bundle directory")
    p.add_argument("--json", action="store_true", help="print the raw manifest")
    p.add_argument("--no-verify", action="store_true", help="skip the digest check")


def main(args: argparse.Namespace) -> int:
    from runner.bundle import MANIFEST_NAME, read_manifest, verify_bundle
    from runner.digests import DigestCache

    digests = DigestCache(args.env.cache_dir / "digests.json", rehash=args.env.rehash)
    manifest = read_manifest(args.bundle) if args.no_verify else verify_bundle(args.bundle, digests=digests)
    if args.json:
        print((args.bundle / MANIFEST_NAME).read_text(), end="")
        return 0
    render_manifest(manifest, args.bundle, verified=not args.no_verify)
    return 0


def render_manifest(manifest, bundle: Path, verified: bool) -> None:
    from rich.console import Console

    m = manifest.model
    caps = _capabilities(bundle, m)
    console = Console()
    console.print(f"[bold]{bundle}[/bold]  format v{manifest.format_version}, {manifest.created_by}")
    console.print(
        f"built with torch {manifest.torch_version} for {manifest.device}"
        f"{' ' + manifest.gpu_arch if manifest.gpu_arch else ''}, dtype {manifest.dtype}"
    )
    console.print(model_line(m))
    per_chunk = (
        f"{m['tokens_per_chunk']} decoder positions per chunk"
        if m["tokens_per_chunk"]
        else "cross-attended: no decoder positions"
    )
    console.print(
        f"context {m['max_seq_len']} tokens, audio up to {m['max_audio_chunks']} x 30 s per encoder call ({per_chunk})"
    )
    console.print(capacity_line(m, chat=caps.chat_prompts), highlight=False)
    if caps.batching:
        console.print(batch_line(m), highlight=False)
    if "prefill_pieces" in m:  # a family whose text_decoder can take a prompt in pieces says whether this one does
        console.print(prefill_line(m), highlight=False)
    console.print(quant_line(m.get("quant")), highlight=False)
    for name, why in (m.get("fallbacks") or {}).items():  # export compiled a plan's fallback (pipeline.build_bundle)
        first = why.removeprefix("self-check: ") if why.startswith("self-check: ") else None
        failed = f"the first differed from eager: {first}" if first else f"the first did not compile: {why}"
        console.print(f"{name}: its fallback was compiled ({failed})", highlight=False)
    console.print("special tokens: " + ", ".join(f"{k}={v}" for k, v in m["special_tokens"].items()))
    console.print(_methods_table(manifest))
    console.print(_files_table(manifest, verified))


def _capabilities(bundle: Path, model: dict):
    """What the bundle's family declares it can do (no file of the bundle is read: a broken tokenizer still shows)."""
    from runner.errors import BundleError
    from runner.families import FAMILIES

    family = FAMILIES.get(model["family"])  # a field every manifest has (runner/manifest_fields.py)
    if family is None:
        raise BundleError(f"{bundle}: model family {model['family']!r} is not one this runner knows")
    return family.capabilities


def model_line(m: dict) -> str:
    c, src = m["config"], m.get("source", {})
    return (
        f"model: {m.get('family')} from {src.get('kind')} {src.get('name')}"
        f"{' seed ' + str(src['seed']) if src.get('seed') is not None else ''}; "
        f"text {c['text']['n_layers']}x{c['text']['dim']} ({c['text']['n_heads']} heads, "
        f"{c['text']['n_kv_heads']} kv), audio {c['audio']['n_layers']}x{c['audio']['dim']}, "
        f"vocab {c['text']['vocab_size']}"
    )


def _methods_table(manifest):
    from rich.table import Table

    methods = Table("method", "inputs", "outputs", "state", "library", title="methods")
    for name, spec in manifest.methods.items():
        methods.add_row(
            name,
            "\n".join(t.describe() for t in spec.inputs),
            "\n".join(t.describe() for t in spec.outputs),
            str(len(spec.state) or ""),
            spec.library,
        )
    return methods


def _files_table(manifest, verified: bool):
    from rich.table import Table

    files = Table("file", "bytes", "sha256", title="files" + (" (digests verified)" if verified else ""))
    for name, f in manifest.files.items():
        files.add_row(name, f"{f.size:,}", f.sha256[:16] + "…")
    return files


def quant_line(quant: dict | None) -> str:
    """The manifest's `quant` record (runner/export/quant.py) in one line; none: unquantised."""
    if not quant:
        return "weights: unquantised (the bundle's dtype)"
    if quant["scheme"] == "fp8":
        kept = quant.get("from_checkpoint", 0)
        prefill = {"scaled_mm": "; the prompt on the fp8 tensor cores (torch._scaled_mm)"}.get(quant.get("prefill"), "")
        return (
            f"weights: fp8 (e4m3) weight-only, a {quant['scale_dtype']} scale per output channel, "
            f"{quant['n_linear']} linear layers ({', '.join(quant['modules'])})"
            f"{f', {kept} as the checkpoint stored them' if kept else ''}{prefill}; the rest unquantised"
        )
    return (
        f"weights: {quant['scheme']} weight-only, groups of {quant['group_size']}, "
        f"{'symmetric' if quant['symmetric'] else 'asymmetric (scale + zero)'} in {quant['scale_dtype']}, "
        f"{quant['layout']} layout, "
        f"{quant['n_linear']} linear layers ({', '.join(quant['modules'])}); the rest unquantised"
    )


def batch_line(model: dict) -> str:
    """How many files one decode step takes (manifest `max_batch`; none: one)."""
    n = model.get("max_batch", 1)
    if n > 1:
        return f"batch: up to {n} files decoded at once (text_decoder_batch; run --batch N, N <= {n})"
    return "batch: one file at a time (export with --max-batch N to decode N at once)"


def prefill_line(model: dict) -> str:
    """Whether text_decoder takes a prompt in pieces (manifest `prefill_pieces`)."""
    if model.get("prefill_pieces"):
        return "prefill: in one call, or in pieces of T tokens with run/bench --prefill-chunk T (less GPU memory)"
    return "prefill: in one call (its attention starts at position 0)"


def capacity_line(model: dict, chat: bool) -> str:
    """How long audio one prompt takes and what happens beyond it (a manifest without `capacity`, as a
    cross-attending family's: worked out from its chunks). `chat`: the family takes a --prompt, which that bounds."""
    chunks, per_chunk = model.get("max_audio_chunks", 1), model.get("tokens_per_chunk") or 0
    cap = model.get("capacity") or {"audio_seconds": chunks * 30, "audio_positions": chunks * per_chunk}
    minutes, seconds = divmod(cap["audio_seconds"], 60)
    length = " ".join(([f"{minutes} min"] if minutes else []) + ([f"{seconds} s"] if seconds or not minutes else []))
    detail = [f"{cap['audio_positions']} decoder positions"] if per_chunk else []
    detail += [f"{cap['answer_positions']} left for the answer"] if "answer_positions" in cap else []
    suffix = "; a --prompt takes at most that" if chat else ""
    return (
        f"capacity: {length} of audio in one prompt{' (' + ', '.join(detail) + ')' if detail else ''}; "
        f"longer audio is transcribed in windows{suffix}"
    )
