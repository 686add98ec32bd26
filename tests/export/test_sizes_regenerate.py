"""Sizes a bundle is built or drawn with, and what `export --regenerate` may call done.

`export`'s size flags are whole numbers in a range at the parser (one argparse line naming the flag, never a
TypeError or an allocation deep in torch); a manifest's sizes are checked against the same ranges as it is read,
before --regenerate allocates anything. --regenerate verifies the weight files that are there, draws again one
whose bytes are not the manifest's, and refuses a link: whatever it reports as done passes ci_scripts/check_bundle.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import as_random_init, error_line, parse_error
from script_module import load_module

from runner.app.cli import build_parser, main
from runner.bundle import MANIFEST_NAME, read_manifest, weight_files
from runner.digests import sha256_file
from runner.errors import BundleError
from runner.manifest_fields import MAX_AUDIO_CHUNKS, MAX_BATCH, MAX_SEQ_LEN, MAX_STREAMS

ROOT = Path(__file__).resolve().parents[2]
check_bundle = load_module("check_bundle", ROOT / "ci_scripts" / "check_bundle.py")

SIZE_FLAGS = {
    "--max-batch": MAX_BATCH,
    "--max-streams": MAX_STREAMS,
    "--max-seq-len": MAX_SEQ_LEN,
    "--max-audio-chunks": MAX_AUDIO_CHUNKS,
}


# ---------------------------------------------------------------- the parser


@pytest.mark.parametrize("flag", [*SIZE_FLAGS, "--seed"])
@pytest.mark.parametrize("value", ["1e20", str(10**20), "nan", "inf", "abc", "-1", "2.5", ""])
def test_an_export_size_out_of_range_is_one_argparse_line(flag, value, capsys):
    line = parse_error(["export", f"{flag}={value}"], capsys)
    assert f"error: argument {flag}: {value!r}: a whole number from " in line, line


@pytest.mark.parametrize("flag, most", SIZE_FLAGS.items())
def test_an_export_size_takes_one_to_its_bound(flag, most, capsys):
    assert getattr(build_parser().parse_args(["export", flag, str(most)]), flag[2:].replace("-", "_")) == most
    assert getattr(build_parser().parse_args(["export", flag, "1"]), flag[2:].replace("-", "_")) == 1
    for bad in ("0", str(most + 1)):
        assert f"{bad!r}: a whole number from 1 to {most:,}" in parse_error(["export", flag, bad], capsys)


def test_the_reported_export_sizes_never_reach_the_export(tmp_path, capsys):
    for flag in SIZE_FLAGS:
        with pytest.raises(SystemExit):
            main(["export", "--preset", "tiny", "--device", "cpu", "--out", str(tmp_path / "b"), flag, "1e20"])
        assert f"argument {flag}: '1e20'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_default_context_of_the_longest_audio_fits_the_bound():
    from runner.audio import context_for

    assert context_for(MAX_AUDIO_CHUNKS) <= MAX_SEQ_LEN


# ---------------------------------------------------------------- the manifest's sizes


def with_model_field(bundle: Path, key: str, value) -> None:
    data = json.loads((bundle / MANIFEST_NAME).read_text())
    data["model"][key] = value
    (bundle / MANIFEST_NAME).write_text(json.dumps(data, indent=2))


@pytest.mark.parametrize(
    "key, value",
    [("max_seq_len", 10**12), ("max_seq_len", 1e12), ("max_audio_chunks", 10**9), ("max_batch", 2**40),
     ("max_streams", 10**7)],
)  # fmt: skip
def test_a_manifest_size_out_of_range_is_one_line_before_anything_is_drawn(tiny_bundle, tmp_path, capsys, key, value):
    bundle = as_random_init(tiny_bundle, tmp_path / "b")
    with_model_field(bundle, key, value)
    before = sorted(p.name for p in bundle.iterdir())
    with pytest.raises(BundleError, match=f"model.{key} is .*, expected a whole number from 1 to"):
        read_manifest(bundle)
    assert main(["export", "--regenerate", str(bundle)]) == 1
    assert f"model.{key}" in error_line(capsys)
    assert sorted(p.name for p in bundle.iterdir()) == before


@pytest.mark.parametrize("seed", [-1, 2**64, "0", None])
def test_a_bad_seed_record_is_one_line(tiny_bundle, tmp_path, capsys, seed):
    bundle = as_random_init(tiny_bundle, tmp_path / "b", seed=seed)
    assert main(["export", "--regenerate", str(bundle)]) == 1
    assert "model.source.seed" in error_line(capsys)


# ---------------------------------------------------------------- what --regenerate calls done


@pytest.fixture
def drawn(tiny_bundle, tmp_path) -> tuple[Path, str]:
    """A random-init bundle with its weights drawn (the name of the text decoder's weights)."""
    bundle = as_random_init(tiny_bundle, tmp_path / "b")
    assert main(["export", "--regenerate", str(bundle)]) == 0
    assert check_bundle.main([str(bundle)]) == 0
    name = next(n for n in weight_files(read_manifest(bundle)) if "text_decoder" in n)
    return bundle, name


def passes_check_bundle(bundle: Path, capsys) -> bool:
    capsys.readouterr()
    return check_bundle.main([str(bundle)]) == 0


def test_a_flipped_byte_is_drawn_again_and_the_bundle_checks(drawn, capsys):
    bundle, name = drawn
    want = sha256_file(bundle / name)
    data = bytearray((bundle / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (bundle / name).write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["export", "--regenerate", str(bundle)]) == 0
    err = capsys.readouterr().err
    assert "1 weight files drawn again" in err and "sha256 did not match the manifest" in err, err
    assert sha256_file(bundle / name) == want
    assert passes_check_bundle(bundle, capsys)


def test_a_cut_file_is_drawn_again(drawn, capsys):
    bundle, name = drawn
    want = sha256_file(bundle / name)
    with open(bundle / name, "r+b") as f:
        f.truncate(100)
    assert main(["export", "--regenerate", str(bundle)]) == 0
    assert sha256_file(bundle / name) == want and passes_check_bundle(bundle, capsys)


def test_a_hard_linked_copy_elsewhere_keeps_its_bytes(drawn, tmp_path, capsys):
    """The redrawn file replaces the damaged one by a rename: the other name of its inode is not written."""
    bundle, name = drawn
    (bundle / name).write_bytes(b"damaged")
    os.link(bundle / name, tmp_path / "elsewhere")
    assert main(["export", "--regenerate", str(bundle)]) == 0
    assert (tmp_path / "elsewhere").read_bytes() == b"damaged" and passes_check_bundle(bundle, capsys)


@pytest.mark.parametrize("target", ["a good copy", "a damaged copy", "nothing"])
def test_a_linked_weights_file_is_refused_and_nothing_is_written(drawn, tmp_path, capsys, target):
    bundle, name = drawn
    outside = tmp_path / "users_file.safetensors"
    if target != "nothing":
        shutil.copy(bundle / name, outside)
        if target == "a damaged copy":
            outside.write_bytes(b"the user's own bytes")
    before = outside.read_bytes() if outside.exists() else None
    (bundle / name).unlink()
    (bundle / name).symlink_to(outside)
    capsys.readouterr()
    assert main(["export", "--regenerate", str(bundle)]) == 1
    line = error_line(capsys)
    assert line.startswith(f"error: {bundle / name}: a link"), line
    assert (bundle / name).is_symlink() and os.readlink(bundle / name) == str(outside)
    assert (outside.read_bytes() if outside.exists() else None) == before
    assert not passes_check_bundle(bundle, capsys)  # refused, not reported done


def test_a_directory_in_place_of_a_weights_file_is_refused(drawn, capsys):
    bundle, name = drawn
    (bundle / name).unlink()
    (bundle / name).mkdir()
    capsys.readouterr()
    assert main(["export", "--regenerate", str(bundle)]) == 1
    assert "not a regular file" in error_line(capsys) and (bundle / name).is_dir()


def test_checkpoint_weights_that_are_damaged_are_refused_not_drawn(tiny_bundle, tmp_path, capsys):
    bundle = tmp_path / "ckpt"
    shutil.copytree(tiny_bundle, bundle)
    name = weight_files(read_manifest(bundle))[0]
    (bundle / name).write_bytes(b"damaged")
    assert main(["export", "--regenerate", str(bundle)]) == 1
    line = error_line(capsys)
    assert "sha256" in line or "size" in line
    assert "only random-init weights can be drawn again" in line
    assert (bundle / name).read_bytes() == b"damaged"


def test_all_there_and_verified_needs_no_torch(drawn, capsys):
    import subprocess
    import sys

    bundle, _ = drawn
    no_torch = (
        "import sys; from runner.app.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    r = subprocess.run(
        [sys.executable, "-c", no_torch, "export", "--regenerate", str(bundle)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode == 0 and "every weight file is there" in r.stderr, r.stderr
