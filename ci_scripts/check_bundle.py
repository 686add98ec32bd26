"""The required-file + digest check a CI job runs on a bundle directory, before uploading it and after
downloading it (the seed's workflow listed the files by hand; here the manifest is the list).

    python ci_scripts/check_bundle.py DIR [--expect-digest SHA] [--github-output FILE] [--summary FILE]

Prints a table (file, role, size, sha256) and exits 1 with one `error: ...` line when a file is missing, of the
wrong size or digest, or when the bundle is not the one expected. With --github-output it writes `bundle-digest`,
`bundle-bytes`, `bundle-files` and `upload-paths` (model.pte plus exactly the manifest's files, one per line: what
the upload step uploads, so nothing unchecked travels). Files in DIR the manifest does not name are warned about.
With --summary it appends the job summary: the files table, the total size, the bundle digest and each method's
compile time (the manifest's model.compile_seconds; with model.compile_cached, whether it came from the cache).

A bundle whose manifest records how to make its weights again does not ship them: a random-init bundle's (drawn
from its seed) and a pinned package's (Whisper tiny.en: converted from the installed package). They are left out
of `upload-paths` (unless --with-weights), may be absent when a downloaded bundle is checked, and are made again
and checked against their digests by `python -m runner export --regenerate DIR` (the benchmark and e2e sessions
do it) before anything loads them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runner/ without installing it (stdlib only here)

from runner.app.e2e_summary import md_text  # noqa: E402
from runner.bundle import (  # noqa: E402
    MANIFEST_NAME,
    Manifest,
    bundle_digest,
    read_manifest,
    regenerable_weights,
    verify_bundle,
    weights_origin,
)  # noqa: E402
from runner.errors import RunnerError  # noqa: E402

REQUIRED_FILES = ("tekken.json",)  # beyond each method's library and weights, which verify_bundle requires


def required_files(manifest: Manifest) -> tuple[str, ...]:
    """The tokenizer the manifest names (tokenizer.json for a Whisper bundle), else REQUIRED_FILES."""
    tokenizer = manifest.model.get("tokenizer") if isinstance(manifest.model, dict) else None
    return (tokenizer,) if isinstance(tokenizer, str) else REQUIRED_FILES


def roles(manifest: Manifest) -> dict[str, str]:
    out = {name: "" for name in manifest.files}
    for m in manifest.methods.values():
        out[m.library] = f"{m.name} library"
        if m.weights:  # one file may serve two methods (text_decoder and text_decoder_step)
            prior = out[m.weights].removesuffix(" weights") if out.get(m.weights) else ""
            out[m.weights] = f"{prior + ', ' if prior else ''}{m.name} weights"
    for name in required_files(manifest):
        if name in out:
            out[name] = "tokenizer"
    return out


def check(bundle_dir: Path, expect_digest: str | None = None) -> tuple[Manifest, str, list[str]]:
    """(manifest, bundle digest, unlisted files); raises RunnerError."""
    manifest = verify_bundle(bundle_dir, absent=regenerable_weights(read_manifest(bundle_dir)))
    missing = [f for f in required_files(manifest) if f not in manifest.files]
    if missing:
        raise RunnerError(f"{bundle_dir / MANIFEST_NAME}: does not list {', '.join(missing)}")
    digest = bundle_digest(bundle_dir / MANIFEST_NAME)
    if expect_digest and digest != expect_digest:
        raise RunnerError(f"{bundle_dir}: bundle digest {digest} is not the exported one ({expect_digest})")
    listed = {MANIFEST_NAME, *manifest.files}
    unlisted = sorted(
        p.relative_to(bundle_dir).as_posix() for p in bundle_dir.rglob("*") if not p.is_dir()
        if p.relative_to(bundle_dir).as_posix() not in listed
    )  # fmt: skip
    return manifest, digest, unlisted


def table(manifest: Manifest, bundle_dir: Path, digest: str) -> list[tuple[str, str, str, str]]:
    r = roles(manifest)
    rows = [(MANIFEST_NAME, "manifest", str((bundle_dir / MANIFEST_NAME).stat().st_size), digest)]
    rows += [(name, r[name], str(e.size), e.sha256) for name, e in sorted(manifest.files.items())]
    return rows


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--expect-digest", help="fail unless model.pte's sha256 is this (the export job's output)")
    ap.add_argument("--github-output", type=Path, help="append step outputs here ($GITHUB_OUTPUT)")
    ap.add_argument("--summary", type=Path, help="append a markdown table here ($GITHUB_STEP_SUMMARY)")
    ap.add_argument(
        "--with-weights", action="store_true", help="upload the weights of a bundle that records how to make them too"
    )
    args = ap.parse_args(argv)
    try:
        manifest, digest, unlisted = check(args.bundle, args.expect_digest)
    except RunnerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    drawn = set() if args.with_weights else regenerable_weights(manifest)
    rows = [(n, f"{role} (not uploaded: made again)" if n in drawn else role, size, sha)
            for n, role, size, sha in table(manifest, args.bundle, digest)]  # fmt: skip
    total = sum(int(r[2]) for r in rows)
    width, role_width = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    for name, role, size, sha in rows:
        print(f"{name:<{width}}  {role:<{role_width}}  {human(int(size)):>10}  {sha[:16]}")
    print(f"{args.bundle}: {len(rows)} files, {human(total)}, bundle digest {digest} "
          f"({manifest.device}, {manifest.dtype}, torch {manifest.torch_version})")  # fmt: skip
    for name in unlisted:
        print(f"warning: {args.bundle / name} is not in {MANIFEST_NAME}; it is not uploaded", file=sys.stderr)

    if drawn:
        left = sum(manifest.files[n].size for n in drawn)
        print(f"{args.bundle}: weights not uploaded ({human(left)}; {weights_origin(manifest)}): made again from "
              "the manifest's record by `python -m runner export --regenerate DIR`")  # fmt: skip
    if args.github_output:
        paths = "\n".join(str(args.bundle / r[0]) for r in rows if r[0] not in drawn)
        with open(args.github_output, "a") as f:
            f.write(f"bundle-digest={digest}\nbundle-bytes={total}\nbundle-files={len(rows)}\n")
            f.write(f"upload-paths<<__PATHS__\n{paths}\n__PATHS__\n")
    if args.summary:
        with open(args.summary, "a") as f:
            f.write(summary(manifest, args.bundle, digest, rows))
    return 0


def compile_rows(manifest: Manifest) -> tuple[list[tuple[str, float, bool | None]], bool]:
    """(method, compile seconds, from the compile cache or None) per method the manifest times, and whether the
    cache use was recorded (`model.compile_cached`); without it the table shows only the times."""
    model = manifest.model if isinstance(manifest.model, dict) else {}
    seconds, cached = model.get("compile_seconds"), model.get("compile_cached")
    if not isinstance(seconds, dict):
        return [], False
    cached = cached if isinstance(cached, dict) else {}
    rows = [
        (name, float(t), cached.get(name) if isinstance(cached.get(name), bool) else None)
        for name, t in seconds.items()
        if isinstance(t, (int, float))
    ]
    return rows, any(c is not None for _, _, c in rows)


def summary(manifest: Manifest, bundle_dir: Path, digest: str, rows: list[tuple[str, str, str, str]]) -> str:
    """The export job's summary: what was built, its files (role, size, sha256), the total size, the bundle
    digest, and each method's compile time (and whether it came from the compile cache, where recorded)."""
    total = sum(int(r[2]) for r in rows)
    arch = f", {manifest.gpu_arch}" if manifest.gpu_arch else ""
    out = [
        f"### Bundle {md_text(bundle_dir.name)}",
        "",
        md_text(f"{manifest.device}, {manifest.dtype}, torch {manifest.torch_version}{arch}; {len(rows)} files,")
        + f" {human(total)} in all; bundle digest `{digest}`",
        "",
        "| file | role | size | sha256 |",
        "|---|---|---:|---|",
        *(
            f"| {md_text(name)} | {md_text(role)} | {human(int(size))} | `{sha[:16]}` |"
            for name, role, size, sha in rows
        ),
        f"| **total** | | **{human(total)}** | |",
        "",
    ]
    times, recorded = compile_rows(manifest)
    if not times:
        out += ["compile time per method: not recorded in the manifest", ""]
        return "\n".join(out) + "\n"
    head, rule = ("| method | compile time | from the compile cache |", "|---|---:|---|") if recorded else (
        "| method | compile time |", "|---|---:|")  # fmt: skip
    out += [head, rule]
    for name, t, cached in times:
        cells = [md_text(name), f"{t:.1f} s" if t >= 10 else f"{t:.2f} s"] + (
            [{True: "yes", False: "no", None: "–"}[cached]] if recorded else []
        )
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"compile time in all: {sum(t for _, t, _ in times):.1f} s", ""]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
