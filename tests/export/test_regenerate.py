"""Random-init bundles travel without their weights (issue 19): the weights are drawn again from the manifest's
record and each file is checked against the manifest's sha256 before anything loads it.

The tiny bundle's weights are the tiny preset drawn with seed 0 on this CPU (write_tiny_checkpoint draws them so
and round-trips them through a real checkpoint), so relabelling its manifest as that random-init makes a bundle
whose every weight byte is known, without another compile."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import as_random_init

from runner.bundle import read_manifest, verify_bundle, weight_files
from runner.digests import sha256_file
from runner.errors import RunnerError
from runner.export.checkpoint import TINY_SEED, random_model
from runner.export.regenerate import regenerate

ROOT = Path(__file__).resolve().parents[2]


def test_the_weights_are_drawn_again_byte_for_byte_and_the_bundle_verifies(tiny_bundle, tmp_path):
    want = {n: sha256_file(tiny_bundle / n) for n in weight_files(read_manifest(tiny_bundle))}
    bundle = as_random_init(tiny_bundle, tmp_path / "b")
    assert not any((bundle / n).exists() for n in want)
    assert sorted(regenerate(bundle)) == sorted(want)
    assert {n: sha256_file(bundle / n) for n in want} == want
    verify_bundle(bundle)
    assert regenerate(bundle) == []  # all there: nothing to draw
    assert sorted(p.name for p in bundle.iterdir()) == sorted(p.name for p in tiny_bundle.iterdir())


def test_a_different_seed_is_caught_by_the_digest_and_leaves_nothing_behind(tiny_bundle, tmp_path):
    source = random_model("tiny", TINY_SEED + 1)[1].to_dict()
    bundle = as_random_init(tiny_bundle, tmp_path / "b", seed=source["seed"], weights_digest=source["weights_digest"])
    before = sorted(p.name for p in bundle.iterdir())
    with pytest.raises(RunnerError, match="do not match the manifest"):
        regenerate(bundle)
    assert sorted(p.name for p in bundle.iterdir()) == before


def test_weights_from_another_generator_or_a_checkpoint_are_refused_in_one_line(tiny_bundle, tmp_path):
    other = as_random_init(tiny_bundle, tmp_path / "other", generator="torch 2.11.0+cu130 cuda")
    with pytest.raises(RunnerError, match="drawn by torch 2.11.0\\+cu130 cuda; this machine has torch"):
        regenerate(other)
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_bundle, checkpoint)
    (checkpoint / "text_decoder.safetensors").unlink()
    with pytest.raises(RunnerError, match="only random-init weights can be drawn again"):
        regenerate(checkpoint)


def test_the_cli_regenerates_and_says_so(tiny_bundle, tmp_path):
    bundle = as_random_init(tiny_bundle, tmp_path / "b")
    r = subprocess.run(
        [sys.executable, "-m", "runner", "export", "--regenerate", str(bundle)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "sha256 matches the manifest" in r.stderr and r.stdout.strip() == str(bundle)
    verify_bundle(bundle)
    no_torch = "import sys; from runner.app.cli import main; rc = main(sys.argv[1:]); assert 'torch' not in sys.modules; sys.exit(rc)"
    r = subprocess.run(
        [sys.executable, "-c", no_torch, "export", "--regenerate", str(bundle)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0 and "every weight file is there" in r.stderr, r.stderr  # nothing drawn: torch not needed
    r = subprocess.run(
        [sys.executable, "-m", "runner", "export", "--regenerate", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
