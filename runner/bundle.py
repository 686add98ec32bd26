"""The bundle: `model.pte` (a JSON program manifest), one AOTI `.so` per method, weight files, `tekken.json`.

Everything here is plain data. `verify_bundle` checks every file's size and sha256 *before* any `.so` is
dlopen'ed: a flipped byte in a library must be a clear error, never undefined behaviour at load time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from runner.digests import DigestCache, is_digest, sha256_file, sha256_range, workers
from runner.errors import BundleError
from runner.manifest_fields import (
    PACKAGE,
    RANDOM_INIT,
    FieldError,
    check_dtype,
    check_name,
    check_shape,
    check_top,
    is_int,
    need,
)

MANIFEST_NAME = "model.pte"
FORMAT_NAME = "voxtral-aoti-bundle"
# 3: the manifest names its family and the methods that family requires. An older bundle is refused with one
# line saying to export it again.
FORMAT_VERSION = 3
# A batched decode method's slot cache (text_decoder_batch) is named as the prefill's cache under this prefix
# (batch.layers.0.self_attn.kv_cache.k_cache): how the runtime pairs the cache a prompt is prefilled into with the
# slots it is copied to.
BATCH_STATE_PREFIX = "batch."
CHUNK_BYTES = 64 << 20  # files larger than this also get a sha256 per 64 MiB piece
# The methods of a prompted bundle (the runtime's ProgramEngine runs them); a family lists what its bundles
# require in the manifest's `model.required_methods`.
METHOD_NAMES = ("preprocessor", "audio_encoder", "token_embedding", "text_decoder")
# Optional: the decoder exported for one token, sharing text_decoder's weights file (and so its KV cache).
STEP_METHOD = "text_decoder_step"
# Optional: the decoder for B sequences at once, each in a slot of its own cache (export --max-batch N > 1).
BATCH_METHOD = "text_decoder_batch"
# Optional: a whole token sequence over one window's cross-attention, for word timestamps (Whisper).
ALIGN_METHOD = "alignment"
MAX_MANIFEST_BYTES = 16 << 20  # a 3B bundle's model.pte is ~10 kB: anything near this is not a manifest
UNLISTED_REFUSED = (".so", ".safetensors")  # code and weights: in the bundle only if the manifest pins them

# A dimension is either a fixed int or a dynamic range; `multiple` is for the waveform (whole 30 s chunks).
Dim = int | dict[str, int]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix: "float32", "bfloat16", "int64"
    shape: list[Dim]

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "tensor") -> TensorSpec:
        need(isinstance(d, dict), where, d, "an object with name, dtype and shape")
        return cls(
            name=check_name(f"{where}.name", d.get("name")),
            dtype=check_dtype(f"{where}.dtype", d.get("dtype")),
            shape=check_shape(f"{where}.shape", d.get("shape")),
        )

    def describe(self) -> str:
        dims = ", ".join(str(d) if isinstance(d, int) else f"{d['min']}..{d['max']}" for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"


@dataclass(frozen=True)
class StateSpec:
    """A mutable buffer (the KV cache) the runtime allocates zeroed and binds into the container."""

    shape: list[int]
    dtype: str


@dataclass(frozen=True)
class MethodSpec:
    name: str
    library: str  # the .so, relative to the bundle
    weights: str | None  # safetensors file keyed by each constant's original FQN
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    state: dict[str, StateSpec] = field(default_factory=dict)  # by original FQN

    @classmethod
    def from_dict(cls, name: str, d: dict[str, Any]) -> MethodSpec:
        at = f"methods.{name}"
        need(isinstance(d, dict), at, d, "an object")
        library, weights = d.get("library"), d.get("weights")
        check_name(f"{at}.library", library)  # used as paths and keys
        need(weights is None or (isinstance(weights, str) and weights), f"{at}.weights", weights, "null or a file name")
        tensors = {}
        for kind in ("inputs", "outputs"):
            need(isinstance(d.get(kind), list), f"{at}.{kind}", d.get(kind), "a list of tensors")
            tensors[kind] = [TensorSpec.from_dict(x, f"{at}.{kind}[{i}]") for i, x in enumerate(d[kind])]
        state = d.get("state", {})
        need(isinstance(state, dict), f"{at}.state", state, "an object of buffer name -> shape and dtype")
        for k, v in state.items():
            need(isinstance(v, dict), f"{at}.state.{k}", v, "an object with shape and dtype")
        return cls(
            name=name,
            library=library,
            weights=weights,
            inputs=tensors["inputs"],
            outputs=tensors["outputs"],
            state={
                k: StateSpec(
                    shape=check_shape(f"{at}.state.{k}.shape", v.get("shape"), dynamic=False),
                    dtype=check_dtype(f"{at}.state.{k}.dtype", v.get("dtype")),
                )
                for k, v in state.items()
            },
        )


@dataclass(frozen=True)
class FileEntry:
    """A file's size and sha256 and, for large files, the sha256 of each `chunk_size` piece in order. A
    single sha256 is one sequential pass on one core: 6.2 s for a 3B bundle on the H200, most of a cold load.
    The pieces verify on every core. They are as binding as the whole digest, because the manifest names both."""

    sha256: str
    size: int
    chunk_size: int | None = None
    chunks: list[str] | None = None

    def __post_init__(self):
        if not (isinstance(self.sha256, str) and is_digest(self.sha256)) or not _is_count(self.size):
            raise ValueError("a file entry needs a 64-hex-digit sha256 and a size >= 0")
        if self.chunks is None and self.chunk_size is None:
            return
        if not (_is_count(self.chunk_size) and self.chunk_size > 0 and isinstance(self.chunks, list)):
            raise ValueError("chunks need a chunk_size > 0 and a list of digests")
        if len(self.chunks) != -(-self.size // self.chunk_size) or not all(is_digest(c) for c in self.chunks):
            raise ValueError(f"{len(self.chunks)} chunk digests for {self.size} bytes in pieces of {self.chunk_size}")

    def pieces(self) -> list[tuple[int, int, str]]:
        """(offset, length, sha256) of each chunk."""
        n = self.chunk_size or 0
        return [(i * n, min(n, self.size - i * n), d) for i, d in enumerate(self.chunks or [])]


def _is_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


@dataclass(frozen=True)
class Manifest:
    format_version: int
    torch_version: str
    device: str  # "cpu" or "cuda"
    gpu_arch: str | None  # e.g. "sm_90"; None on CPU bundles
    dtype: str  # model dtype: "float32" or "bfloat16"
    model: dict[str, Any]  # config, special token ids, max_seq_len, max_audio_chunks, source
    methods: dict[str, MethodSpec]
    files: dict[str, FileEntry]
    created_by: str = "runner"

    def to_json(self) -> str:
        d = asdict(self)
        d["files"] = {k: {f: v for f, v in e.items() if v is not None} for k, e in d["files"].items()}
        d = {"format": FORMAT_NAME, **d}
        return json.dumps(d, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST_NAME) -> Manifest:
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSON, UTF-8, a 5000-digit int; RecursionError: nesting too deep
            raise BundleError(f"{source}: not a JSON manifest ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise BundleError(f"{source}: not a {FORMAT_NAME} manifest")
        version = d.get("format_version")
        if not is_int(version, 1):
            raise BundleError(f"{source}: malformed manifest: format_version {version!r} is not a version number")
        if version > FORMAT_VERSION:
            raise BundleError(
                f"{source}: format version {version!r} is newer than this runner reads ({FORMAT_VERSION}); "
                "upgrade the runner"
            )
        if version < FORMAT_VERSION:
            raise BundleError(
                f"{source}: format version {version!r} is older than this runner reads ({FORMAT_VERSION}); "
                "export the bundle again"
            )
        try:
            check_top(d)
            for rel, v in d["files"].items():
                need(isinstance(v, dict), f"files.{rel}", v, "an object with sha256 and size")
            return cls(
                format_version=version,
                torch_version=d["torch_version"],
                device=d["device"],
                gpu_arch=d.get("gpu_arch"),
                dtype=d["dtype"],
                model=d["model"],
                methods={k: MethodSpec.from_dict(k, v) for k, v in d["methods"].items()},
                files={k: FileEntry(**v) for k, v in d["files"].items()},
                created_by=d.get("created_by", "runner"),
            )
        except FieldError as e:
            raise BundleError(f"{source}: malformed manifest: {e}") from None
        except (TypeError, ValueError) as e:  # TypeError: a file entry with unknown fields
            raise BundleError(f"{source}: malformed manifest ({type(e).__name__}: {e})") from None


def safe_member(bundle_dir: Path, rel: str) -> Path:
    """Resolve a manifest path inside the bundle; refuse absolute paths, `..` and links: the file's own, and a
    directory's on the way to it (`lib/x.so` with `lib` a link out of the bundle is outside it)."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel or "\0" in rel:
        raise BundleError(f"manifest names a path outside the bundle: {rel!r}")
    full = bundle_dir
    for part in p.parts:
        full = full / part
        if full.is_symlink():
            raise BundleError(f"{full}: links are not allowed in a bundle")
    return full


