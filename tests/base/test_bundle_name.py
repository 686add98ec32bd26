"""A bundle's name (runner/bundle_name.py): what the export's default --out, the nox sessions' bundles and the CI
artifacts are called, carrying what the bundle needs to run: model, device, dtype, quantisation, torch release."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runner.bundle_name import bundle_name, torch_tag
from runner.errors import RunnerError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "kw", "name"),
    [
        (("tiny", "cpu", "fp32", "2.13.0+cpu"), {}, "voxtral-bundle-tiny-cpu-fp32-torch2.13"),
        (("tiny", "cpu", "bf16", "2.13.0+cpu"), {"quant": "none"}, "voxtral-bundle-tiny-cpu-bf16-torch2.13"),
        (
            ("voxtral-mini-3b", "cuda", "bf16", "2.13.0"), {"quant": "int4", "random_init": True},
            "voxtral-bundle-voxtral-mini-3b-random-cuda-bf16-int4-torch2.13",
        ),
        (
            ("mistralai/Voxtral-Mini-3B-2507", "cuda", "bf16", "2.13.1+cu128"), {},
            "voxtral-bundle-mistralai--Voxtral-Mini-3B-2507-cuda-bf16-torch2.13",
        ),
        (("/data/ckpt/Voxtral Mini/", "cuda", "fp32", "2.14.0a0+gitabc"), {}, "voxtral-bundle-Voxtral-Mini-cuda-fp32-torch2.14"),
        (("whisper-tiny.en", "cpu", "fp32", "2.13.0+cpu"), {}, "voxtral-bundle-whisper-tiny.en-cpu-fp32-torch2.13"),
    ],
)  # fmt: skip
def test_the_name_carries_model_device_dtype_quant_and_torch(args, kw, name):
    assert bundle_name(*args, **kw) == name


def test_patch_releases_share_a_name_and_minor_releases_do_not():
    """A .so runs only under the torch that built it; patch releases keep the ABI."""
    names = {v: bundle_name("tiny", "cpu", "fp32", v) for v in ("2.13.0", "2.13.1+cpu", "2.14.0", "3.13.0")}
    assert names["2.13.0"] == names["2.13.1+cpu"]
    assert len({names["2.13.0"], names["2.14.0"], names["3.13.0"]}) == 3


@pytest.mark.parametrize(
    ("version", "tag"),
    [("2.13.0", "torch2.13"), ("2.13.0+cpu", "torch2.13"), ("2.14.0.dev20260101+cu128", "torch2.14"),
     ("2.13.0a0+git1234abc", "torch2.13"), ("10.2", "torch10.2"), ("v2.13.0", "torch2.13")],
)  # fmt: skip
def test_the_torch_tag_is_major_dot_minor(version, tag):
    assert torch_tag(version) == tag


@pytest.mark.parametrize("version", ["", "2", "nightly", "latest-2.13"])
def test_a_version_without_major_and_minor_is_refused(version):
    with pytest.raises(RunnerError, match="torch version"):
        torch_tag(version)


def test_the_module_needs_only_the_stdlib():
    """CI names the bundle in a bare Python (`-S`: no site-packages, so no torch, numpy or the installed package)."""
    code = "import runner.bundle_name as b; print(b.bundle_name('tiny', 'cpu', 'fp32', '2.13.0'))"
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == "voxtral-bundle-tiny-cpu-fp32-torch2.13\n"
