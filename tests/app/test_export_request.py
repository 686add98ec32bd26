"""`export` asked again for the bundle it left at --out answers "up to date" before torch is imported; a request
that differs in any input, or a bundle changed since, goes the whole way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import CACHE

from runner.app import export_request
from runner.app.cli import build_parser
from runner.bundle import MANIFEST_NAME

REPO = Path(__file__).resolve().parents[2]
TINY = ["--preset", "tiny", "--device", "cpu", "--max-audio-chunks", "2", "--max-seq-len", "1024"]
NO_TORCH = "import sys; from runner.app.cli import main; rc = main(sys.argv[1:]); assert 'torch' not in sys.modules; sys.exit(rc)"


def args_for(*argv: str):
    return build_parser().parse_args(["export", *argv])


def key(*argv: str) -> str | None:
    return export_request.request_key(args_for(*argv), {"pdl": True, "debug_compile": False})


def test_a_repeated_export_is_up_to_date_without_importing_torch(tmp_path):
    out = tmp_path / "tiny"
    env = {**os.environ, "VOXTRAL_RUNNER_CACHE": str(CACHE), "PYTHONPATH": str(REPO)}  # the tests' compiles
    cmd = [sys.executable, "-m", "runner", "export", *TINY, "--out", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert first.returncode == 0 and "is up to date" not in first.stderr, first.stderr[-2000:]
    before = (out / MANIFEST_NAME).read_bytes()
    again = [sys.executable, "-c", NO_TORCH, "export", *TINY, "--out", str(out)]
    second = subprocess.run(again, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stderr.strip() == f"bundle: {out} is up to date" and second.stdout.strip() == str(out)
    assert (out / MANIFEST_NAME).read_bytes() == before


def test_the_key_follows_every_option_and_the_checkpoints_files(tmp_path):
    base = key(*TINY, "--out", "a")
    assert base == key(*TINY, "--out", "a")
    for other in (
        ["--out", "b"],
        ["--out", "a", "--no-check"],
        ["--out", "a", "--dtype", "bf16"],
        ["--out", "a", "--seed", "3"],
    ):
        assert key(*TINY, *other) != base, other
    assert key("--preset", "tiny", "--out", "a") is None  # the device's default asks CUDA: only torch knows
    assert key("--preset", "tiny", "--device", "cpu") is None  # the default --out is named after the model
    assert export_request.request_key(args_for(*TINY, "--out", "a"), {"pdl": False, "debug_compile": False}) != base
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with_ckpt = key("--checkpoint", str(ckpt), "--device", "cpu", "--out", "a")
    os.utime(ckpt / "config.json", ns=(1, 1))
    assert key("--checkpoint", str(ckpt), "--device", "cpu", "--out", "a") != with_ckpt


def test_a_bundle_changed_since_is_not_fresh(tiny_bundle, tmp_path):
    out, cache = tmp_path / "tiny", tmp_path / "cache"
    shutil.copytree(tiny_bundle, out)
    request = key(*TINY, "--out", str(out))
    assert not export_request.is_fresh(out, request, cache)  # never remembered
    export_request.remember(out, request, cache)
    assert export_request.is_fresh(out, request, cache)
    assert not export_request.is_fresh(out, key(*TINY, "--out", str(out), "--no-check"), cache)
    weights = next(out.glob("token_embedding*.safetensors"))
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 1
    weights.write_bytes(bytes(damaged))
    assert not export_request.is_fresh(out, request, cache)  # the manifest is the same; the file is not
    shutil.rmtree(out)
    shutil.copytree(tiny_bundle, out)
    export_request.remember(out, request, cache)
    manifest = out / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"created_by"', '"created_by" ', 1))
    assert not export_request.is_fresh(out, request, cache)