def file_entries(
    bundle_dir: Path, names: list[str], chunk_size: int = CHUNK_BYTES, digests: DigestCache | None = None
) -> dict[str, FileEntry]:
    """Size, sha256 and (over `chunk_size`) per-chunk digests of each file. The whole-file digests are
    remembered, so the first load of this bundle need not hash again; pieces hash on every core meanwhile."""
    paths = [bundle_dir / n for n in names]
    sizes = [p.stat().st_size for p in paths]
    with ThreadPoolExecutor(max_workers=workers()) as pool:
        pieces = {
            (n, off): pool.submit(sha256_range, p, off, min(chunk_size, size - off))
            for n, p, size in zip(names, paths, sizes)
            if size > chunk_size
            for off in range(0, size, chunk_size)
        }
        whole = (digests or DigestCache()).sha256_all(paths)
        chunks = {n: [f.result() for (m, _), f in pieces.items() if m == n] for n in names}
    return {
        n: FileEntry(d, size, chunk_size, chunks[n]) if chunks[n] else FileEntry(d, size)
        for n, size, d in zip(names, sizes, whole)
    }


def write_manifest(bundle_dir: Path, manifest: Manifest) -> Path:
    path = Path(bundle_dir) / MANIFEST_NAME
    path.write_text(manifest.to_json())
    return path


