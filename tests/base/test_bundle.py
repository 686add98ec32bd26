"""The bundle manifest: round trip, and verify_bundle refusing every kind of damaged or hostile bundle with a
BundleError that names the file at fault (before any `.so` is dlopen'ed)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.bundle import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    METHOD_NAMES,
    STEP_METHOD,
    FileEntry,
    Manifest,
    MethodSpec,
    StateSpec,
    TensorSpec,
    file_entries,
    read_manifest,
    verify_bundle,
    write_manifest,
)
from runner.digests import DigestCache, sha256_file
from runner.errors import BundleError
from runner.runtime.program import Program

try:
    from tests.json_paths import mutate, paths
except ImportError:  # tests/ on sys.path rather than importable as a package
    from json_paths import mutate, paths


@pytest.fixture
def bundle(tiny_bundle, tmp_path) -> Path:
    """A private copy of the tiny bundle, free to corrupt."""
    return Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))


def _edit_manifest(bundle: Path, edit) -> None:
    path = bundle / MANIFEST_NAME
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d, indent=2))


def _verify_fails(bundle: Path, *needles: str) -> str:
    with pytest.raises(BundleError) as e:
        verify_bundle(bundle)
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def _sample_manifest() -> Manifest:
    dyn = {"min": 1, "max": 8}
    return Manifest(
        format_version=FORMAT_VERSION,
        torch_version="2.13.0",
        device="cuda",
        gpu_arch="sm_90",
        dtype="bfloat16",
        model={
            "family": "voxtral",
            "required_methods": list(METHOD_NAMES),
            "config": {
                "text": {"vocab_size": 1024, "dim": 64, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1},
                "audio": {"dim": 64, "n_layers": 1},
            },
            "max_seq_len": 8,
            "max_audio_chunks": 2,
            "tokens_per_chunk": 375,
            "tokenizer": "tekken.json",
            "special_tokens": {"bos": 1},
            "nested": [1, 2.5, None, "x"],
        },  # fmt: skip
        methods={
            "audio_encoder": MethodSpec(
                "audio_encoder",
                "audio_encoder.so",
                "audio_encoder.safetensors",
                [TensorSpec("mel", "bfloat16", [{"min": 1, "max": 2}, 128, 3000])],
                [TensorSpec("audio_embeds", "bfloat16", [1, {"min": 375, "max": 750}, 64])],
            ),
            "preprocessor": MethodSpec(
                "preprocessor",
                "preprocessor.so",
                None,
                [TensorSpec("waveform", "float32", [{"min": 480000, "max": 960000, "multiple": 480000}])],
                [TensorSpec("mel", "float32", [dyn, 128, 3000])],
            ),
            "text_decoder": MethodSpec(
                "text_decoder",
                "text_decoder.so",
                "text_decoder.safetensors",
                [TensorSpec("embeds", "bfloat16", [1, dyn, 64]), TensorSpec("cache_position", "int64", [dyn])],
                [TensorSpec("logits", "float32", [1, 1024])],
                {"layers.0.self_attn.kv_cache.k_cache": StateSpec([1, 2, 8, 16], "bfloat16")},
            ),
        },
        files={"audio_encoder.so": FileEntry("ab" * 32, 123), "tekken.json": FileEntry("cd" * 32, 0)},
        created_by="runner test",
    )


# ---------------------------------------------------------------- manifest round trip


def test_manifest_round_trips_through_json():
    m = _sample_manifest()
    text = m.to_json()
    assert json.loads(text)["format"] == FORMAT_NAME
    back = Manifest.from_json(text)
    assert back == m
    assert back.to_json() == text


def test_exported_manifest_round_trips(tiny_bundle):
    m = read_manifest(tiny_bundle)
    assert Manifest.from_json(m.to_json()) == m
    assert m.to_json() == (tiny_bundle / MANIFEST_NAME).read_text()  # the file is exactly what to_json writes


def test_intact_bundle_verifies(bundle):
    m = verify_bundle(bundle)
    assert set(m.methods) == {*METHOD_NAMES, STEP_METHOD}


# ---------------------------------------------------------------- verify_bundle refuses, naming the file


def test_missing_manifest(bundle):
    (bundle / MANIFEST_NAME).unlink()
    _verify_fails(bundle, MANIFEST_NAME, "missing")


def test_missing_bundle_directory(tmp_path):
    with pytest.raises(BundleError, match="no such bundle"):
        verify_bundle(tmp_path / "absent")


@pytest.mark.parametrize("victim", ["audio_encoder.so", "text_decoder.safetensors", "tekken.json"])
def test_missing_file(bundle, victim):
    (bundle / victim).unlink()
    _verify_fails(bundle, victim, "missing")


def test_file_of_the_wrong_size(bundle):
    with open(bundle / "token_embedding.safetensors", "ab") as f:
        f.write(b"\0")
    _verify_fails(bundle, "token_embedding.safetensors", "size")


def test_flipped_byte_fails_the_digest(bundle):
    path = bundle / "text_decoder.so"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    _verify_fails(bundle, "text_decoder.so", "sha256")


CHUNK = 64 << 10  # every file of the tiny bundle is larger: all of them verify in pieces


@pytest.fixture
def chunked(bundle, tmp_path) -> Path:
    """The bundle re-described with per-chunk digests (file_entries remembers them in a cache of its own)."""
    m = read_manifest(bundle)
    files = file_entries(bundle, sorted(m.files), chunk_size=CHUNK, digests=DigestCache(tmp_path / "warm.json"))
    write_manifest(bundle, dataclasses.replace(m, files=files))
    return bundle


def test_chunked_files_verify_piece_by_piece_never_whole(chunked, tmp_path, monkeypatch):
    import runner.bundle as rb

    m = read_manifest(chunked)
    assert all(e.chunks and len(e.chunks) == -(-e.size // CHUNK) for e in m.files.values())
    for e in m.files.values():  # the pieces are the file's own bytes, in order
        assert e.pieces()[-1][0] + e.pieces()[-1][1] == e.size
    ranges = []
    real_range = rb.sha256_range
    monkeypatch.setattr(rb, "sha256_file", lambda p: pytest.fail(f"whole-file hash of {p}"))
    monkeypatch.setattr(rb, "sha256_range", lambda p, o, n: ranges.append((Path(p).name, o, n)) or real_range(p, o, n))
    cold = tmp_path / "cold.json"  # an empty digest cache
    verify_bundle(chunked, digests=DigestCache(cold))
    assert sorted(ranges) == sorted((rel, o, n) for rel, e in m.files.items() for o, n, _ in e.pieces())
    # verified pieces are remembered as the whole file's digest: the next load hashes nothing
    ranges.clear()
    verify_bundle(chunked, digests=DigestCache(cold))
    assert ranges == []
    verify_bundle(chunked, digests=DigestCache(cold, rehash=True))  # unless told to hash again
    assert len(ranges) == sum(len(e.pieces()) for e in m.files.values())


def test_flipped_byte_in_a_chunked_file_names_its_piece(chunked):
    path = chunked / "audio_encoder.safetensors"
    data = bytearray(path.read_bytes())
    at = 5 * CHUNK + 123
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    _verify_fails(chunked, "audio_encoder.safetensors", "sha256", f"bytes {5 * CHUNK}..{6 * CHUNK}")


@pytest.mark.parametrize(
    "edit",
    [
        lambda e: e.update(chunks=e["chunks"][:-1]),  # one piece short
        lambda e: e.update(chunk_size=0),
        lambda e: e.update(chunk_size=True),
        lambda e: e.pop("chunk_size"),
        lambda e: e.update(chunks=["zz" * 32] * len(e["chunks"])),
        lambda e: e.update(chunks="ab" * 32),
        lambda e: e.update(sha256="AB" * 32),
    ],
)
def test_inconsistent_chunk_entries_are_a_malformed_manifest(chunked, edit):
    _edit_manifest(chunked, lambda d: edit(d["files"]["text_decoder.safetensors"]))
    _verify_fails(chunked, MANIFEST_NAME, "malformed")


def test_flipped_byte_is_only_caught_with_digests_on(bundle):
    path = bundle / "tekken.json"
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    verify_bundle(bundle, check_digests=False)  # size still right
    _verify_fails(bundle, "tekken.json", "sha256")


def test_program_load_refuses_a_corrupt_library_before_dlopen(bundle):
    """A .so overwritten with garbage of the same size: BundleError from the digest, not a dlopen error."""
    path = bundle / "audio_encoder.so"
    path.write_bytes(b"\x7fELF" + b"\xff" * (path.stat().st_size - 4))
    with pytest.raises(BundleError, match="audio_encoder.so"):
        Program.load(bundle)


@pytest.mark.parametrize("rel", ["../x.so", "/abs.so", "sub/../../x.so", "a\\..\\x.so"])
def test_path_outside_the_bundle(bundle, rel):
    outside = bundle.parent / "x.so"
    outside.write_bytes(b"evil")

    def edit(d):
        d["files"][rel] = {"sha256": sha256_file(outside), "size": 4}
        d["methods"]["audio_encoder"]["library"] = rel

    _edit_manifest(bundle, edit)
    _verify_fails(bundle, repr(rel), "outside the bundle")
    with pytest.raises(BundleError):
        Program.load(bundle)


def test_symlinked_file(bundle, tmp_path):
    real = tmp_path / "elsewhere.json"
    shutil.move(bundle / "tekken.json", real)
    os.symlink(real, bundle / "tekken.json")  # same bytes, same size, same digest: still refused
    _verify_fails(bundle, "tekken.json", "link")


def test_symlinked_library(bundle, tmp_path):
    real = tmp_path / "lib.so"
    shutil.move(bundle / "preprocessor.so", real)
    os.symlink(real, bundle / "preprocessor.so")
    _verify_fails(bundle, "preprocessor.so", "link")


def test_newer_format_version(bundle):
    _edit_manifest(bundle, lambda d: d.update(format_version=FORMAT_VERSION + 1))
    _verify_fails(bundle, MANIFEST_NAME, "newer", "upgrade")


@pytest.mark.parametrize("version", range(1, FORMAT_VERSION))
def test_an_older_format_is_one_line_saying_to_export_again(bundle, version):
    _edit_manifest(bundle, lambda d: d.update(format_version=version))
    msg = _verify_fails(bundle, MANIFEST_NAME, f"format version {version}", "older", "export the bundle again")
    assert "\n" not in msg


@pytest.mark.parametrize("field", ["family", "required_methods"])
def test_a_manifest_without_its_family_or_required_methods_is_refused_by_name(bundle, field):
    _edit_manifest(bundle, lambda d: d["model"].pop(field))
    _verify_fails(bundle, MANIFEST_NAME, f"model.{field} is missing")


@pytest.mark.parametrize("version", [None, "1", 1.0])
def test_format_version_that_is_not_an_int(bundle, version):
    _edit_manifest(bundle, lambda d: d.update(format_version=version))
    _verify_fails(bundle, MANIFEST_NAME)


def test_not_a_bundle_format(bundle):
    _edit_manifest(bundle, lambda d: d.update(format="executorch-pte"))
    _verify_fails(bundle, MANIFEST_NAME, FORMAT_NAME)


@pytest.mark.parametrize("content", [b"", b"\x00\x01PTE binary", b'{"format": ', b"\xff\xfe\xfa", b"[1, 2, 3]"])
def test_manifest_that_is_not_json(bundle, content):
    (bundle / MANIFEST_NAME).write_bytes(content)
    _verify_fails(bundle, MANIFEST_NAME)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_missing_method(bundle, method):
    _edit_manifest(bundle, lambda d: d["methods"].pop(method))
    _verify_fails(bundle, MANIFEST_NAME, "methods missing", method)


def test_method_library_not_listed_in_files(bundle):
    _edit_manifest(bundle, lambda d: d["files"].pop("token_embedding.so"))
    _verify_fails(bundle, MANIFEST_NAME, "token_embedding.so", "not listed")


@pytest.mark.parametrize("field", ["torch_version", "device", "dtype", "model", "methods", "files"])
def test_manifest_missing_a_required_field(bundle, field):
    _edit_manifest(bundle, lambda d: d.pop(field))
    _verify_fails(bundle, MANIFEST_NAME, field)


# ---------------------------------------------------------------- property: from_json raises BundleError only

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _parse_or_bundle_error(text: str) -> None:
    try:
        m = Manifest.from_json(text)
    except BundleError:
        return
    assert isinstance(m, Manifest)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_from_json_on_arbitrary_text_raises_only_bundle_error(text):
    _parse_or_bundle_error(text)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_from_json_on_arbitrary_json_raises_only_bundle_error(value):
    _parse_or_bundle_error(json.dumps(value))


_VALID = json.loads(_sample_manifest().to_json())


_ALL_PATHS = [p for p in paths(_VALID) if p]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_ALL_PATHS), st.one_of(st.just("delete"), _json)), min_size=1, max_size=3))
def test_from_json_on_a_mutated_valid_manifest_raises_only_bundle_error(mutations):
    """A real manifest with parts replaced by arbitrary JSON (or deleted): the hostile inputs that get past the
    format check."""
    d = json.loads(json.dumps(_VALID))
    for path, new in mutations:
        mutate(d, path, new)
    _parse_or_bundle_error(json.dumps(d))


def test_from_json_on_deeply_nested_json_raises_bundle_error():
    _parse_or_bundle_error("[" * 100_000 + "]" * 100_000)
    _parse_or_bundle_error('{"format": "' + FORMAT_NAME + '", "format_version": 1, "model": ' + "[" * 100_000)


@pytest.fixture(scope="module")
def fuzz_bundle(tiny_bundle, tmp_path_factory) -> tuple[Path, str]:
    bundle = Path(shutil.copytree(tiny_bundle, tmp_path_factory.mktemp("fuzz") / "bundle"))
    return bundle, (bundle / MANIFEST_NAME).read_text()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_verify_bundle_on_a_mutated_real_manifest_raises_only_bundle_error(fuzz_bundle, data):
    """The exported manifest with parts replaced by arbitrary JSON (or deleted): verify_bundle passes or raises
    BundleError. A hostile manifest must never surface as a TypeError traceback."""
    bundle, text = fuzz_bundle
    d = json.loads(text)
    candidates = [p for p in paths(d) if p]
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(candidates), label="path")
        new = data.draw(st.one_of(st.just("delete"), _json), label="value")
        mutate(d, path, new)
    try:
        (bundle / MANIFEST_NAME).write_text(json.dumps(d))
        verify_bundle(bundle)
    except BundleError:
        pass
    finally:
        (bundle / MANIFEST_NAME).write_text(text)


# ---------------------------------------------------------------- bounded and only-a-cache (issue 23)


def test_a_manifest_far_larger_than_any_manifest_is_refused_unread(bundle):
    """A 17 MiB model.pte (valid JSON, padded) was read whole; a manifest is a few kB."""
    text = (bundle / MANIFEST_NAME).read_text()
    (bundle / MANIFEST_NAME).write_text(" " * (17 << 20) + text)
    _verify_fails(bundle, MANIFEST_NAME, "not a manifest")


def test_a_remembered_digest_that_disagrees_is_hashed_again_not_believed(bundle, tmp_path):
    """The digest cache is only a cache: a wrong digest remembered for an intact file (a cache copied from
    another machine, a stale entry) made verify_bundle call the file corrupt."""
    cache = DigestCache(tmp_path / "d.json")
    for rel in read_manifest(bundle).files:
        cache.remember(bundle / rel, "0" * 64)
    cache.save()
    verify_bundle(bundle, digests=DigestCache(tmp_path / "d.json"))  # hashed, found intact, remembered right
    again = DigestCache(tmp_path / "d.json")
    assert all(again.known(bundle / rel) == e.sha256 for rel, e in read_manifest(bundle).files.items())


@pytest.mark.parametrize("content", ["[1, 2]", "7", "null", '"x"', '{"k": 5, "j": [1]}', "{" * 10_000])
def test_a_digest_cache_that_is_not_an_object_of_digests_is_ignored(tmp_path, content):
    path = tmp_path / "d.json"
    path.write_text(content)
    cache = DigestCache(path)
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    assert cache.entries == {} and cache.known(f) is None and cache.sha256(f) == sha256_file(f)