def read_manifest(bundle_dir: str | os.PathLike) -> Manifest:
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST_NAME
    if bundle_dir.name == MANIFEST_NAME and bundle_dir.is_file():  # a common slip: DIR/model.pte for DIR
        raise BundleError(f"{bundle_dir}: that is the manifest; pass the bundle directory, {bundle_dir.parent}")
    if not bundle_dir.is_dir():
        raise BundleError(f"{bundle_dir}: no such bundle directory")
    if path.is_symlink():  # the manifest pins every other file: one read from outside the bundle pins nothing
        raise BundleError(f"{path}: links are not allowed in a bundle")
    if not path.is_file():
        raise BundleError(f"{path}: missing (is {bundle_dir} a bundle?)")
    if path.stat().st_size > MAX_MANIFEST_BYTES:  # read whole below: bound it first
        raise BundleError(f"{path}: {path.stat().st_size} bytes; not a manifest (those are a few kB)")
    return Manifest.from_json(path.read_text(errors="replace"), source=str(path))


def weight_files(manifest: Manifest) -> list[str]:
    """The manifest's weight files (one may serve two methods)."""
    return sorted({m.weights for m in manifest.methods.values() if m.weights})


def missing_weights(bundle_dir: str | os.PathLike, manifest: Manifest) -> list[str]:
    """The manifest's weight files that are not in `bundle_dir` (a random-init or package artifact travels without
    them)."""
    return [f for f in weight_files(manifest) if not (Path(bundle_dir) / f).is_file()]


def regenerable_weights(manifest: Manifest) -> set[str]:
    """The weight files of a bundle that records how to make them again (they need not travel:
    runner/export/regenerate.py makes them again and checks them against their digests): a random-init bundle's,
    drawn from its seed by the generator it names, or a pinned package's, converted again from that package (the
    manifest's checks require its record); empty otherwise."""
    source = manifest.model.get("source") if isinstance(manifest.model, dict) else None
    kind = source.get("kind") if isinstance(source, dict) else None
    if not ((kind == RANDOM_INIT and source.get("generator")) or kind == PACKAGE):
        return set()
    return set(weight_files(manifest))


def weights_origin(manifest: Manifest) -> str:
    """Where the weights of a bundle that travels without them are made again from, for a line."""
    source = manifest.model["source"]
    if source.get("kind") == PACKAGE:
        return f"converted from {source['package']['name']} {source['package']['version']}"
    return "random-init: drawn from its seed"


def verify_bundle(
    bundle_dir: str | os.PathLike,
    *,
    check_digests: bool = True,
    digests: DigestCache | None = None,
    absent: Collection[str] = (),
) -> Manifest:
    """Read the manifest and check that every file it names is present, unlinked, of the right size and
    digest, and that every method's library and weights are among those files. Raises BundleError.
    `digests` remembers verified files (default: the user cache's). Files named in `absent` may be missing (a
    random-init or package bundle's weights, made again after the download: runner/export/regenerate.py); present,
    they are checked like the rest."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    for method in manifest.methods.values():
        for rel in filter(None, (method.library, method.weights)):
            if rel not in manifest.files:
                raise BundleError(f"{bundle_dir / MANIFEST_NAME}: method {method.name} uses {rel}, not listed in files")
    missing = [m for m in manifest.model["required_methods"] if m not in manifest.methods]
    if missing:
        raise BundleError(f"{bundle_dir / MANIFEST_NAME}: methods missing: {', '.join(missing)}")
    _check_roles(manifest, bundle_dir / MANIFEST_NAME)
    # A library or weight file the manifest does not pin is a mixed or tampered bundle (e.g. a new export copied
    # over an old one): refuse it rather than leave it beside the code we load.
    listed = {part for rel in manifest.files for part in PurePosixPath(rel).parts[:1]}
    for p in sorted(bundle_dir.iterdir()):
        if p.name not in listed and (p.suffix in UNLISTED_REFUSED or ".so." in p.name):
            raise BundleError(
                f"{p}: not listed in {MANIFEST_NAME}; a bundle holds only the libraries and weights it pins"
            )
    paths = {}
    for rel, entry in manifest.files.items():
        path = safe_member(bundle_dir, rel)
        if rel in absent and not path.exists():
            continue
        paths[rel] = path
        if not path.is_file() and rel in regenerable_weights(manifest):
            raise BundleError(
                f"{path}: missing: this bundle travels without its weights ({weights_origin(manifest)}); make them "
                f"with `python -m runner export --regenerate {bundle_dir}`"
            )
        if not path.is_file():
            raise BundleError(f"{path}: missing from the bundle")
        size = path.stat().st_size
        if size != entry.size:
            raise BundleError(f"{path}: size {size} does not match the manifest ({entry.size})")
    if check_digests:
        _verify_digests({rel: manifest.files[rel] for rel in paths}, paths, digests or DigestCache())
    return manifest


def _check_roles(manifest: Manifest, source: Path) -> None:
    """Each file has one role. A method's library is its own (a manifest pointing audio_encoder at
    text_decoder.so would run one method's code as another's) and never a weights file or the tokenizer; the
    tokenizer is pinned like every other file. Methods may share a weights file (text_decoder_step binds
    text_decoder's)."""
    tokenizer = manifest.model["tokenizer"]
    if tokenizer not in manifest.files:
        raise BundleError(f"{source}: the tokenizer {tokenizer} is not listed in files")
    others = {m.weights for m in manifest.methods.values()} | {tokenizer, MANIFEST_NAME}
    owner: dict[str, str] = {}
    for m in manifest.methods.values():
        if m.library in owner:
            raise BundleError(f"{source}: methods {owner[m.library]} and {m.name} name one library, {m.library}")
        if m.library in others:
            raise BundleError(f"{source}: method {m.name}'s library {m.library} is also a weights or tokenizer file")
        owner[m.library] = m.name


def _verify_digests(entries: dict[str, FileEntry], paths: dict[str, Path], cache: DigestCache) -> None:
    """Every file against its manifest digest: a remembered digest costs nothing; a chunked file is hashed
    piece by piece on every core (and then remembered as verified); any other file is hashed whole. A remembered
    digest that disagrees is hashed again before it counts: the cache is only a cache."""
    mismatch = "sha256 does not match the manifest (corrupt or modified file)"
    pool = ThreadPoolExecutor(max_workers=workers())
    try:
        jobs = {}
        for rel, entry in entries.items():
            known = cache.known(paths[rel])
            if known == entry.sha256:
                continue
            if entry.chunks:
                jobs[rel] = [(o, n, want, pool.submit(sha256_range, paths[rel], o, n)) for o, n, want in entry.pieces()]
            else:
                jobs[rel] = [(0, entry.size, entry.sha256, pool.submit(sha256_file, paths[rel]))]
        for rel, pieces in jobs.items():
            for offset, n, want, got in pieces:
                if got.result() != want:
                    where = f" (bytes {offset}..{offset + n})" if entries[rel].chunks else ""
                    raise BundleError(f"{paths[rel]}: {mismatch}{where}")
            cache.remember(paths[rel], entries[rel].sha256)  # every piece matched: the whole file is the one named
    finally:
        pool.shutdown(cancel_futures=True)  # on a mismatch, do not hash the rest of a 9 GB bundle first
    cache.save()


def bundle_digest(manifest_path: Path) -> str:
    """The bundle's identity: the manifest's sha256 (it pins every other file's sha256)."""
    return sha256_file(manifest_path)
